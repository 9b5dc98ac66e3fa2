/*
 * bsr_stream.h: copies that bypass the caches, for calls of the CPU library that move more bytes
 * than the last-level cache holds (install/gather in bsr_install_cpu.c, the checksumming copy in
 * bsr_crc32c.c).
 *
 * A normal store first reads the destination's cache line (read-for-ownership): a copy larger than
 * the caches moves 3 bytes over the memory bus per byte copied. Non-temporal stores skip that read
 * (2 bytes per byte), and leave the cache to the data that is reused; what a window writes is not
 * read again before it is evicted anyway once the window is larger than the cache. Smaller windows
 * keep normal stores: the install reads a staged window right after the fetch wrote it.
 *
 * bsr_stream_threshold(): bytes per call from which copies stream; by default the last-level cache
 * size (sysfs), else 32 MiB; $BSR_CPU_STREAM_BYTES overrides it at first use and
 * bsr_stream_set_threshold at any time (0: always stream; a huge value: never).
 * bsr_copy_nt(dst, src, n): memcpy whose 64-byte aligned middle is written with non-temporal
 * stores (n < 1 KiB, or not x86-64: plain memcpy). A thread that streamed calls
 * bsr_stream_fence() before it reports its work done.
 */
#ifndef BSR_STREAM_H
#define BSR_STREAM_H

#include <stddef.h>
#include <stdint.h>

int64_t bsr_stream_threshold(void);
int64_t bsr_stream_set_threshold(int64_t bytes); /* < 0: only read; returns the previous value */
void bsr_copy_nt(void* dst, const void* src, size_t n);
void bsr_stream_fence(void);

#endif
