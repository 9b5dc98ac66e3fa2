/*
 * bsr_cpu_pool.h: the host worker pool shared by the CPU library's entry points (install/gather
 * in bsr_install_cpu.c, copy-and-checksum in bsr_crc32c.c).
 *
 * bsr_pool_run(tasks, n) runs tasks[1..n-1] on pool workers and tasks[0] in the caller's thread,
 * and returns when all have run. Workers are started at first use and kept (a call does not pay
 * for creating a thread); one call uses the pool at a time: a concurrent caller runs all its tasks in
 * its own thread. A fork child starts with no workers (pthread_atfork).
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

void bsr_pool_run(const bsr_task* tasks, int64_t n);
int bsr_pool_spread(int on);
int bsr_spread_enabled(void);
void bsr_keep_off_caller(const pthread_t* tids, int n, int* kept_off);

#endif
