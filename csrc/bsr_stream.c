/* bsr_stream.c: non-temporal copies and their size threshold (see bsr_stream.h). */
#include "bsr_stream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define DEFAULT_THRESHOLD (32LL << 20)
/* below it the alignment head and tail are most of the copy; from two cache lines up streaming pays even
 * for the install's small spans scattered over the KV cache (dsv4-flash at 1/64 moves 16-512 B spans:
 * benchmarks/bench_install.py, cold, two threads, 0.41-0.48 of a contiguous copy with 1 KiB, 0.76-0.85 with 128 B) */
#define NT_MIN 128

static int64_t g_threshold[2] = {-1, -1}; /* per BSR_INTO_*; -1: not read yet */

/* The largest cache level's size as Linux reports it for cpu0 (sysfs; in a VM what the guest is
 * given: glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) reported the host's 384 MiB on a 32 MiB guest). */
static int64_t last_level_cache(void) {
    int64_t best = 0;
    for (int i = 0; i < 8; ++i) {
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE* f = fopen(path, "r");
        if (!f) continue;
        long long v = 0;
        char unit = 0;
        if (fscanf(f, "%lld%c", &v, &unit) >= 1) {
            const int64_t b = unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : v;
            if (b > best) best = b;
        }
        fclose(f);
    }
    return best;
}

static int64_t initial_threshold(int into) {
    const char* v = getenv(into == BSR_INTO_DESTINATIONS ? "BSR_CPU_STREAM_DEST_BYTES" : "BSR_CPU_STREAM_BYTES");
    if (v && *v) {
        char* end;
        const long long b = strtoll(v, &end, 10);
        if (*end == 0 && b >= 0) return b;
    }
    if (into == BSR_INTO_DESTINATIONS) return 0;
    const int64_t llc = last_level_cache();
    return llc > 0 ? llc : DEFAULT_THRESHOLD;
}

int64_t bsr_stream_threshold(int into) {
    int64_t* slot = &g_threshold[into == BSR_INTO_DESTINATIONS];
    int64_t t = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (t < 0) {
        int64_t unset = -1;
        t = initial_threshold(into);
        if (!__atomic_compare_exchange_n(slot, &unset, t, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) t = unset;
    }
    return t;
}

int64_t bsr_stream_set_threshold(int into, int64_t bytes) {
    const int64_t was = bsr_stream_threshold(into);
    if (bytes >= 0) __atomic_store_n(&g_threshold[into == BSR_INTO_DESTINATIONS], bytes, __ATOMIC_RELAXED);
    return was;
}

#if defined(__x86_64__)
/* 32-byte streaming stores, two per cache line: on one core of an AVX-512 Xeon VM a scatter of 512 B
 * spans alone (the install's at DeepSeek-V4 scale 1/64) ran clearly faster than with four 16-byte
 * stores a line (looked at, not a benchmark here: the installer's own figures are bench_install.py's).
 * The same code runs on AVX2-only machines; x86-64 CPUs without AVX2 (from before 2013) use memcpy. */
__attribute__((target("avx2"))) static void copy_nt_avx2(uint8_t* d, const uint8_t* s, size_t n) {
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        const __m256i a = _mm256_loadu_si256((const __m256i*)s), b = _mm256_loadu_si256((const __m256i*)(s + 32));
        _mm256_stream_si256((__m256i*)d, a);
        _mm256_stream_si256((__m256i*)(d + 32), b);
    }
    memcpy(d, s, n);
}

static int g_avx2 = -1; /* -1: not asked yet (every thread that asks gets the same answer) */
#endif

void bsr_copy_nt(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
    int avx2 = __atomic_load_n(&g_avx2, __ATOMIC_RELAXED);
    if (__builtin_expect(avx2 < 0, 0)) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
        __atomic_store_n(&g_avx2, avx2, __ATOMIC_RELAXED);
    }
    if (avx2 && n >= NT_MIN) {
        uint8_t* d = (uint8_t*)dst;
        const uint8_t* s = (const uint8_t*)src;
        const size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        copy_nt_avx2(d + head, s + head, n - head);
        return;
    }
#endif
    memcpy(dst, src, n);
}

void bsr_stream_fence(void) {
#if defined(__x86_64__)
    _mm_sfence(); /* non-temporal stores are weakly ordered: visible before the caller signals */
#endif
}
