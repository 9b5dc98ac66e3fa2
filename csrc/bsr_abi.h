/*
 * bsr_abi.h: the C interface of the package's two native libraries, declared once.
 *
 * libbsr_cpu.so (the .c files of csrc/) defines the BSR_CPU_API functions, libbsr_cuda.so (bsr_install.cu)
 * the BSR_CUDA_API ones. Their sources include this header, so the compiler holds every definition
 * to its prototype here; bsr_kernels/native_abi.py reads the prototypes and the versions below when
 * it loads a library and declares each function's ctypes argument and result types from them.
 * Nothing else writes a signature.
 *
 * What the reader accepts: one prototype per declaration, `BSR_CPU_API` or `BSR_CUDA_API`, then the
 * result type, the name and named parameters; types void, int, int64_t, uint32_t, uint64_t, size_t,
 * const char* (a result only: a C string) and pointers (passed as addresses, or ctypes.byref for an
 * int* output).
 *
 * The versions are what each library reports (bsr_cpu_abi_version, bsr_abi_version); a library that
 * reports another is refused and rebuilt. A change to a prototype, or to the descriptor layout of
 * bsr_layout.h (both libraries read it), gives each library concerned a new version.
 */
#ifndef BSR_ABI_H
#define BSR_ABI_H

#include <stddef.h>
#include <stdint.h>

#define BSR_CPU_ABI_VERSION 6006
#define BSR_CUDA_ABI_VERSION 3

#ifdef __cplusplus
#define BSR_EXTERN_C extern "C"
#else
#define BSR_EXTERN_C
#endif
#define BSR_CPU_API BSR_EXTERN_C __attribute__((visibility("default")))
#define BSR_CUDA_API BSR_EXTERN_C __attribute__((visibility("default")))

/* ---- libbsr_cpu.so ---------------------------------------------------------------------------- */

BSR_CPU_API int bsr_cpu_abi_version(void);

/* The message of the calling thread's last failed call. */
BSR_CPU_API const char* bsr_cpu_last_error(void);

/* Window bytes from which threads = 0 (auto) uses a second thread. */
BSR_CPU_API int64_t bsr_cpu_parallel_bytes(void);

/* Keep the pool's workers off the caller's CPU (1), let the scheduler place them (0), or read the
 * setting (-1); returns the previous one (bsr_cpu_pool.h). */
BSR_CPU_API int bsr_cpu_pool_spread(int on);

/* Tests: while on (1) the pool's workers start no task, as if the scheduler never ran them; 0 lets them
 * again, -1 only reads it; returns the previous setting (bsr_cpu_pool.h). */
BSR_CPU_API int bsr_cpu_pool_hold(int on);

/* Calls moving at least `bytes` into staging (into = 0) or destinations (1) use non-temporal stores
 * (bsr_stream.h); bytes < 0 only reads it. Returns the previous value. */
BSR_CPU_API int64_t bsr_cpu_stream_bytes(int into, int64_t bytes);

/* One window, every tensor: staged chunk c at staging + c * chunk_stride (chunk_stride >= chunk_bytes)
 * into the destination blocks (install) or back (gather); `desc` is num_tensors descriptor rows
 * (bsr_layout.h), table_ptrs the addresses of the num_groups int64 block tables; threads 0 = auto.
 * Returns BSR_OK or an error code (bsr_cpu_last_error says why). */
BSR_CPU_API int bsr_cpu_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                        int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                        const int64_t* table_ptrs, int64_t num_groups, int64_t threads);
BSR_CPU_API int bsr_cpu_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                       int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                       const int64_t* table_ptrs, int64_t num_groups, int64_t threads);

/* CRC-32C of n bytes at p, continuing `crc` (0 to start), like google_crc32c's extend. */
BSR_CPU_API uint32_t bsr_crc32c(uint32_t crc, const void* p, int64_t n);

/* 0: the table; 1: the crc32 instruction; 2: also carry-less multiply folding (AVX-512 VPCLMULQDQ). */
BSR_CPU_API int bsr_crc32c_hardware(void);

/* crcs[i] = CRC-32C of nbytes at ptrs[i], for i < n. Returns 0, or -1 for invalid arguments. */
BSR_CPU_API int bsr_crc32c_many(int64_t n, const int64_t* ptrs, int64_t nbytes, uint32_t* crcs, int64_t threads);

/* For i < n: copy head_bytes from src[i] to dst_head[i] and the body_bytes after them to
 * dst_body[i]; crcs[i] = CRC-32C of the body as it landed. Returns 0, or -1 for invalid arguments. */
BSR_CPU_API int bsr_copy_crc32c(int64_t n, const int64_t* src, const int64_t* dst_head, const int64_t* dst_body,
                                int64_t head_bytes, int64_t body_bytes, uint32_t* crcs, int64_t threads);

/* The filesystem tier's objects (bsr_fs_read.c): each relpaths[i] (the address of a NUL-terminated
 * "ab/cd/<hash>.bsr") opened under root_fd by one openat2 refusing any symlink or escape, with `flags`;
 * the probe checks that it is a regular file of exactly object_size bytes, status[i] = 0, an errno
 * (ENOENT: absent; ELOOP, ENOTDIR, EXDEV: a symlink or escape) or a BSR_FS_* code below. Returns 0,
 * or -1 for invalid arguments. */
#define BSR_FS_NOT_REGULAR 1001
#define BSR_FS_WRONG_SIZE 1002
#define BSR_FS_SHORT 1003
#define BSR_FS_SKIPPED 1004   /* not read: an earlier object of its job failed */
#define BSR_FS_LATE 1005      /* not read: its job's deadline passed before it started */
#define BSR_FS_CANCELLED 1006 /* not read: the reader was closed before it started */
BSR_CPU_API int bsr_fs_probe_objects(int root_fd, int64_t n, const int64_t* relpaths, int64_t flags,
                                     int64_t object_size, int64_t* status);

/* A reader of such objects on `threads` threads of its own (NULL: none made). submit queues a job of
 * n objects, each read whole if it passes the probe's checks: its first head_bytes to
 * heads + i * head_bytes, the rest to bodies[i], crcs[i] = CRC-32C of the rest, status[i] as the
 * probe's (or BSR_FS_SHORT); the arrays are the caller's and must stay alive until the job ended. It
 * returns the job's id (-1 invalid arguments, -2 closed). wait: 1 once every object of the job ended
 * (read or not), 0 after timeout_ns without, -1 no such job (or forgotten). forget: 0 the ended job's
 * record freed (by its last waiter, if any wait on it), 1 still being read (kept), -1 unknown. hold (tests): while on (1; 0 off, -1 unchanged), a thread
 * that took an object waits before reading it, as a read stuck in the kernel; returns how many wait. close: cancels what was not started; 1 once every
 * thread ended within timeout_ns, else 0 (threads left running). free: 0 freed, 1 not closed or a
 * thread still running (never freed under it). deadline_ns and the timeouts: CLOCK_MONOTONIC ns. */
BSR_CPU_API void* bsr_fs_reader_open(int root_fd, int64_t threads);
BSR_CPU_API int64_t bsr_fs_reader_submit(void* reader, int64_t n, const int64_t* relpaths, int64_t flags,
                                         int64_t object_size, int64_t head_bytes, void* heads, const int64_t* bodies,
                                         uint32_t* crcs, int64_t* status, int64_t deadline_ns);
BSR_CPU_API int bsr_fs_reader_wait(void* reader, int64_t job, int64_t timeout_ns);
BSR_CPU_API int bsr_fs_reader_forget(void* reader, int64_t job);
BSR_CPU_API int bsr_fs_reader_hold(void* reader, int on);
BSR_CPU_API int bsr_fs_reader_close(void* reader, int64_t timeout_ns);
BSR_CPU_API int bsr_fs_reader_free(void* reader);

/* ---- libbsr_cuda.so --------------------------------------------------------------------------- */

BSR_CUDA_API int bsr_abi_version(void);

/* The message of the calling thread's last failed call. */
BSR_CUDA_API const char* bsr_last_error(void);

/* *n = the number of CUDA devices; BSR_ERR_NO_DEVICE without a device or driver. */
BSR_CUDA_API int bsr_device_count(int* n);

/* One launch on `stream` for a window, as bsr_cpu_install_strided; desc and table_ptrs in device
 * memory, staging in device memory or pinned host memory (read over UVA). */
BSR_CUDA_API int bsr_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                     int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                     const int64_t* table_ptrs, int64_t num_groups, void* stream);
BSR_CUDA_API int bsr_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                    int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                    const int64_t* table_ptrs, int64_t num_groups, void* stream);

/* The kernels' piece/batch/unit code run on host memory (CTAs one after another): the index
 * arithmetic tested without a GPU; split 0 = the launch heuristic. */
BSR_CUDA_API int bsr_host_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                          int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                          const int64_t* table_ptrs, int64_t num_groups, int64_t split);
BSR_CUDA_API int bsr_host_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                         int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                         const int64_t* table_ptrs, int64_t num_groups, int64_t split);

/* *width = the access width (bytes) the kernels use for one tensor (bsr_access_width). */
BSR_CUDA_API int bsr_host_access_width(int64_t entry_bytes, int64_t seg_offset, int64_t chunk_stride,
                                       int64_t block_stride, uint64_t staging_addr, uint64_t dst_addr, int* width);

/* *width = the access width for one contiguous run (bsr_run_width). */
BSR_CUDA_API int bsr_host_run_width(uint64_t src_addr, uint64_t dst_addr, int64_t nbytes, int* width);

/* Copy-engine baselines of benchmarks/gpu_check.py: `count` runs of sizes[i] bytes from srcs[i] to
 * dsts[i] on `stream`, as one cudaMemcpyBatchAsync (CUDA >= 12.8) or one cudaMemcpyAsync per run. */
BSR_CUDA_API int bsr_copy_batch(void** dsts, void** srcs, size_t* sizes, size_t count, void* stream);
BSR_CUDA_API int bsr_copy_loop(void** dsts, void** srcs, size_t* sizes, size_t count, void* stream);

#endif /* BSR_ABI_H */
