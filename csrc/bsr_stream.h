/*
 * bsr_stream.h: copies that bypass the caches, for calls of the CPU library that move more bytes
 * than the last-level cache holds (install/gather in bsr_install_cpu.c, the checksumming copy in
 * bsr_crc32c.c).
 *
 * A normal store first reads the destination's cache line (read-for-ownership): a copy larger than
 * the caches moves 3 bytes over the memory bus per byte copied. Non-temporal stores skip that read
 * (2 bytes per byte), and leave the cache to the data that is reused. Two kinds of destination:
 * - BSR_INTO_STAGING (the checksumming copy, gather): the install or the tier reads the staged
 *   window right after it is written, so it streams only from the last-level cache size up (sysfs;
 *   else 32 MiB), where the window would not stay in the cache anyway; $BSR_CPU_STREAM_BYTES;
 * - BSR_INTO_DESTINATIONS (the install): the KV blocks are not read back by the restore, so every
 *   window streams (threshold 0); $BSR_CPU_STREAM_DEST_BYTES.
 * benchmarks/stream_stores.py measures both kinds streamed and cached, side by side.
 *
 * bsr_stream_threshold(into): bytes per call from which copies into that kind stream; the
 * environment sets it at first use, bsr_stream_set_threshold at any time (0: always; huge: never).
 * bsr_copy_nt(dst, src, n): memcpy whose 64-byte aligned middle is written with non-temporal
 * stores (n < 128 B, or no AVX2: plain memcpy). A thread that streamed calls
 * bsr_stream_fence() before it reports its work done.
 */
#ifndef BSR_STREAM_H
#define BSR_STREAM_H

#include <stddef.h>
#include <stdint.h>

enum { BSR_INTO_STAGING = 0, BSR_INTO_DESTINATIONS = 1 };

int64_t bsr_stream_threshold(int into);
int64_t bsr_stream_set_threshold(int into, int64_t bytes); /* bytes < 0: only read; returns the previous value */
void bsr_copy_nt(void* dst, const void* src, size_t n);
void bsr_stream_fence(void);

#endif
