/*
 * bsr_layout.h: the staged-chunk / descriptor layout shared by the CUDA kernels and the
 * host (CPU) emulation in bsr_install.cu. Plain C99 / C++ when not compiled by nvcc, so the
 * index arithmetic is unit-testable on machines without a GPU.
 *
 * A staged window is `num_chunks` chunks of `chunk_bytes` each (chunk-major), chunk c at byte
 * c * chunk_stride of the window (chunk_stride >= chunk_bytes; chunk_bytes when the chunks are back
 * to back; the bytes between chunks belong to the caller and are never read or written). Inside a
 * chunk, tensor t owns the segment [seg_offset, seg_offset + entries_per_chunk * entry_bytes).
 * Entry i of chunk c (window-relative) is global entry e = (first_chunk + c) * entries_per_chunk + i
 * of its tensor; it lands in block table[e / block_size] (-1 = not resident: skip), slot
 * e % block_size, i.e. at byte dst_base + block * block_stride + slot * slot_stride. The
 * destination may be any strided view whose innermost dim is contiguous: an entry is
 * rows_per_entry contiguous rows of row_bytes; row r (row-major over up to BSR_MAX_ROW_DIMS outer
 * entry dims, outermost first) starts at i0 * dim0_stride + i1 * dim1_stride + i2 * dim2_stride
 * from the entry's address. The staged entry is canonical: its rows back to back.
 *
 * Keep the BSR_DESC_* columns in the order of DESC_FIELDS in bsr_kernels/descriptors.py; a change
 * here is a change of both libraries' interface (their versions: bsr_abi.h).
 */
#ifndef BSR_LAYOUT_H
#define BSR_LAYOUT_H

#include <stdint.h>

/* nvcc: callable from kernels and host code; gcc/g++: plain host inline functions. */
#if defined(__CUDACC__)
#define BSR_HD __host__ __device__ __forceinline__
#else
#define BSR_HD static inline
#endif

/* Descriptor row: int64 columns, one row per registered tensor. */
#define BSR_DESC_DST_BASE 0          /* address of the destination tensor */
#define BSR_DESC_ENTRY_BYTES 1       /* bytes of one entry (row) */
#define BSR_DESC_BLOCK_STRIDE 2      /* bytes between consecutive blocks */
#define BSR_DESC_SEG_OFFSET 3        /* offset of the tensor's segment inside a staged chunk */
#define BSR_DESC_ENTRIES_PER_CHUNK 4 /* chunk_tokens / token_ratio */
#define BSR_DESC_BLOCK_SIZE 5        /* entries per block */
#define BSR_DESC_GROUP 6             /* index into the block-table pointer table */
#define BSR_DESC_NUM_BLOCKS 7        /* blocks in the destination tensor (bounds checks) */
#define BSR_DESC_SLOT_STRIDE 8       /* bytes between consecutive slots of a block */
#define BSR_DESC_ROW_BYTES 9         /* contiguous bytes of one row of an entry */
#define BSR_DESC_ROWS_PER_ENTRY 10   /* dim0_count * dim1_count * dim2_count */
#define BSR_DESC_DIM0_COUNT 11       /* outer entry dims, outermost first; unused: count 1, stride 0 */
#define BSR_DESC_DIM0_STRIDE 12
#define BSR_DESC_DIM1_COUNT 13
#define BSR_DESC_DIM1_STRIDE 14
#define BSR_DESC_DIM2_COUNT 15
#define BSR_DESC_DIM2_STRIDE 16
#define BSR_DESC_COLS 17
#define BSR_MAX_ROW_DIMS 3

/* Status codes of the C API (bsr_last_error() has the text). */
#define BSR_OK 0
#define BSR_ERR_INVALID 1   /* bad argument */
#define BSR_ERR_NO_DEVICE 2 /* no CUDA device / driver */
#define BSR_ERR_CUDA 3      /* a CUDA runtime call failed */

/* Launch geometry, shared by the kernels and the host emulation. */
#define BSR_THREADS 256     /* threads per CTA */
#define BSR_ENTRY_BATCH 256 /* entries whose destinations a CTA resolves at once (shared memory) */
#define BSR_UNROLL 4        /* vector accesses in flight per thread */
#define BSR_MAX_SPLIT 32    /* most CTAs one (chunk, tensor) segment is split into */
#define BSR_MAX_ENTRY_BYTES (1LL << 30) /* widest entry the kernels take */
#define BSR_WARP 32         /* threads per warp */
#define BSR_RUN_PIECE 2048  /* bytes of a run one warp takes at a time (a multiple of 16) */

/* A descriptor row, unpacked. */
typedef struct bsr_desc {
    int64_t dst_base;
    int64_t entry_bytes;
    int64_t block_stride;
    int64_t seg_offset;
    int64_t entries_per_chunk;
    int64_t block_size;
    int64_t group;
    int64_t num_blocks;
    int64_t slot_stride;
    int64_t row_bytes;
    int64_t rows_per_entry;
    int64_t dim_count[BSR_MAX_ROW_DIMS];
    int64_t dim_stride[BSR_MAX_ROW_DIMS];
} bsr_desc;

BSR_HD bsr_desc bsr_desc_row(const int64_t* table, int64_t t) {
    const int64_t* r = table + t * BSR_DESC_COLS;
    bsr_desc d;
    d.dst_base = r[BSR_DESC_DST_BASE];
    d.entry_bytes = r[BSR_DESC_ENTRY_BYTES];
    d.block_stride = r[BSR_DESC_BLOCK_STRIDE];
    d.seg_offset = r[BSR_DESC_SEG_OFFSET];
    d.entries_per_chunk = r[BSR_DESC_ENTRIES_PER_CHUNK];
    d.block_size = r[BSR_DESC_BLOCK_SIZE];
    d.group = r[BSR_DESC_GROUP];
    d.num_blocks = r[BSR_DESC_NUM_BLOCKS];
    d.slot_stride = r[BSR_DESC_SLOT_STRIDE];
    d.row_bytes = r[BSR_DESC_ROW_BYTES];
    d.rows_per_entry = r[BSR_DESC_ROWS_PER_ENTRY];
    for (int k = 0; k < BSR_MAX_ROW_DIMS; ++k) {
        d.dim_count[k] = r[BSR_DESC_DIM0_COUNT + 2 * k];
        d.dim_stride[k] = r[BSR_DESC_DIM0_STRIDE + 2 * k];
    }
    return d;
}

/* log2 of a power of two. */
BSR_HD int bsr_log2(int64_t pow2) {
#if defined(__CUDA_ARCH__)
    return __ffsll((long long)pow2) - 1;
#else
    return __builtin_ctzll((unsigned long long)pow2);
#endif
}

/* Where one staged entry goes. block < 0: skip (not resident). */
typedef struct bsr_loc {
    int64_t entry;   /* global entry index e of the tensor */
    int64_t block;   /* table[e / block_size] */
    int64_t slot;    /* e % block_size */
    int64_t src_off; /* byte offset in the staged window (chunks chunk_stride bytes apart) */
    int64_t dst_off; /* byte offset from dst_base (meaningful only when block >= 0) */
} bsr_loc;

/* Entry i of window chunk c of tensor d; `table` is the tensor's group block table. */
BSR_HD bsr_loc bsr_locate(int64_t c, int64_t first_chunk, int64_t i, int64_t chunk_stride, const bsr_desc* d,
                          const int64_t* table) {
    bsr_loc l;
    l.entry = (first_chunk + c) * d->entries_per_chunk + i;
    const int64_t bs = d->block_size;
    if ((bs & (bs - 1)) == 0) { /* power of two: a shift and a mask instead of a 64-bit division */
        const int64_t at = l.entry >> bsr_log2(bs);
        l.block = table[at];
        l.slot = l.entry & (bs - 1);
    } else {
        l.block = table[l.entry / bs];
        l.slot = l.entry % bs;
    }
    l.src_off = c * chunk_stride + d->seg_offset + i * d->entry_bytes;
    l.dst_off = l.block * d->block_stride + l.slot * d->slot_stride;
    return l;
}

/* Destination offset of byte b (0 <= b < entry_bytes) of a canonical staged entry, from the
 * entry's address: row r = b / row_bytes, row-major over the outer dims, then the byte in the row.
 * A contiguous entry (one row) needs no division. */
BSR_HD int64_t bsr_entry_offset(const bsr_desc* d, int64_t b) {
    if (d->rows_per_entry == 1) return b;
    int64_t r = b / d->row_bytes, off = b - r * d->row_bytes;
    for (int k = BSR_MAX_ROW_DIMS - 1; k >= 0; --k) {
        const int64_t n = d->dim_count[k];
        off += (r % n) * d->dim_stride[k];
        r /= n;
    }
    return off;
}

/* 1 when the descriptor's geometry is consistent (what the wrapper guarantees). */
BSR_HD int bsr_desc_valid(const bsr_desc* d) {
    int64_t rows = 1;
    for (int k = 0; k < BSR_MAX_ROW_DIMS; ++k) {
        if (d->dim_count[k] <= 0 || d->dim_stride[k] < 0) return 0;
        rows *= d->dim_count[k];
    }
    return d->row_bytes > 0 && d->rows_per_entry == rows && rows * d->row_bytes == d->entry_bytes &&
           d->block_stride >= 0 && d->slot_stride >= 0;
}

/* 1 when v is a multiple of w (w a power of two). */
BSR_HD int bsr_divides(int64_t w, uint64_t v) { return (v & (uint64_t)(w - 1)) == 0; }

/*
 * Widest access (16, 8, 4, 2 or 1 bytes) that divides every offset a copy of this tensor
 * can produce: entry_bytes, seg_offset, chunk_stride (the staging offset of chunk c is
 * c * chunk_stride, so it decides the alignment of every chunk after the first), block_stride
 * and both base addresses. 584-byte rows (584 = 8 * 73) get 8-byte accesses.
 */
BSR_HD int bsr_access_width(int64_t entry_bytes, int64_t seg_offset, int64_t chunk_stride, int64_t block_stride,
                            uint64_t staging_addr, uint64_t dst_addr) {
    int w = 16;
    while (w > 1) {
        if (bsr_divides(w, (uint64_t)entry_bytes) && bsr_divides(w, (uint64_t)seg_offset) &&
            bsr_divides(w, (uint64_t)chunk_stride) && bsr_divides(w, (uint64_t)block_stride) &&
            bsr_divides(w, staging_addr) && bsr_divides(w, dst_addr))
            break;
        w >>= 1;
    }
    return w;
}

/* Entries [*begin, *end) of a segment of n entries that piece s of `split` covers. */
BSR_HD void bsr_piece_range(int64_t n, int64_t split, int64_t s, int64_t* begin, int64_t* end) {
    int64_t per = (n + split - 1) / split;
    int64_t b = s * per, e = b + per;
    if (b > n) b = n;
    if (e > n) e = n;
    *begin = b;
    *end = e;
}

/*
 * CTAs per (chunk, tensor) segment: enough pieces that the grid has ~8 CTAs per SM even for
 * a one-chunk window, never more than the longest segment has entries, at most BSR_MAX_SPLIT.
 */
BSR_HD int64_t bsr_choose_split(int64_t num_tensors, int64_t num_chunks, int64_t max_entries, int64_t sm_count) {
    int64_t pieces = num_tensors * num_chunks;
    int64_t target = (sm_count > 0 ? sm_count : 1) * 8;
    int64_t split = pieces > 0 ? (target + pieces - 1) / pieces : 1;
    if (split > max_entries) split = max_entries;
    if (split > BSR_MAX_SPLIT) split = BSR_MAX_SPLIT;
    if (split < 1) split = 1;
    return split;
}

/* Entries per shared-memory batch: BSR_ENTRY_BATCH, fewer for huge entries so a batch spans
 * at most 2^30 bytes (32-bit unit indices in the copy loop). */
BSR_HD int64_t bsr_batch_entries(int64_t entry_bytes) {
    int64_t n = entry_bytes > 0 ? ((int64_t)1 << 30) / entry_bytes : BSR_ENTRY_BATCH;
    if (n > BSR_ENTRY_BATCH) n = BSR_ENTRY_BATCH;
    if (n < 1) n = 1;
    return n;
}

/* 1 when consecutive slots of a block are back to back (a contiguous entry, slot_stride ==
 * entry_bytes): the entries of one block in a batch are then one contiguous run on both sides. */
BSR_HD int bsr_desc_packed(const bsr_desc* d) { return d->rows_per_entry == 1 && d->slot_stride == d->entry_bytes; }

/* Widest access (16..1 bytes) for one contiguous run: both addresses and the length. A run of 64
 * 584-byte rows (37,376 B) gets 16-byte accesses where the per-entry width is 8. */
BSR_HD int bsr_run_width(uint64_t src, uint64_t dst, int64_t nbytes) {
    int w = 16;
    while (w > 1 && !(bsr_divides(w, src) && bsr_divides(w, dst) && bsr_divides(w, (uint64_t)nbytes))) w >>= 1;
    return w;
}

/* Widest access for a descriptor: every stride and the row width must be multiples of it too,
 * and so must the staging's chunk stride (chunk c starts at staging_addr + c * chunk_stride). */
BSR_HD int bsr_desc_access_width(const bsr_desc* d, int64_t chunk_stride, uint64_t staging_addr) {
    int64_t strides = d->block_stride | d->slot_stride | d->row_bytes;
    for (int k = 0; k < BSR_MAX_ROW_DIMS; ++k) strides |= d->dim_stride[k];
    return bsr_access_width(d->entry_bytes, d->seg_offset, chunk_stride, strides, staging_addr,
                            (uint64_t)d->dst_base);
}

/* First byte after tensor t's segment that belongs to the next segment (or the chunk end). */
BSR_HD int64_t bsr_next_segment(const int64_t* desc, int64_t t, int64_t num_tensors, int64_t chunk_bytes) {
    return t + 1 < num_tensors ? desc[(t + 1) * BSR_DESC_COLS + BSR_DESC_SEG_OFFSET] : chunk_bytes;
}

#endif /* BSR_LAYOUT_H */
