/*
 * bsr_cpu_pool.h: the host worker pool shared by the CPU library's entry points (install/gather
 * in bsr_install_cpu.c, copy-and-checksum in bsr_crc32c.c).
 *
 * bsr_pool_share(work, n) runs work.run(work.arg) in the caller's thread and on up to n-1 pool
 * workers at once; each run takes items from a shared bsr_items until none is left, so the caller's
 * run alone does all of them when no worker comes. When the caller's run returns, the workers that
 * have not started yet are withdrawn: the call waits only for runs that started. Why: waking a
 * worker takes tens of microseconds on a VM (benchmarks/thread_handoff.py), as long as a small
 * window's whole install; with a fixed split the call waited for the late worker's share, now the
 * worker takes what is left when it wakes. Workers are started at first use and kept (a call does
 * not pay for creating a thread); one call uses the pool at a time: a concurrent caller runs alone.
 * A fork child starts with no workers (pthread_atfork).
 *
 * bsr_pool_hold(on), for tests: while on (1) no worker starts a task (a worker the scheduler has not run
 * yet); 0 lets them, -1 only reads it; returns the previous setting.
 *
 * bsr_items_take(items, &begin, &end): the next piece [begin, end) of items->count items, pieces of
 * items->piece (>= 1); 0 when none is left. Any thread, in any order.
 *
 * Spread (on unless BSR_CPU_SPREAD=0): the workers' affinity excludes the CPU the caller runs on
 * when it starts a call, so the helper is not queued behind the caller on one CPU.
 * bsr_pool_spread(on) sets it (1/0) or only reads it (-1), returns the previous setting. The
 * filesystem tier's reader threads (bsr_fs_read.c) are kept off their submitter's CPU the same way:
 * bsr_spread_enabled() reads the setting without waiting for a running call, bsr_keep_off_caller
 * excludes the calling thread's CPU from n threads' affinity when it changed (*kept_off: the CPU
 * excluded now, -1 none).
 */
#ifndef BSR_CPU_POOL_H
#define BSR_CPU_POOL_H

#include <pthread.h>
#include <stdint.h>

#define BSR_CPU_MAX_THREADS 16

typedef struct bsr_task {
    void (*run)(void* arg);
    void* arg;
} bsr_task;

typedef struct bsr_items {
    int64_t next, count, piece;
} bsr_items;

static inline int bsr_items_take(bsr_items* it, int64_t* begin, int64_t* end) {
    const int64_t b = __atomic_fetch_add(&it->next, it->piece, __ATOMIC_RELAXED);
    if (b >= it->count) return 0;
    *begin = b;
    *end = it->count - b < it->piece ? it->count : b + it->piece;
    return 1;
}

void bsr_pool_share(const bsr_task* work, int64_t n);
int bsr_pool_hold(int on);
int bsr_pool_spread(int on);
int bsr_spread_enabled(void);
void bsr_keep_off_caller(const pthread_t* tids, int n, int* kept_off);

#endif
