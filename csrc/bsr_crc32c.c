/*
 * bsr_crc32c.c: CRC-32C (Castagnoli, the checksum of the tiers' object formats) on host memory,
 * and a copy that checksums what it lands, behind the CPU library's C ABI (bsr_kernels/host_crc.py).
 *
 * CRC, the fastest the CPU has (checked at run time, x86-64): from 1 KiB up, carry-less multiply
 * folding with AVX-512 VPCLMULQDQ (fold_update); else SSE4.2 `crc32` in three independent streams over 3 x 8 KiB (then
 * 3 x 256 B) blocks so the instruction's 3-cycle latency is hidden, joined with a zeros-shift
 * operator (the register update over n zero bytes is linear in the register, so it is 4 table
 * lookups; tables built at first use); else a byte-wise table. BSR_CRC_NO_FOLD=1 turns the
 * folding off (tests compare both with google_crc32c).
 *
 * copy + CRC: with the folding, each 256-byte block of a payload is loaded once, stored to the
 * destination and folded from the same registers (fold_copy_update): one pass over memory, and
 * the checksum is of exactly the bytes stored; a call that moves at least the last-level cache
 * stores non-temporally (bsr_stream.h). Without it, the payload moves in 16 KiB pieces, each
 * checksummed in the destination right after it landed, while it is still in L1/L2. Objects are
 * split over `threads` threads (0: 1, or 2 from BSR_CRC_PARALLEL_BYTES up) from the shared pool.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bsr_abi.h"
#include "bsr_cpu_pool.h"
#include "bsr_stream.h"

#define POLY 0x82F63B78u /* reflected Castagnoli */
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
#define PIECE (16 << 10)
#define BSR_CRC_PARALLEL_BYTES (4LL << 20)
#define FOLD_MIN 1024 /* below it the 3-stream crc32 loop is as fast */

static uint32_t g_table[256];
static uint32_t g_long[4][256], g_short[4][256];
static int g_hw = 0;   /* set once by build(): the crc32 instruction */
static int g_fold = 0; /* and AVX-512 + VPCLMULQDQ folding (x86-64 only) */

static uint32_t sw_update(uint32_t r, const uint8_t* p, size_t n) {
    while (n--) r = g_table[(r ^ *p++) & 0xff] ^ (r >> 8);
    return r;
}

static uint32_t shift(const uint32_t t[4][256], uint32_t r) {
    return t[0][r & 0xff] ^ t[1][(r >> 8) & 0xff] ^ t[2][(r >> 16) & 0xff] ^ t[3][r >> 24];
}

/* t[k][v]: the register after `zeros` zero bytes, from the register v << 8k (linear, so basis images suffice). */
static void build_shift(uint32_t t[4][256], size_t zeros) {
    uint32_t basis[32];
    static const uint8_t z[64] = {0};
    for (int b = 0; b < 32; ++b) {
        uint32_t r = 1u << b;
        for (size_t left = zeros; left > 0;) {
            const size_t k = left < sizeof(z) ? left : sizeof(z);
            r = sw_update(r, z, k);
            left -= k;
        }
        basis[b] = r;
    }
    for (int k = 0; k < 4; ++k)
        for (int v = 0; v < 256; ++v) {
            uint32_t x = 0;
            for (int j = 0; j < 8; ++j)
                if (v >> j & 1) x ^= basis[8 * k + j];
            t[k][v] = x;
        }
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t r32, const uint8_t* p, size_t n) {
    uint64_t r = r32;
    while (n > 0 && ((uintptr_t)p & 7)) {
        r = _mm_crc32_u8((uint32_t)r, *p++);
        --n;
    }
    for (int pass = 0; pass < 2; ++pass) {
        const size_t blk = pass == 0 ? LONG_BLOCK : SHORT_BLOCK;
        const uint32_t(*t)[256] = pass == 0 ? g_long : g_short;
        while (n >= 3 * blk) {
            uint64_t r1 = 0, r2 = 0;
            const uint64_t* a = (const uint64_t*)p;
            const uint64_t* b = (const uint64_t*)(p + blk);
            const uint64_t* c = (const uint64_t*)(p + 2 * blk);
            for (size_t i = 0; i < blk / 8; ++i) {
                r = _mm_crc32_u64(r, a[i]);
                r1 = _mm_crc32_u64(r1, b[i]);
                r2 = _mm_crc32_u64(r2, c[i]);
            }
            r = shift(t, (uint32_t)r) ^ (uint32_t)r1;
            r = shift(t, (uint32_t)r) ^ (uint32_t)r2;
            p += 3 * blk;
            n -= 3 * blk;
        }
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        r = _mm_crc32_u64(r, w);
    }
    while (n--) r = _mm_crc32_u8((uint32_t)r, *p++);
    return (uint32_t)r;
}

/* Folding with carry-less multiplies (AVX-512 VPCLMULQDQ): 256 B per step in four 512-bit
 * accumulators. A 16-byte chunk A (bytes 0-7 = A_H, the higher-degree half) standing D bits
 * before the data it is folded into is replaced by A_H * (x^(D+64) mod P) + A_L * (x^D mod P),
 * which is congruent mod P and fits 128 bits; the folded 16 bytes then have the message's CRC
 * (the CRC depends only on the message mod P), taken with two crc32 instructions. Constants
 * are x^(N-1) mod P as bit-reflected 64-bit lanes (the reflected product comes out one degree
 * low); they are computed at first use, not copied from a table. */
static uint64_t g_k2048[2], g_k512[2], g_k384[2], g_k256[2], g_k128[2];

static uint32_t xpow_mod(uint64_t n) { /* x^n mod P, bit i = coefficient of x^i */
    uint32_t r = 1;
    for (uint64_t i = 0; i < n; ++i) r = (r << 1) ^ ((r >> 31) ? 0x1EDC6F41u : 0u);
    return r;
}

static void fold_constants(uint64_t k[2], uint64_t d) { /* k[0] for A_H (lo lane), k[1] for A_L */
    for (int half = 0; half < 2; ++half) {
        const uint32_t poly = xpow_mod(d + (half == 0 ? 64 : 0) - 1);
        uint64_t v = 0;
        for (int deg = 0; deg < 32; ++deg)
            if (poly >> deg & 1) v |= 1ULL << (63 - deg);
        k[half] = v;
    }
}

#include <cpuid.h>
#include <immintrin.h>

static int have_fold(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 1)) || !(c & (1u << 27))) return 0; /* PCLMUL, OSXSAVE */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16)) || !(c & (1u << 10))) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xE6u) == 0xE6u; /* the OS saves SSE, AVX, opmask and ZMM state */
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96);
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
static inline __m128i fold128(__m128i x, const uint64_t k[2]) {
    const __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11));
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
static inline void store256(uint8_t* d, __m512i a, __m512i b, __m512i c, __m512i e, int stream) {
    if (stream) { /* d is 64-byte aligned */
        _mm512_stream_si512((void*)d, a);
        _mm512_stream_si512((void*)(d + 64), b);
        _mm512_stream_si512((void*)(d + 128), c);
        _mm512_stream_si512((void*)(d + 192), e);
    } else {
        _mm512_storeu_si512(d, a);
        _mm512_storeu_si512(d + 64, b);
        _mm512_storeu_si512(d + 128, c);
        _mm512_storeu_si512(d + 192, e);
    }
}

/* The raw register after the whole 256-byte blocks of p[0, n), n >= 256 (the caller adds the
 * tail). With `dst`, each block is also stored there from the registers it is folded from: the
 * CRC is of exactly the bytes stored, and the data crosses memory once (`stream`: non-temporal
 * stores, dst 64-byte aligned; bsr_stream.h). */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
static uint32_t fold_blocks(uint32_t r, const uint8_t* p, size_t n, uint8_t* dst, int stream) {
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)g_k2048[1], (long long)g_k2048[0]));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)g_k512[1], (long long)g_k512[0]));
    __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
    for (size_t off = 0; off + 256 <= n; off += 256) {
        const __m512i y0 = _mm512_loadu_si512(p + off), y1 = _mm512_loadu_si512(p + off + 64);
        const __m512i y2 = _mm512_loadu_si512(p + off + 128), y3 = _mm512_loadu_si512(p + off + 192);
        if (dst) store256(dst + off, y0, y1, y2, y3, stream);
        if (off == 0) { /* update(r, M) == update(0, M with r xor-ed into its first 4 bytes) */
            x0 = _mm512_xor_si512(y0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)r)));
            x1 = y1, x2 = y2, x3 = y3;
        } else {
            x0 = fold512(x0, k2048, y0);
            x1 = fold512(x1, k2048, y1);
            x2 = fold512(x2, k2048, y2);
            x3 = fold512(x3, k2048, y3);
        }
    }
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    __m128i x = _mm_xor_si128(fold128(_mm512_extracti32x4_epi32(x3, 0), g_k384),
                              fold128(_mm512_extracti32x4_epi32(x3, 1), g_k256));
    x = _mm_xor_si128(x, fold128(_mm512_extracti32x4_epi32(x3, 2), g_k128));
    x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(x3, 3));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
}

/* The raw register after n >= 256 bytes (the tail by the 3-stream loop). */
static uint32_t fold_update(uint32_t r, const uint8_t* p, size_t n) {
    const size_t done = n & ~(size_t)255;
    return hw_update(fold_blocks(r, p, n, NULL, 0), p + done, n - done);
}

/* fold_update that also copies p[0, n) to dst; the tail (< 256 B) is checksummed where it landed. */
static uint32_t fold_copy_update(uint32_t r, uint8_t* dst, const uint8_t* p, size_t n, int stream) {
    const uint32_t c = fold_blocks(r, p, n, dst, stream);
    const size_t done = n & ~(size_t)255;
    memcpy(dst + done, p + done, n - done);
    return hw_update(c, dst + done, n - done);
}
#endif

static void build(void) {
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t r = i;
        for (int k = 0; k < 8; ++k) r = r & 1 ? (r >> 1) ^ POLY : r >> 1;
        g_table[i] = r;
    }
    build_shift(g_long, LONG_BLOCK);
    build_shift(g_short, SHORT_BLOCK);
#if defined(__x86_64__)
    __builtin_cpu_init();
    g_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    fold_constants(g_k2048, 2048);
    fold_constants(g_k512, 512);
    fold_constants(g_k384, 384);
    fold_constants(g_k256, 256);
    fold_constants(g_k128, 128);
    g_fold = g_hw && have_fold() && !getenv("BSR_CRC_NO_FOLD");
#else
    g_hw = 0;
#endif
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init(void) { pthread_once(&g_once, build); }

/* The raw register update (no pre/post inversion). */
static uint32_t update(uint32_t r, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
    if (g_fold && n >= FOLD_MIN) return fold_update(r, p, n);
    if (g_hw == 1) return hw_update(r, p, n);
#endif
    return sw_update(r, p, n);
}

typedef struct copy_job {
    bsr_items items; /* objects, taken in pieces by every run (bsr_pool_share) */
    const int64_t *src, *dst_head, *dst_body;
    int64_t head_bytes, body_bytes;
    uint32_t* crcs;
    int stream; /* the call moves >= bsr_stream_threshold(BSR_INTO_STAGING) bytes (bsr_stream.h) */
} copy_job;

static void copy_crc_piece(const copy_job* j, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const uint8_t* s = (const uint8_t*)(uintptr_t)j->src[i];
        if (j->head_bytes > 0) memcpy((void*)(uintptr_t)j->dst_head[i], s, (size_t)j->head_bytes);
        s += j->head_bytes;
        uint8_t* d = (uint8_t*)(uintptr_t)j->dst_body[i];
        uint32_t r = 0xFFFFFFFFu;
#if defined(__x86_64__)
        if (g_fold && j->body_bytes >= FOLD_MIN) { /* one pass: load, store, fold */
            j->crcs[i] = ~fold_copy_update(r, d, s, (size_t)j->body_bytes, j->stream && ((uintptr_t)d & 63) == 0);
            continue;
        }
#endif
        for (int64_t off = 0; off < j->body_bytes; off += PIECE) {
            const size_t k = (size_t)(j->body_bytes - off < PIECE ? j->body_bytes - off : PIECE);
            memcpy(d + off, s + off, k);
            r = update(r, d + off, k); /* what landed, while it is in cache */
        }
        j->crcs[i] = ~r;
    }
}

static void copy_crc_range(void* arg) {
    copy_job* j = (copy_job*)arg;
    int64_t begin, end;
    while (bsr_items_take(&j->items, &begin, &end)) copy_crc_piece(j, begin, end);
    if (j->stream) bsr_stream_fence();
}

static void crc_range(void* arg) {
    copy_job* j = (copy_job*)arg;
    int64_t begin, end;
    while (bsr_items_take(&j->items, &begin, &end))
        for (int64_t i = begin; i < end; ++i)
            j->crcs[i] = ~update(0xFFFFFFFFu, (const uint8_t*)(uintptr_t)j->src[i], (size_t)j->body_bytes);
}

static void run_split(void (*fn)(void*), copy_job proto, int64_t n, int64_t threads) {
    if (threads <= 0) threads = n * proto.body_bytes >= BSR_CRC_PARALLEL_BYTES ? 2 : 1;
    if (threads > BSR_CPU_MAX_THREADS) threads = BSR_CPU_MAX_THREADS;
    if (threads > n) threads = n;
    proto.items = (bsr_items){0, n, n / (threads * 8) > 1 ? n / (threads * 8) : 1};
    bsr_pool_share(&(bsr_task){fn, &proto}, threads);
}

/* ---- C ABI (prototypes and their description: bsr_abi.h) ----------------------------------------- */
BSR_CPU_API uint32_t bsr_crc32c(uint32_t crc, const void* p, int64_t n) {
    init();
    if (n <= 0) return crc;
    return ~update(~crc, (const uint8_t*)p, (size_t)n);
}

BSR_CPU_API int bsr_crc32c_hardware(void) {
    init();
    return g_hw ? 1 + g_fold : 0;
}

BSR_CPU_API int bsr_crc32c_many(int64_t n, const int64_t* ptrs, int64_t nbytes, uint32_t* crcs, int64_t threads) {
    init();
    if (n < 0 || nbytes < 0 || (n > 0 && (!ptrs || !crcs))) return -1;
    if (n == 0) return 0;
    copy_job proto = {{0, 0, 1}, ptrs, NULL, NULL, 0, nbytes, crcs, 0};
    run_split(crc_range, proto, n, threads);
    return 0;
}

BSR_CPU_API int bsr_copy_crc32c(int64_t n, const int64_t* src, const int64_t* dst_head, const int64_t* dst_body,
                                int64_t head_bytes, int64_t body_bytes, uint32_t* crcs, int64_t threads) {
    init();
    if (n < 0 || head_bytes < 0 || body_bytes < 0 || (n > 0 && (!src || !dst_body || !crcs)) ||
        (n > 0 && head_bytes > 0 && !dst_head))
        return -1;
    if (n == 0) return 0;
    copy_job proto = {{0, 0, 1}, src, dst_head, dst_body, head_bytes, body_bytes, crcs,
                      n * (head_bytes + body_bytes) >= bsr_stream_threshold(BSR_INTO_STAGING)};
    run_split(copy_crc_range, proto, n, threads);
    return 0;
}
