/*
 * bsr_install.cu: install (staging -> destination blocks) and gather (the inverse) for every
 * registered tensor of a window in ONE kernel launch, behind a C ABI loaded with ctypes.
 *
 * Grid: x = num_tensors * split (tensor t, piece s of its segment), y = window chunks (strided
 * when more than 65535). A CTA resolves the destinations of up to BSR_ENTRY_BATCH entries of
 * its piece into shared memory. Packed tensors (contiguous entries, consecutive slots back to
 * back) then copy each block span of the batch as one run, cut into pieces dealt to warps, with
 * the widest access the run's own addresses and length allow (bsr_run_width). Other layouts
 * copy the batch as a flat run of vector units of the widest access every entry allows
 * (bsr_desc_access_width): staging addresses are linear in the
 * unit index, destination addresses come from the resolved entry offsets. No division in the
 * copy loop: each thread tracks (entry, unit-in-entry) incrementally.
 *
 * Chunk c of the staged window starts chunk_stride bytes after chunk c - 1 (chunk_stride >=
 * chunk_bytes: chunk-strided staging leaves caller-owned gaps between chunks, never read or
 * written here; chunk_stride = chunk_bytes when the chunks are back to back).
 *
 * The staging pointer may be device memory or pinned host memory (zero-copy over UVA).
 * Gather writes zeros for entries of -1 blocks and for the padding between segments, like
 * bsr_kernels.install_torch.gather_torch.
 *
 * The bsr_host_* functions run the same piece/batch/unit code on CPU memory (threads emulated
 * one after another), so the index arithmetic is tested on machines without a GPU.
 */
#include <cuda_runtime.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "bsr_abi.h"
#include "bsr_layout.h"

namespace {

thread_local char g_last_error[1024] = "";

int set_error(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
    va_end(ap);
    return code;
}

int cuda_error(const char* what, cudaError_t e) {
    return set_error(BSR_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

// ---- vector accesses ------------------------------------------------------------------
template <typename V>
__host__ __device__ __forceinline__ V vload(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<const V*>(p);
#else
    V v;
    memcpy(&v, p, sizeof(V));
    return v;
#endif
}

template <typename V>
__host__ __device__ __forceinline__ void vstore(uint8_t* p, const V& v) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<V*>(p) = v;
#else
    memcpy(p, &v, sizeof(V));
#endif
}

template <typename V>
__host__ __device__ __forceinline__ V vzero() {
    V v;
    memset(&v, 0, sizeof(V));
    return v;
}

// ---- one piece of one (chunk, tensor) segment ---------------------------------------------
struct Piece {
    uint8_t* staging;  // window base, device-accessible (or host memory in the emulation)
    int64_t chunk_stride;  // bytes from one staged chunk to the next
    int64_t first_chunk;
    bsr_desc d;
    const int64_t* table;  // the tensor's group block table
    int64_t c;             // window chunk
    int64_t b0;            // first entry of the batch (within the chunk's segment)
    int64_t nb;            // entries in the batch (<= BSR_ENTRY_BATCH)
};

// Phase 1: destination byte offset of each batch entry (-1 = skip). Returns 1 when a block id
// is outside [-1, num_blocks) (such entries are skipped, never written).
__host__ __device__ __forceinline__ int resolve(const Piece& p, int64_t* off, int tid, int nthreads) {
    int bad = 0;
    for (int64_t j = tid; j < p.nb; j += nthreads) {
        bsr_loc l = bsr_locate(p.c, p.first_chunk, p.b0 + j, p.chunk_stride, &p.d, p.table);
        if (l.block < -1 || l.block >= p.d.num_blocks) {
            bad = 1;
            off[j] = -1;
        } else {
            off[j] = l.block >= 0 ? l.dst_off : -1;
        }
    }
    return bad;
}

// Phase 2: copy the batch as nb * (entry_bytes / sizeof(V)) vector units. The batch holds at
// most 2^30 bytes (bsr_batch_entries), so unit indices fit 32 bits.
template <typename V, bool GATHER>
__host__ __device__ __forceinline__ void copy_units(const Piece& p, const int64_t* off, int tid, int nthreads) {
    const uint32_t w = (uint32_t)sizeof(V);
    const uint32_t upe = (uint32_t)(p.d.entry_bytes / w);  // units per entry
    const uint32_t total = (uint32_t)p.nb * upe;
    uint8_t* stage = p.staging + p.c * p.chunk_stride + p.d.seg_offset + p.b0 * p.d.entry_bytes;
    uint8_t* dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(p.d.dst_base));
    const uint32_t nt = (uint32_t)nthreads;
    const uint32_t step_j = nt / upe, step_o = nt % upe;
    uint32_t j = (uint32_t)tid / upe, o = (uint32_t)tid % upe;  // unit u = tid lies in entry j at unit o
    for (uint32_t u = (uint32_t)tid; u < total; u += BSR_UNROLL * nt) {
        V v[BSR_UNROLL];
        uint8_t* where[BSR_UNROLL];
#pragma unroll
        for (int k = 0; k < BSR_UNROLL; ++k) {
            const uint32_t uk = u + (uint32_t)k * nt;
            where[k] = nullptr;
            if (uk < total) {
                const int64_t base = off[j];
                if (base >= 0) where[k] = dst + base + bsr_entry_offset(&p.d, (int64_t)o * w);
                if (GATHER) {
                    v[k] = base >= 0 ? vload<V>(where[k]) : vzero<V>();
                } else if (base >= 0) {
                    v[k] = vload<V>(stage + (uint64_t)uk * w);
                }
            }
            j += step_j;
            o += step_o;
            if (o >= upe) {
                o -= upe;
                ++j;
            }
        }
#pragma unroll
        for (int k = 0; k < BSR_UNROLL; ++k) {
            const uint32_t uk = u + (uint32_t)k * nt;
            if (uk < total) {
                if (GATHER) {
                    vstore<V>(stage + (uint64_t)uk * w, v[k]);
                } else if (where[k]) {
                    vstore<V>(where[k], v[k]);
                }
            }
        }
    }
}

template <bool GATHER>
__host__ __device__ __forceinline__ void copy_batch(int width, const Piece& p, const int64_t* off, int tid,
                                                    int nthreads) {
    switch (width) {
        case 16: copy_units<uint4, GATHER>(p, off, tid, nthreads); break;
        case 8: copy_units<uint2, GATHER>(p, off, tid, nthreads); break;
        case 4: copy_units<uint32_t, GATHER>(p, off, tid, nthreads); break;
        case 2: copy_units<uint16_t, GATHER>(p, off, tid, nthreads); break;
        default: copy_units<uint8_t, GATHER>(p, off, tid, nthreads); break;
    }
}

// ---- packed tensors: runs of whole block spans, a warp per piece of a run --------------------
// Entries of one block in a batch are one contiguous run on both sides (bsr_desc_packed). Each
// run is cut into BSR_RUN_PIECE-byte pieces, dealt round-robin to the CTA's warps; a run's access
// width comes from its own addresses and length (bsr_run_width), not from the entry width.
template <typename V, bool GATHER>
__host__ __device__ __forceinline__ void copy_piece(uint8_t* stage, uint8_t* dst, int64_t nbytes, int lane) {
    const int64_t w = (int64_t)sizeof(V), step = (int64_t)BSR_WARP * w;
    for (int64_t x = lane * w; x < nbytes; x += BSR_UNROLL * step) {
        V v[BSR_UNROLL];
#pragma unroll
        for (int k = 0; k < BSR_UNROLL; ++k) {
            const int64_t xk = x + k * step;
            if (xk < nbytes) {
                if (!dst)
                    v[k] = vzero<V>();  // gather of a -1 block
                else
                    v[k] = vload<V>(GATHER ? dst + xk : stage + xk);
            }
        }
#pragma unroll
        for (int k = 0; k < BSR_UNROLL; ++k) {
            const int64_t xk = x + k * step;
            if (xk < nbytes) vstore<V>(GATHER ? stage + xk : dst + xk, v[k]);
        }
    }
}

template <bool GATHER>
__host__ __device__ __forceinline__ void copy_runs(const Piece& p, const int64_t* off, int warp, int lane,
                                                   int nwarps) {
    const int64_t bs = p.d.block_size, eb = p.d.entry_bytes;
    const int64_t e0 = (p.first_chunk + p.c) * p.d.entries_per_chunk + p.b0;  // first entry of the batch
    const int64_t head = bs - e0 % bs;  // entries of the batch in its first block
    uint8_t* stage = p.staging + p.c * p.chunk_stride + p.d.seg_offset + p.b0 * eb;
    uint8_t* base = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(p.d.dst_base));
    int64_t dealt = 0;  // pieces of earlier runs, for the round-robin over warps
    for (int64_t j0 = 0; j0 < p.nb;) {
        const int64_t j1 = j0 == 0 ? (head < p.nb ? head : p.nb) : (j0 + bs < p.nb ? j0 + bs : p.nb);
        const int64_t nbytes = (j1 - j0) * eb, pieces = (nbytes + BSR_RUN_PIECE - 1) / BSR_RUN_PIECE;
        uint8_t* s = stage + j0 * eb;
        uint8_t* d = off[j0] >= 0 ? base + off[j0] : nullptr;
        if (d || GATHER) {
            const int w = d ? bsr_run_width((uint64_t)(uintptr_t)s, (uint64_t)(uintptr_t)d, nbytes)
                            : bsr_run_width((uint64_t)(uintptr_t)s, 0, nbytes);
            for (int64_t q = ((warp - dealt) % nwarps + nwarps) % nwarps; q < pieces; q += nwarps) {
                const int64_t at = q * BSR_RUN_PIECE;
                const int64_t n = nbytes - at < BSR_RUN_PIECE ? nbytes - at : BSR_RUN_PIECE;
                uint8_t* dq = d ? d + at : nullptr;
                switch (w) {
                    case 16: copy_piece<uint4, GATHER>(s + at, dq, n, lane); break;
                    case 8: copy_piece<uint2, GATHER>(s + at, dq, n, lane); break;
                    case 4: copy_piece<uint32_t, GATHER>(s + at, dq, n, lane); break;
                    case 2: copy_piece<uint16_t, GATHER>(s + at, dq, n, lane); break;
                    default: copy_piece<uint8_t, GATHER>(s + at, dq, n, lane); break;
                }
            }
        }
        dealt += pieces;
        j0 = j1;
    }
}

// Gather: zero the padding after tensor t's segment (and before segment 0) in chunk c, inside
// its chunk_bytes (the gap up to the next chunk is not the window's).
__host__ __device__ __forceinline__ void zero_padding(uint8_t* staging, int64_t c, int64_t chunk_bytes,
                                                      int64_t chunk_stride, const int64_t* desc, int64_t t,
                                                      int64_t num_tensors, int tid, int nthreads) {
    const bsr_desc d = bsr_desc_row(desc, t);
    uint8_t* chunk = staging + c * chunk_stride;
    const int64_t end = bsr_next_segment(desc, t, num_tensors, chunk_bytes);
    for (int64_t x = d.seg_offset + d.entries_per_chunk * d.entry_bytes + tid; x < end; x += nthreads) chunk[x] = 0;
    if (t == 0)
        for (int64_t x = tid; x < d.seg_offset; x += nthreads) chunk[x] = 0;
}

// ---- the kernel: one launch for every tensor of the window ---------------------------------
template <bool GATHER>
__global__ void __launch_bounds__(BSR_THREADS)
    bsr_window_kernel(uint8_t* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                      int64_t num_chunks,
                      const int64_t* __restrict__ desc, int64_t num_tensors, const int64_t* __restrict__ table_ptrs,
                      int64_t num_groups, int64_t split) {
    __shared__ int64_t off[BSR_ENTRY_BATCH];
    const int64_t t = blockIdx.x / split, s = blockIdx.x % split;
    if (t >= num_tensors) return;
    Piece p;
    p.staging = staging;
    p.chunk_stride = chunk_stride;
    p.first_chunk = first_chunk;
    p.d = bsr_desc_row(desc, t);
    if (p.d.group < 0 || p.d.group >= num_groups || p.d.entry_bytes <= 0 || p.d.entry_bytes > BSR_MAX_ENTRY_BYTES ||
        p.d.block_size <= 0 || !bsr_desc_valid(&p.d))
        return;  // rejected by the Python wrapper before launch
    p.table = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(table_ptrs[p.d.group]));
    int64_t i0, i1;
    bsr_piece_range(p.d.entries_per_chunk, split, s, &i0, &i1);
    const int width = bsr_desc_access_width(&p.d, chunk_stride, (uint64_t)(uintptr_t)staging);
    const int packed = bsr_desc_packed(&p.d);
    const int64_t batch = bsr_batch_entries(p.d.entry_bytes);
    for (int64_t c = blockIdx.y; c < num_chunks; c += gridDim.y) {
        p.c = c;
        if (GATHER && s == 0)
            zero_padding(staging, c, chunk_bytes, chunk_stride, desc, t, num_tensors, threadIdx.x, blockDim.x);
        for (int64_t b0 = i0; b0 < i1; b0 += batch) {
            p.b0 = b0;
            p.nb = i1 - b0 < batch ? i1 - b0 : batch;
            const int bad = resolve(p, off, threadIdx.x, blockDim.x);
#if defined(BSR_DEBUG)
            if (bad) __trap();
#else
            (void)bad;
#endif
            __syncthreads();
            if (packed)
                copy_runs<GATHER>(p, off, threadIdx.x / BSR_WARP, threadIdx.x % BSR_WARP, blockDim.x / BSR_WARP);
            else
                copy_batch<GATHER>(width, p, off, threadIdx.x, blockDim.x);
            __syncthreads();
        }
    }
}

// The window arguments both entry points check before anything else.
static int check_window(int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk, int64_t num_chunks,
                        int64_t num_tensors, int64_t num_groups) {
    if (num_chunks < 0 || first_chunk < 0 || num_tensors < 0 || num_groups < 0 || chunk_bytes <= 0 ||
        chunk_stride < chunk_bytes)
        return set_error(BSR_ERR_INVALID, "invalid window: chunk_bytes=%lld chunk_stride=%lld first_chunk=%lld "
                         "num_chunks=%lld num_tensors=%lld num_groups=%lld", (long long)chunk_bytes,
                         (long long)chunk_stride, (long long)first_chunk, (long long)num_chunks,
                         (long long)num_tensors, (long long)num_groups);
    return BSR_OK;
}

// ---- host emulation: the same pieces, batches and units, threads run one after another ----
template <bool GATHER>
int host_window(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk, int64_t num_chunks,
                const int64_t* desc, int64_t num_tensors, const int64_t* table_ptrs, int64_t num_groups,
                int64_t split) {
    const int bad = check_window(chunk_bytes, chunk_stride, first_chunk, num_chunks, num_tensors, num_groups);
    if (bad != BSR_OK) return bad;
    if (num_chunks == 0 || num_tensors == 0) return BSR_OK;
    if (!staging || !desc || !table_ptrs) return set_error(BSR_ERR_INVALID, "null staging, descriptor or table pointer");
    int64_t max_entries = 1;
    for (int64_t t = 0; t < num_tensors; ++t) {
        const bsr_desc d = bsr_desc_row(desc, t);
        if (d.group < 0 || d.group >= num_groups)
            return set_error(BSR_ERR_INVALID, "tensor %lld: group %lld outside [0, %lld)", (long long)t,
                             (long long)d.group, (long long)num_groups);
        if (d.entry_bytes <= 0 || d.entry_bytes > BSR_MAX_ENTRY_BYTES || d.block_size <= 0 || d.entries_per_chunk < 0 || d.dst_base == 0 ||
            !bsr_desc_valid(&d))
            return set_error(BSR_ERR_INVALID, "tensor %lld: invalid descriptor row", (long long)t);
        if (d.seg_offset + d.entries_per_chunk * d.entry_bytes > chunk_bytes)
            return set_error(BSR_ERR_INVALID, "tensor %lld: segment ends past chunk_bytes %lld", (long long)t,
                             (long long)chunk_bytes);
        if (d.entries_per_chunk > max_entries) max_entries = d.entries_per_chunk;
    }
    if (split <= 0) split = bsr_choose_split(num_tensors, num_chunks, max_entries, 132);
    int64_t off[BSR_ENTRY_BATCH];
    uint8_t* stage = static_cast<uint8_t*>(staging);
    const int nthreads = BSR_THREADS;
    for (int64_t c = 0; c < num_chunks; ++c) {
        for (int64_t t = 0; t < num_tensors; ++t) {
            Piece p;
            p.staging = stage;
            p.chunk_stride = chunk_stride;
            p.first_chunk = first_chunk;
            p.d = bsr_desc_row(desc, t);
            p.table = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(table_ptrs[p.d.group]));
            p.c = c;
            const int width = bsr_desc_access_width(&p.d, chunk_stride, (uint64_t)(uintptr_t)stage);
            const int packed = bsr_desc_packed(&p.d);
            for (int64_t s = 0; s < split; ++s) {
                if (GATHER && s == 0)
                    for (int tid = 0; tid < nthreads; ++tid)
                        zero_padding(stage, c, chunk_bytes, chunk_stride, desc, t, num_tensors, tid, nthreads);
                int64_t i0, i1;
                bsr_piece_range(p.d.entries_per_chunk, split, s, &i0, &i1);
                const int64_t batch = bsr_batch_entries(p.d.entry_bytes);
                for (int64_t b0 = i0; b0 < i1; b0 += batch) {
                    p.b0 = b0;
                    p.nb = i1 - b0 < batch ? i1 - b0 : batch;
                    int bad = 0;
                    for (int tid = 0; tid < nthreads; ++tid) bad |= resolve(p, off, tid, nthreads);
                    if (bad)
                        return set_error(BSR_ERR_INVALID, "tensor %lld chunk %lld: block id outside [-1, %lld)",
                                         (long long)t, (long long)(first_chunk + c), (long long)p.d.num_blocks);
                    for (int tid = 0; tid < nthreads; ++tid) {
                        if (packed)
                            copy_runs<GATHER>(p, off, tid / BSR_WARP, tid % BSR_WARP, nthreads / BSR_WARP);
                        else
                            copy_batch<GATHER>(width, p, off, tid, nthreads);
                    }
                }
            }
        }
    }
    return BSR_OK;
}

// ---- device launch -----------------------------------------------------------------------
int sm_count_of_current_device(int* sms) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return cuda_error("cudaGetDevice", e);
    static int cache[256];  // 0 = not queried yet
    if (dev >= 0 && dev < 256 && cache[dev] > 0) {
        *sms = cache[dev];
        return BSR_OK;
    }
    int n = 0;
    e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute(MultiProcessorCount)", e);
    if (dev >= 0 && dev < 256) cache[dev] = n;
    *sms = n;
    return BSR_OK;
}

template <bool GATHER>
int device_window(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk, int64_t num_chunks,
                  const int64_t* desc, int64_t num_tensors, const int64_t* table_ptrs, int64_t num_groups,
                  void* stream) {
    const int bad = check_window(chunk_bytes, chunk_stride, first_chunk, num_chunks, num_tensors, num_groups);
    if (bad != BSR_OK) return bad;
    if (num_chunks == 0 || num_tensors == 0) return BSR_OK;
    if (!staging || !desc || !table_ptrs) return set_error(BSR_ERR_INVALID, "null staging, descriptor or table pointer");

    // Pinned host staging is read in place (zero-copy); pageable host memory cannot be.
    cudaPointerAttributes attr;
    cudaError_t e = cudaPointerGetAttributes(&attr, staging);
    if (e != cudaSuccess) return cuda_error("cudaPointerGetAttributes(staging)", e);
    void* stage_dev = staging;
    if (attr.type == cudaMemoryTypeUnregistered)
        return set_error(BSR_ERR_INVALID, "staging %p is pageable host memory: pin it for zero-copy or copy it "
                         "to the device first", staging);
    if (attr.type == cudaMemoryTypeHost && attr.devicePointer) stage_dev = attr.devicePointer;

    int sms = 0;
    int rc = sm_count_of_current_device(&sms);
    if (rc != BSR_OK) return rc;
    // Descriptors live on the device, so the longest segment is unknown here: pieces past a
    // short segment's end exit at once.
    const int64_t split = bsr_choose_split(num_tensors, num_chunks, BSR_MAX_SPLIT, sms);
    if (num_tensors * split > 0x7fffffffLL)
        return set_error(BSR_ERR_INVALID, "too many tensors for one launch: %lld", (long long)num_tensors);
    dim3 grid((unsigned)(num_tensors * split), (unsigned)(num_chunks < 65535 ? num_chunks : 65535), 1);
    cudaGetLastError();  // clear a stale error of an earlier, unrelated call
    bsr_window_kernel<GATHER><<<grid, BSR_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint8_t*>(stage_dev), chunk_bytes, chunk_stride, first_chunk, num_chunks, desc, num_tensors,
        table_ptrs,
        num_groups, split);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error(GATHER ? "bsr_gather launch" : "bsr_install launch", e);
    return BSR_OK;
}

}  // namespace

// ---- C ABI (prototypes and their description: bsr_abi.h) --------------------------------------
BSR_CUDA_API const char* bsr_last_error(void) { return g_last_error; }

BSR_CUDA_API int bsr_abi_version(void) { return BSR_CUDA_ABI_VERSION; }

BSR_CUDA_API int bsr_device_count(int* n) {
    if (!n) return set_error(BSR_ERR_INVALID, "bsr_device_count: null output pointer");
    *n = 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return set_error(BSR_ERR_NO_DEVICE, "no CUDA device: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (count <= 0) return set_error(BSR_ERR_NO_DEVICE, "no CUDA device: the driver reports 0 devices");
    *n = count;
    return BSR_OK;
}

BSR_CUDA_API int bsr_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                int64_t num_chunks, const int64_t* desc_dev, int64_t num_tensors,
                                const int64_t* table_ptrs_dev, int64_t num_groups, void* stream) {
    return device_window<false>(staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc_dev, num_tensors,
                                table_ptrs_dev, num_groups, stream);
}

BSR_CUDA_API int bsr_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                               int64_t num_chunks, const int64_t* desc_dev, int64_t num_tensors,
                               const int64_t* table_ptrs_dev, int64_t num_groups, void* stream) {
    return device_window<true>(staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc_dev, num_tensors,
                               table_ptrs_dev, num_groups, stream);
}

BSR_CUDA_API int bsr_host_install_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                     int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                     const int64_t* table_ptrs, int64_t num_groups, int64_t split) {
    return host_window<false>(staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc, num_tensors,
                              table_ptrs, num_groups, split);
}

BSR_CUDA_API int bsr_host_gather_strided(void* staging, int64_t chunk_bytes, int64_t chunk_stride, int64_t first_chunk,
                                    int64_t num_chunks, const int64_t* desc, int64_t num_tensors,
                                    const int64_t* table_ptrs, int64_t num_groups, int64_t split) {
    return host_window<true>(staging, chunk_bytes, chunk_stride, first_chunk, num_chunks, desc, num_tensors,
                             table_ptrs, num_groups, split);
}

BSR_CUDA_API int bsr_host_access_width(int64_t entry_bytes, int64_t seg_offset, int64_t chunk_stride, int64_t block_stride,
                                  uint64_t staging_addr, uint64_t dst_addr, int* width) {
    if (!width) return set_error(BSR_ERR_INVALID, "bsr_host_access_width: null output pointer");
    *width = bsr_access_width(entry_bytes, seg_offset, chunk_stride, block_stride, staging_addr, dst_addr);
    return BSR_OK;
}

BSR_CUDA_API int bsr_host_run_width(uint64_t src_addr, uint64_t dst_addr, int64_t nbytes, int* width) {
    if (!width) return set_error(BSR_ERR_INVALID, "bsr_host_run_width: null output pointer");
    *width = bsr_run_width(src_addr, dst_addr, nbytes);
    return BSR_OK;
}

// ---- DMA baselines for benchmarks/gpu_check.py: the runs the kernel moves, by the copy engines --
BSR_CUDA_API int bsr_copy_batch(void** dsts, void** srcs, size_t* sizes, size_t count, void* stream) {
    if (count == 0) return BSR_OK;
    if (!dsts || !srcs || !sizes) return set_error(BSR_ERR_INVALID, "bsr_copy_batch: null array");
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_index = 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(dsts, const_cast<const void* const*>(srcs), sizes, count, &attr,
                                         &attr_index, 1, s);
#else
    size_t fail_index = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_index, 1, &fail_index, s);
#endif
    if (e != cudaSuccess) return cuda_error("cudaMemcpyBatchAsync", e);
    return BSR_OK;
#else
    return set_error(BSR_ERR_CUDA, "cudaMemcpyBatchAsync needs CUDA 12.8 or newer (built with %d)", CUDART_VERSION);
#endif
}

BSR_CUDA_API int bsr_copy_loop(void** dsts, void** srcs, size_t* sizes, size_t count, void* stream) {
    if (count > 0 && (!dsts || !srcs || !sizes)) return set_error(BSR_ERR_INVALID, "bsr_copy_loop: null array");
    for (size_t i = 0; i < count; ++i) {
        cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault,
                                        static_cast<cudaStream_t>(stream));
        if (e != cudaSuccess) return cuda_error("cudaMemcpyAsync", e);
    }
    return BSR_OK;
}
