/* bsr_cpu_pool.c: the persistent worker pool of the CPU library (see bsr_cpu_pool.h). */
#define _GNU_SOURCE /* sched_getcpu, pthread_{get,set}affinity_np */
#include "bsr_cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t g_pool_use = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER, g_done = PTHREAD_COND_INITIALIZER;
static int g_workers = 0, g_pending = 0;
static const bsr_task* g_assigned[BSR_CPU_MAX_THREADS];
static pthread_t g_tids[BSR_CPU_MAX_THREADS];
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
/* Workers kept off the caller's CPU (see bsr_pool_spread): -1 unset (BSR_CPU_SPREAD, default on). */
static int g_spread = -1;
static int g_kept_off = -1; /* the CPU the workers' affinity excludes now; -1: none */
static int g_hold = 0;      /* tests (bsr_pool_hold): while on, no worker starts a task */

static void* worker_main(void* arg) {
    const int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!g_assigned[me] || g_hold) pthread_cond_wait(&g_work, &g_mu);
        const bsr_task* job = g_assigned[me];
        g_assigned[me] = NULL;
        pthread_mutex_unlock(&g_mu);
        job->run(job->arg);
        pthread_mutex_lock(&g_mu);
        if (--g_pending == 0) pthread_cond_signal(&g_done);
    }
    return NULL;
}

static void atfork_child(void) {
    pthread_mutex_init(&g_pool_use, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_work, NULL);
    pthread_cond_init(&g_done, NULL);
    g_workers = 0;
    g_pending = 0;
    g_kept_off = -1;
    for (int i = 0; i < BSR_CPU_MAX_THREADS; ++i) g_assigned[i] = NULL;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

static int spread_on(void) {
    if (g_spread < 0) {
        const char* v = getenv("BSR_CPU_SPREAD");
        g_spread = !(v && strcmp(v, "0") == 0);
    }
    return g_spread;
}

int bsr_spread_enabled(void) { return spread_on(); }

/* Give `n` threads the caller's affinity, less `off` (-1: the caller's whole affinity); *kept_off = off.
 * Linux only: elsewhere the scheduler places them. */
static void set_affinity(const pthread_t* tids, int n, int off, int* kept_off) {
#if defined(__linux__)
    cpu_set_t mask;
    if (pthread_getaffinity_np(pthread_self(), sizeof mask, &mask) != 0) return;
    if (off >= 0) {
        CPU_CLR(off, &mask);
        if (CPU_COUNT(&mask) == 0) return; /* the caller may run on one CPU only: nothing to spread */
    }
    for (int i = 0; i < n; ++i) pthread_setaffinity_np(tids[i], sizeof mask, &mask);
    *kept_off = off;
#else
    (void)tids, (void)n, (void)off, (void)kept_off;
#endif
}

/* Why: a woken worker is often queued on the waking thread's CPU and shares it with the caller
 * until the load balancer moves it (ms later): on 2 vCPUs a two-thread copy then runs at one
 * thread's speed. Measured by benchmarks/pool_spread.py (spread on and off, side by side). Only a
 * change of the caller's CPU costs syscalls. The caller holds what guards tids and *kept_off. */
void bsr_keep_off_caller(const pthread_t* tids, int n, int* kept_off) {
#if defined(__linux__)
    const int cpu = sched_getcpu();
#else
    const int cpu = -1;
#endif
    if (cpu >= 0 && cpu != *kept_off) set_affinity(tids, n, cpu, kept_off);
}

static void set_worker_affinity(int off) { set_affinity(g_tids, g_workers, off, &g_kept_off); }

static void keep_workers_off_caller(void) { bsr_keep_off_caller(g_tids, g_workers, &g_kept_off); } /* g_mu held */

int bsr_pool_spread(int on) {
    pthread_mutex_lock(&g_pool_use);
    pthread_mutex_lock(&g_mu);
    const int was = spread_on();
    if (on >= 0) {
        g_spread = on != 0;
        if (!g_spread && g_kept_off >= 0) set_worker_affinity(-1);
    }
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_pool_use);
    return was;
}

int bsr_pool_hold(int on) {
    pthread_mutex_lock(&g_mu);
    const int was = g_hold;
    if (on >= 0) {
        g_hold = on != 0;
        if (!g_hold) pthread_cond_broadcast(&g_work);
    }
    pthread_mutex_unlock(&g_mu);
    return was;
}

void bsr_pool_share(const bsr_task* work, int64_t n) {
    int64_t helpers = 0;
    if (n > BSR_CPU_MAX_THREADS) n = BSR_CPU_MAX_THREADS;
    const int pooled = n > 1 && pthread_mutex_trylock(&g_pool_use) == 0;
    if (pooled) {
        pthread_once(&g_atfork_once, register_atfork);
        pthread_mutex_lock(&g_mu);
        while (g_workers < n - 1) { /* worker i takes g_assigned[i] */
            pthread_t tid;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            const int ok = pthread_create(&tid, &attr, worker_main, (void*)(intptr_t)g_workers) == 0;
            pthread_attr_destroy(&attr);
            if (!ok) break;
#if defined(__linux__)
            pthread_setname_np(tid, "bsr-cpu-pool"); /* what `top -H` and tests see */
#endif
            g_tids[g_workers++] = tid;
            g_kept_off = -1; /* the new worker has the creator's whole affinity */
        }
        helpers = n - 1 < g_workers ? n - 1 : g_workers;
        if (helpers > 0 && spread_on()) keep_workers_off_caller();
        for (int64_t i = 0; i < helpers; ++i) g_assigned[i] = work;
        g_pending = (int)helpers;
        pthread_cond_broadcast(&g_work);
        pthread_mutex_unlock(&g_mu);
    }
    work->run(work->arg); /* returns when no item is left to take */
    if (pooled) {
        pthread_mutex_lock(&g_mu);
        for (int64_t i = 0; i < helpers; ++i) { /* withdraw what no worker has started: nothing left for it */
            if (g_assigned[i]) {
                g_assigned[i] = NULL;
                --g_pending;
            }
        }
        while (g_pending > 0) pthread_cond_wait(&g_done, &g_mu);
        pthread_mutex_unlock(&g_mu);
        pthread_mutex_unlock(&g_pool_use);
    }
}
