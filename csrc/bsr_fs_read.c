/*
 * bsr_fs_read.c: the filesystem tier's object reads and probes (bsr_runtime/tiers/fs_native.py).
 *
 * Why in C: read one object at a time from Python and every open, fstat, read and close releases
 * and takes back the GIL; while the engine's step thread runs Python each take-back can wait a
 * switch interval, so a restore running beside the engine pays per object, not per window. Reads run
 * on a reader's own threads (below) and never touch the interpreter; a probe is one call per window.
 *
 * The same rules as the Python path (fs_open.py): each object is opened with one
 * openat2(root_fd, "ab/cd/<hash>.bsr", RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH)
 * and the caller's flags (O_NOFOLLOW | O_NONBLOCK, so a FIFO never blocks), must be a regular file of
 * exactly object_size bytes, and is read whole (short reads retried from where they stopped). What
 * an object's header means is checked by the caller; this file only moves bytes and reports per object.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "bsr_abi.h"
#include "bsr_cpu_pool.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS_ 0x02
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08

struct open_how_ {
    uint64_t flags, mode, resolve;
};

static int open_beneath(int root_fd, const char* relpath, int64_t flags) {
    struct open_how_ how = {(uint64_t)flags, 0,
                            RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_MAGICLINKS_ | RESOLVE_BENEATH_};
    long fd;
    do {
        fd = syscall(SYS_openat2, root_fd, relpath, &how, sizeof how);
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : (int)fd;
}

/* Bytes read into head then body from offset 0, until both are full or EOF. */
static int64_t read_whole(int fd, uint8_t* head, int64_t head_bytes, uint8_t* body, int64_t body_bytes) {
    int64_t total = 0, want = head_bytes + body_bytes;
    while (total < want) {
        struct iovec iov[2];
        int cnt = 0;
        if (total < head_bytes) iov[cnt++] = (struct iovec){head + total, (size_t)(head_bytes - total)};
        int64_t in_body = total > head_bytes ? total - head_bytes : 0;
        iov[cnt++] = (struct iovec){body + in_body, (size_t)(body_bytes - in_body)};
        ssize_t n = preadv(fd, iov, cnt, (off_t)total);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (n == 0) break;
        total += n;
    }
    return total;
}

static int64_t read_one(int root_fd, const char* relpath, int64_t flags, int64_t object_size, uint8_t* head,
                        int64_t head_bytes, uint8_t* body, uint32_t* crc) {
    int fd = open_beneath(root_fd, relpath, flags);
    if (fd < 0) return -fd;
    struct stat st;
    int64_t status = 0;
    if (fstat(fd, &st) != 0) {
        status = errno;
    } else if (!S_ISREG(st.st_mode)) {
        status = BSR_FS_NOT_REGULAR;
    } else if ((int64_t)st.st_size != object_size) {
        status = BSR_FS_WRONG_SIZE;
    } else {
        int64_t got = read_whole(fd, head, head_bytes, body, object_size - head_bytes);
        if (got < 0)
            status = -got;
        else if (got != object_size)
            status = BSR_FS_SHORT;
        else
            *crc = bsr_crc32c(0, body, object_size - head_bytes);
    }
    close(fd);
    return status;
}

BSR_CPU_API int bsr_fs_probe_objects(int root_fd, int64_t n, const int64_t* relpaths, int64_t flags,
                                     int64_t object_size, int64_t* status) {
    if (n < 0 || (n > 0 && (!relpaths || !status))) return -1;
    for (int64_t i = 0; i < n; ++i) {
        int fd = open_beneath(root_fd, (const char*)(intptr_t)relpaths[i], flags);
        if (fd < 0) {
            status[i] = -fd;
            continue;
        }
        struct stat st;
        if (fstat(fd, &st) != 0)
            status[i] = errno;
        else if (!S_ISREG(st.st_mode))
            status[i] = BSR_FS_NOT_REGULAR;
        else if ((int64_t)st.st_size != object_size)
            status[i] = BSR_FS_WRONG_SIZE;
        else
            status[i] = 0;
        close(fd);
    }
    return 0;
}

/* ---- the reader: reads that start and end without the interpreter --------------------------------
 *
 * Why: a window's read handed to a Python worker thread woke it, gave it the GIL for its own Python
 * (paths, headers, completion) and took it back, several times per window; at small windows (W = 8:
 * 256 windows at 256K tokens) those hand-offs, not the bytes, were most of a restore. A reader's
 * threads are plain threads: a job (one window's objects) is queued, read object by object by the
 * first free thread (read_one), and waited for with a bound; the interpreter
 * is touched only by the caller, to submit and to wait (ctypes releases the GIL for both).
 *
 * Deadlines and close: an object not started by its job's deadline is not read (BSR_FS_LATE), nor one
 * after an object of its job that failed (BSR_FS_SKIPPED); close cancels every object not started
 * (BSR_FS_CANCELLED) and waits, bounded, for the threads: a thread stuck in
 * a read (a hung network filesystem) is left running and the reader is then never freed, since that
 * thread still uses it. A job has ended once each of its objects was read, skipped or cancelled; only
 * then can nothing write into its bodies any more.
 */

typedef struct fs_job {
    int64_t id, n, next, ended; /* next: the first object no thread took yet */
    int64_t waiters;            /* callers inside bsr_fs_reader_wait on it: it is not freed under them */
    int forgotten;              /* forgotten while waited on: the last waiter frees it */
    const int64_t* relpaths;
    int64_t flags, object_size, head_bytes;
    uint8_t* heads;
    const int64_t* bodies;
    uint32_t* crcs;
    int64_t* status;
    int64_t deadline_ns; /* CLOCK_MONOTONIC, as Python's time.monotonic_ns() */
    struct fs_job* link;
} fs_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job queued, the hold lifted, or close */
    pthread_cond_t done; /* an object ended, or a thread exited */
    fs_job* jobs;        /* every job not forgotten, oldest first */
    int64_t next_id, threads, running;
    int root_fd, closing, hold, held; /* held: threads waiting under hold */
    int kept_off;                     /* the CPU the threads' affinity excludes (bsr_keep_off_caller) */
    pthread_t* tids;
} fs_reader;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* now + timeout_ns, saturating (a timeout of "forever" does not wrap around) */
static int64_t until_ns(int64_t timeout_ns) {
    int64_t now = now_ns();
    if (timeout_ns <= 0) return now;
    return timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
}

static void end_objects(fs_reader* r, fs_job* j, int64_t from, int64_t code) {
    for (int64_t i = from; i < j->n; ++i) j->status[i] = code;
    j->ended += j->n - from;
    j->next = j->n;
    pthread_cond_broadcast(&r->done);
}

static fs_job* claimable(fs_reader* r) {
    for (fs_job* j = r->jobs; j; j = j->link)
        if (j->next < j->n) return j;
    return NULL;
}

static void* reader_main(void* arg) {
    fs_reader* r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        fs_job* j;
        while (!r->closing && !(j = claimable(r))) pthread_cond_wait(&r->work, &r->mu);
        if (r->closing) break;
        int64_t i = j->next++;
        if (now_ns() > j->deadline_ns) { /* this and every later object of the job: not read */
            j->next = i;
            end_objects(r, j, i, BSR_FS_LATE);
            continue;
        }
        if (r->hold) { /* tests: a read that does not return */
            r->held++;
            while (r->hold) pthread_cond_wait(&r->work, &r->mu);
            r->held--;
        }
        pthread_mutex_unlock(&r->mu);
        j->crcs[i] = 0;
        int64_t st = read_one(r->root_fd, (const char*)(intptr_t)j->relpaths[i], j->flags, j->object_size,
                              j->heads + i * j->head_bytes, j->head_bytes, (uint8_t*)(intptr_t)j->bodies[i],
                              &j->crcs[i]);
        pthread_mutex_lock(&r->mu);
        j->status[i] = st;
        if (st != 0 && j->next < j->n) end_objects(r, j, j->next, BSR_FS_SKIPPED); /* the job fails anyway */
        if (++j->ended == j->n) pthread_cond_broadcast(&r->done);
    }
    r->running--;
    pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

BSR_CPU_API void* bsr_fs_reader_open(int root_fd, int64_t threads) {
    if (threads < 1 || threads > 1024) return NULL;
    fs_reader* r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->tids = calloc((size_t)threads, sizeof *r->tids);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!r->tids || pthread_mutex_init(&r->mu, NULL) || pthread_cond_init(&r->work, &ca) ||
        pthread_cond_init(&r->done, &ca)) {
        pthread_condattr_destroy(&ca);
        free(r->tids);
        free(r);
        return NULL;
    }
    pthread_condattr_destroy(&ca);
    r->root_fd = root_fd;
    r->kept_off = -1;
    pthread_mutex_lock(&r->mu);
    for (int64_t t = 0; t < threads; ++t) {
        if (pthread_create(&r->tids[t], NULL, reader_main, r) != 0) break;
        r->threads++;
        r->running++;
    }
    pthread_mutex_unlock(&r->mu);
    if (r->threads == 0) {
        free(r->tids);
        free(r);
        return NULL;
    }
    return r;
}

BSR_CPU_API int64_t bsr_fs_reader_submit(void* reader, int64_t n, const int64_t* relpaths, int64_t flags,
                                         int64_t object_size, int64_t head_bytes, void* heads, const int64_t* bodies,
                                         uint32_t* crcs, int64_t* status, int64_t deadline_ns) {
    fs_reader* r = reader;
    if (!r || n < 1 || head_bytes < 0 || object_size < head_bytes || !relpaths || !heads || !bodies || !crcs ||
        !status)
        return -1;
    fs_job* j = calloc(1, sizeof *j);
    if (!j) return -1;
    *j = (fs_job){.n = n, .relpaths = relpaths, .flags = flags, .object_size = object_size, .head_bytes = head_bytes,
                  .heads = heads, .bodies = bodies, .crcs = crcs, .status = status, .deadline_ns = deadline_ns};
    pthread_mutex_lock(&r->mu);
    if (r->closing) {
        pthread_mutex_unlock(&r->mu);
        free(j);
        return -2;
    }
    j->id = r->next_id++;
    /* a woken reader thread queued on the submitter's CPU would stall the restore's own thread (its
     * install, its next window's submit) for a whole read: kept off it, as the pool's workers are */
    if (bsr_spread_enabled()) bsr_keep_off_caller(r->tids, (int)r->threads, &r->kept_off);
    fs_job** tail = &r->jobs;
    while (*tail) tail = &(*tail)->link;
    *tail = j;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    return j->id;
}

static fs_job* find_job(fs_reader* r, int64_t id) {
    for (fs_job* j = r->jobs; j; j = j->link)
        if (j->id == id && !j->forgotten) return j;
    return NULL;
}

static void free_job(fs_reader* r, fs_job* j) {
    for (fs_job** p = &r->jobs; *p; p = &(*p)->link)
        if (*p == j) {
            *p = j->link;
            break;
        }
    free(j);
}

BSR_CPU_API int bsr_fs_reader_wait(void* reader, int64_t job, int64_t timeout_ns) {
    fs_reader* r = reader;
    if (!r) return -1;
    int64_t until = until_ns(timeout_ns);
    struct timespec ts = {until / 1000000000, until % 1000000000};
    pthread_mutex_lock(&r->mu);
    fs_job* j = find_job(r, job);
    int rc = -1;
    if (j) {
        j->waiters++; /* another caller may forget the job while this one waits (the mutex given up) */
        while (j->ended < j->n && timeout_ns > 0 && now_ns() < until)
            if (pthread_cond_timedwait(&r->done, &r->mu, &ts) == ETIMEDOUT) break;
        rc = j->ended == j->n;
        if (--j->waiters == 0 && j->forgotten) free_job(r, j);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

BSR_CPU_API int bsr_fs_reader_forget(void* reader, int64_t job) {
    fs_reader* r = reader;
    if (!r) return -1;
    pthread_mutex_lock(&r->mu);
    int rc = -1;
    fs_job* j = find_job(r, job);
    if (j && j->ended < j->n) {
        rc = 1; /* still being read: kept */
    } else if (j) {
        if (j->waiters > 0)
            j->forgotten = 1; /* unknown from now on; freed by its last waiter */
        else
            free_job(r, j);
        rc = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

BSR_CPU_API int bsr_fs_reader_hold(void* reader, int on) {
    fs_reader* r = reader;
    if (!r) return -1;
    pthread_mutex_lock(&r->mu);
    if (on >= 0) r->hold = on != 0;
    pthread_cond_broadcast(&r->work);
    int held = r->held;
    pthread_mutex_unlock(&r->mu);
    return held;
}

BSR_CPU_API int bsr_fs_reader_close(void* reader, int64_t timeout_ns) {
    fs_reader* r = reader;
    if (!r) return -1;
    int64_t until = until_ns(timeout_ns);
    struct timespec ts = {until / 1000000000, until % 1000000000};
    pthread_mutex_lock(&r->mu);
    r->closing = 1;
    for (fs_job* j = r->jobs; j; j = j->link)
        if (j->next < j->n) end_objects(r, j, j->next, BSR_FS_CANCELLED);
    pthread_cond_broadcast(&r->work);
    while (r->running > 0 && now_ns() < until)
        if (pthread_cond_timedwait(&r->done, &r->mu, &ts) == ETIMEDOUT) break;
    int stopped = r->running == 0;
    pthread_mutex_unlock(&r->mu);
    if (stopped)
        for (int64_t t = 0; t < r->threads; ++t) pthread_join(r->tids[t], NULL);
    return stopped;
}

BSR_CPU_API int bsr_fs_reader_free(void* reader) {
    fs_reader* r = reader;
    if (!r) return -1;
    pthread_mutex_lock(&r->mu);
    int busy = !r->closing || r->running > 0;
    pthread_mutex_unlock(&r->mu);
    if (busy) return 1; /* open, or a thread still in a read: never freed under it */
    while (r->jobs) {
        fs_job* j = r->jobs;
        r->jobs = j->link;
        free(j);
    }
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
    pthread_mutex_destroy(&r->mu);
    free(r->tids);
    free(r);
    return 0;
}
