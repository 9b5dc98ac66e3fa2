/* bsr_cpu_pool.c: the persistent worker pool of the CPU library (see bsr_cpu_pool.h). */
#include "bsr_cpu_pool.h"

#include <pthread.h>
#include <stddef.h>

static pthread_mutex_t g_pool_use = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER, g_done = PTHREAD_COND_INITIALIZER;
static int g_workers = 0, g_pending = 0;
static const bsr_task* g_assigned[BSR_CPU_MAX_THREADS];
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void* worker_main(void* arg) {
    const int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!g_assigned[me]) pthread_cond_wait(&g_work, &g_mu);
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
    for (int i = 0; i < BSR_CPU_MAX_THREADS; ++i) g_assigned[i] = NULL;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

void bsr_pool_run(const bsr_task* tasks, int64_t n) {
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
            ++g_workers;
        }
        helpers = n - 1 < g_workers ? n - 1 : g_workers;
        for (int64_t i = 0; i < helpers; ++i) g_assigned[i] = &tasks[i + 1];
        g_pending = (int)helpers;
        pthread_cond_broadcast(&g_work);
        pthread_mutex_unlock(&g_mu);
    }
    for (int64_t i = helpers + 1; i < n; ++i) tasks[i].run(tasks[i].arg);
    tasks[0].run(tasks[0].arg);
    if (pooled) {
        pthread_mutex_lock(&g_mu);
        while (g_pending > 0) pthread_cond_wait(&g_done, &g_mu);
        pthread_mutex_unlock(&g_mu);
        pthread_mutex_unlock(&g_pool_use);
    }
}
