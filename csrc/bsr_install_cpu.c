/*
 * bsr_install_cpu.c: install (staging -> destination blocks) and gather (the inverse) on the host,
 * one call per window for every registered tensor, behind a C ABI loaded with ctypes
 * (bsr_kernels/cpu_backend.py). Plain C11, no CUDA; shares the descriptor layout and index
 * arithmetic of the CUDA kernels (bsr_layout.h).
 *
 * Work items are (chunk, tensor) segments. A segment is walked in spans of entries that stay in
 * one block; when an entry is one contiguous row and slots are back to back (slot_stride ==
 * entry_bytes) a span is one contiguous run on both sides, and runs that continue each other in
 * the destination (consecutive blocks) are merged, so most bytes move in a few large memcpy calls.
 * Other layouts copy per entry, or per row for entries split over several rows.
 * Non-temporal stores (bsr_stream.h): an install writes destination blocks the restore does not
 * read back, so it streams from bsr_stream_threshold(BSR_INTO_DESTINATIONS) bytes per window up (0
 * by default: every window); a gather writes staging the tier reads next, so it streams from
 * bsr_stream_threshold(BSR_INTO_STAGING) up (the last-level cache).
 *
 * Threads: `threads` = 1 runs in the caller's thread; n > 1 shares the items with up to n-1 workers
 * of the pool in bsr_cpu_pool.c (each takes pieces until none is left); 0 picks 1, or 2 from
 * BSR_CPU_PARALLEL_BYTES up (below it, waking a worker costs more than it saves:
 * benchmarks/bench_install.py times cpu:1t beside cpu:2t).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "bsr_abi.h"
#include "bsr_cpu_pool.h"
#include "bsr_layout.h"
#include "bsr_stream.h"

/* threads = 0 (auto): a second thread from this many bytes per window up */
#define BSR_CPU_PARALLEL_BYTES (4LL << 20)

static _Thread_local char g_error[1024] = "";

static int set_error(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof(g_error), fmt, ap);
    va_end(ap);
    return code;
}

typedef struct window {
    uint8_t* staging;     /* chunk c of the window at staging + c * chunk_stride */
    int64_t chunk_bytes;  /* bytes of one staged chunk (segments end within it) */
    int64_t chunk_stride; /* bytes from one staged chunk to the next, >= chunk_bytes; the bytes between
                             chunks are never read into destinations nor written by gather */
    int64_t first_chunk;
    int64_t num_chunks;
    const int64_t* desc;
    int64_t num_tensors;
    const int64_t* table_ptrs;
    int64_t num_groups;
    int gather;
    int stream; /* non-temporal stores (bsr_stream.h), by the window's bytes and direction */
} window;

/* A pending contiguous run: `n` bytes between staging `s` and destination `d`. */
typedef struct run {
    uint8_t* s;
    uint8_t* d;
    int64_t n;
} run;

static inline void move(void* to, const void* from, int64_t n, int stream) {
    if (stream)
        bsr_copy_nt(to, from, (size_t)n);
    else
        memcpy(to, from, (size_t)n);
}

static inline void flush(run* r, int gather, int stream) {
    if (r->n > 0) {
        if (gather)
            move(r->s, r->d, r->n, stream);
        else
            move(r->d, r->s, r->n, stream);
    }
    r->n = 0;
}

/* Append [s, s + n) <-> [d, d + n) to the run, merging when both sides continue it. */
static inline void push(run* r, uint8_t* s, uint8_t* d, int64_t n, int gather, int stream) {
    if (r->n > 0 && r->s + r->n == s && r->d + r->n == d) {
        r->n += n;
        return;
    }
    flush(r, gather, stream);
    r->s = s;
    r->d = d;
    r->n = n;
}

/* One entry that spans several rows: row r of the staged entry <-> its strided place. */
static inline void copy_rows(const bsr_desc* dd, uint8_t* s, uint8_t* d, int gather, int stream) {
    for (int64_t r = 0; r < dd->rows_per_entry; ++r) {
        uint8_t* dst = d + bsr_entry_offset(dd, r * dd->row_bytes);
        if (gather)
            move(s + r * dd->row_bytes, dst, dd->row_bytes, stream);
        else
            move(dst, s + r * dd->row_bytes, dd->row_bytes, stream);
    }
}

/* Segment of tensor t in window chunk c. Returns BSR_OK or BSR_ERR_INVALID (block id out of range). */
static int copy_segment(const window* w, int64_t c, int64_t t) {
    const bsr_desc dd = bsr_desc_row(w->desc, t);
    const int64_t* table = (const int64_t*)(uintptr_t)w->table_ptrs[dd.group];
    uint8_t* base = (uint8_t*)(uintptr_t)dd.dst_base;
    uint8_t* stage = w->staging + c * w->chunk_stride + dd.seg_offset;
    const int64_t eb = dd.entry_bytes, bs = dd.block_size, epc = dd.entries_per_chunk;
    const int packed = dd.rows_per_entry == 1 && dd.slot_stride == eb; /* a block's slots are one run */
    const int64_t e0 = (w->first_chunk + c) * epc;
    /* the block index and slot walked along the segment: one division per segment, not per span */
    int64_t bi = e0 / bs, slot = e0 % bs;
    run r = {0, 0, 0};
    for (int64_t i = 0; i < epc; ++bi, slot = 0) {
        const int64_t n = bs - slot < epc - i ? bs - slot : epc - i; /* entries left in this block */
        const int64_t block = table[bi];
        uint8_t* s = stage + i * eb;
        if (block < -1 || block >= dd.num_blocks) {
            flush(&r, w->gather, w->stream);
            return set_error(BSR_ERR_INVALID, "tensor %lld chunk %lld: block id %lld outside [-1, %lld)",
                             (long long)t, (long long)(w->first_chunk + c), (long long)block,
                             (long long)dd.num_blocks);
        }
        if (block < 0) { /* not resident: install skips it, gather reads zeros */
            flush(&r, w->gather, w->stream);
            if (w->gather) memset(s, 0, (size_t)(n * eb));
        } else {
            uint8_t* d = base + block * dd.block_stride + slot * dd.slot_stride;
            if (packed) {
                push(&r, s, d, n * eb, w->gather, w->stream);
            } else if (dd.rows_per_entry == 1) {
                for (int64_t k = 0; k < n; ++k) push(&r, s + k * eb, d + k * dd.slot_stride, eb, w->gather, w->stream);
            } else {
                for (int64_t k = 0; k < n; ++k) copy_rows(&dd, s + k * eb, d + k * dd.slot_stride, w->gather, w->stream);
            }
        }
        i += n;
    }
    flush(&r, w->gather, w->stream);
    if (w->gather) { /* zero the padding after the segment (and before segment 0) */
        uint8_t* chunk = w->staging + c * w->chunk_stride;
        const int64_t end = bsr_next_segment(w->desc, t, w->num_tensors, w->chunk_bytes);
        const int64_t used = dd.seg_offset + epc * eb;
        if (end > used) memset(chunk + used, 0, (size_t)(end - used));
        if (t == 0 && dd.seg_offset > 0) memset(chunk, 0, (size_t)dd.seg_offset);
    }
    return BSR_OK;
}

/* One window's items shared by the runs of bsr_pool_share: item k = chunk k / num_tensors, tensor
 * k % num_tensors. A failing run records its item and error; items after the first failure are
 * skipped, items before it still run, so the error reported is the first failing item's whatever
 * the threads did (pieces are taken in item order). */
typedef struct shared_window {
    const window* w;
    bsr_items items;
    int64_t failed_item; /* INT64_MAX: none yet; written under mu */
    pthread_mutex_t mu;
    int rc;
    char error[1024];
} shared_window;

static void run_shared(void* arg) {
    shared_window* sw = (shared_window*)arg;
    const window* w = sw->w;
    int64_t begin, end;
    while (bsr_items_take(&sw->items, &begin, &end)) {
        for (int64_t k = begin; k < end && k < __atomic_load_n(&sw->failed_item, __ATOMIC_RELAXED); ++k) {
            const int rc = copy_segment(w, k / w->num_tensors, k % w->num_tensors);
            if (rc == BSR_OK) continue;
            pthread_mutex_lock(&sw->mu);
            if (k < sw->failed_item) {
                __atomic_store_n(&sw->failed_item, k, __ATOMIC_RELAXED);
                sw->rc = rc;
                snprintf(sw->error, sizeof(sw->error), "%s", g_error);
            }
            pthread_mutex_unlock(&sw->mu);
            break;
        }
    }
    if (w->stream) bsr_stream_fence();
}

static int run_window(window* w, int64_t threads) {
    if (w->num_chunks < 0 || w->first_chunk < 0 || w->num_tensors < 0 || w->num_groups < 0 || w->chunk_bytes <= 0 ||
        w->chunk_stride < w->chunk_bytes)
        return set_error(BSR_ERR_INVALID, "invalid window: chunk_bytes=%lld chunk_stride=%lld first_chunk=%lld "
                         "num_chunks=%lld num_tensors=%lld", (long long)w->chunk_bytes, (long long)w->chunk_stride,
                         (long long)w->first_chunk, (long long)w->num_chunks, (long long)w->num_tensors);
    if (w->num_chunks == 0 || w->num_tensors == 0) return BSR_OK;
    if (!w->staging || !w->desc || !w->table_ptrs)
        return set_error(BSR_ERR_INVALID, "null staging, descriptor or table pointer");
    int64_t seg_bytes = 0;
    for (int64_t t = 0; t < w->num_tensors; ++t) {
        const bsr_desc d = bsr_desc_row(w->desc, t);
        if (d.group < 0 || d.group >= w->num_groups || !w->table_ptrs[d.group] || d.entry_bytes <= 0 || d.block_size <= 0 ||
            d.entries_per_chunk < 0 || d.dst_base == 0 || !bsr_desc_valid(&d))
            return set_error(BSR_ERR_INVALID, "tensor %lld: invalid descriptor row", (long long)t);
        if (d.seg_offset < 0 || d.seg_offset + d.entries_per_chunk * d.entry_bytes > w->chunk_bytes)
            return set_error(BSR_ERR_INVALID, "tensor %lld: segment ends past chunk_bytes %lld", (long long)t,
                             (long long)w->chunk_bytes);
        seg_bytes += d.entries_per_chunk * d.entry_bytes;
    }
    const int64_t items = w->num_chunks * w->num_tensors, total = seg_bytes * w->num_chunks;
    w->stream = total >= bsr_stream_threshold(w->gather ? BSR_INTO_STAGING : BSR_INTO_DESTINATIONS);
    if (threads <= 0) threads = total >= BSR_CPU_PARALLEL_BYTES ? 2 : 1;
    if (threads > BSR_CPU_MAX_THREADS) threads = BSR_CPU_MAX_THREADS;
    if (threads > items) threads = items;
    /* pieces of about 1/16 of a thread's share: a worker that wakes late leaves the caller at most
     * one piece to wait for */
    shared_window sw = {w, {0, items, items / (threads * 16) > 1 ? items / (threads * 16) : 1}, INT64_MAX,
                        PTHREAD_MUTEX_INITIALIZER, BSR_OK, ""};
    bsr_pool_share(&(bsr_task){run_shared, &sw}, threads);
    pthread_mutex_destroy(&sw.mu);
    if (sw.rc != BSR_OK) snprintf(g_error, sizeof(g_error), "%s", sw.error);
    return sw.rc;
}

/* ---- C ABI (prototypes and their description: bsr_abi.h) ----------------------------------------- */
BSR_CPU_API const char* bsr_cpu_last_error(void) { return g_error; }

BSR_CPU_API int bsr_cpu_abi_version(void) { return BSR_CPU_ABI_VERSION; }

BSR_CPU_API int64_t bsr_cpu_parallel_bytes(void) { return BSR_CPU_PARALLEL_BYTES; }

BSR_CPU_API int bsr_cpu_pool_spread(int on) { return bsr_pool_spread(on); }

BSR_CPU_API int bsr_cpu_pool_hold(int on) { return bsr_pool_hold(on); }

BSR_CPU_API int64_t bsr_cpu_stream_bytes(int into, int64_t bytes) { return bsr_stream_set_threshold(into, bytes); }

BSR_CPU_API int bsr_cpu_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                        int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                        const int64_t* table_ptrs, int64_t num_groups, int64_t threads) {
    window w = {(uint8_t*)staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc, num_tensors, table_ptrs,
                num_groups, 0, 0};
    return run_window(&w, threads);
}

BSR_CPU_API int bsr_cpu_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                       int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                       const int64_t* table_ptrs, int64_t num_groups, int64_t threads) {
    window w = {(uint8_t*)staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc, num_tensors, table_ptrs,
                num_groups, 1, 0};
    return run_window(&w, threads);
}
