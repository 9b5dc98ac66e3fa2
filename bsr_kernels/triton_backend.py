"""Triton backend: one launch copies a whole window, every tensor of the registration.

The grid is the total work: one program per tile of any tensor (a binary search over the prefix
sums of the tensors' tile counts finds its tensor). Program (tile of tensor t) moves one tile of
tensor t's window: its `num_chunks` staged segments read
as one run of entries (entry w of the run is entry `first_chunk * entries_per_chunk + w` of the
tensor, in chunk w // entries_per_chunk). Destination base addresses and block-table bases come
from the int64 tables of `descriptors`, cast to pointers in the kernel, so one launch serves any
number of tensors and groups. Each tensor is copied in the widest unit (8, 4, 2 or 1 bytes)
that its base address, row width and strides allow; segment offsets, chunk bytes and the
staging address are 16-byte aligned by construction (registration.py, validate.py). A unit's
destination address is block * block_stride + slot * slot_stride + the offset of its row in the
entry (row-major over up to three outer entry dims, descriptors.geometry) + its place in the row,
so any strided destination with a contiguous innermost dim is served by the same launch.

Staged chunk c starts at byte c * chunk_stride of the staging (chunk_bytes for 1-D staging; the
row stride of chunk-strided 2-D staging, whose gaps between chunks are never read or written).
Staging on the host with destinations on a GPU: the window is first copied to the device in
one bulk copy (install: the span of its chunks, gaps included, keeping the stride), or gathered
on the device and copied back in one (gather: the chunks' rows only). Both are
stream-ordered: the caller synchronises `stream` before reusing or reading the host buffer.
On the CPU the kernel runs only under TRITON_INTERPRET=1; that is for tests, the torch backend
is faster. `triton.jit` reads the variable when this module is imported, so the kernels are then
either interpreted (CPU tensors only: they dereference raw addresses on the host) or compiled
(CUDA only) for the life of the process, and `available` reports accordingly.
"""

import os
from contextlib import nullcontext

import torch

from .descriptors import DESC_FIELDS, block_table_pointers, descriptor_table
from .registration import Registration
from .validate import WindowArgs

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: available() says False, nothing else is defined
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # as triton.jit saw it below
_GPU_TILE_BYTES = 16384
_INTERP_TILE_BYTES = (64, 1 << 22)  # bounds; 64 keeps TILE_BYTES // 8 lanes >= 1 in every branch


def available(device: torch.device) -> bool:
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return not _INTERPRET and torch.cuda.is_available()
    return device.type == "cpu" and _INTERPRET


if triton is not None:
    # descriptor columns (descriptors.DESC_FIELDS), as compile-time constants of the kernels
    _COLS = tl.constexpr(len(DESC_FIELDS))
    (_BASE, _EB, _BSTRIDE, _SEG, _EPC, _BSIZE, _GROUP, _SSTRIDE, _ROW, _N0, _S0, _N1, _S1, _N2, _S2) = (
        tl.constexpr(DESC_FIELDS.index(f)) for f in (
            "dst_base", "entry_bytes", "block_stride", "seg_offset", "entries_per_chunk", "block_size", "group",
            "slot_stride", "row_bytes", "dim0_count", "dim0_stride", "dim1_count", "dim1_stride", "dim2_count",
            "dim2_stride"))

    @triton.jit
    def _copy_tile(row, bt_ptrs, staging, tile, first_chunk, num_chunks, chunk_stride,
                   GATHER: tl.constexpr, DT: tl.constexpr, UNIT: tl.constexpr, TILE_BYTES: tl.constexpr):
        N: tl.constexpr = TILE_BYTES // UNIT
        dst = tl.load(row + _BASE).to(tl.pointer_type(DT))
        table = tl.load(bt_ptrs + tl.load(row + _GROUP)).to(tl.pointer_type(tl.int64))
        # per-element index math in int32 (64-bit division is slow on GPUs); addresses in int64
        eu = (tl.load(row + _EB) // UNIT).to(tl.int32)  # units per entry
        ru = (tl.load(row + _ROW) // UNIT).to(tl.int32)  # units per contiguous row
        n1 = tl.load(row + _N1).to(tl.int32)
        n2 = tl.load(row + _N2).to(tl.int32)
        epc = tl.load(row + _EPC).to(tl.int32)
        bsize = tl.load(row + _BSIZE).to(tl.int32)
        u = tile * N + tl.arange(0, N)  # unit index in this tensor's window
        w = u // eu  # entry index in the window
        inside = w < num_chunks * epc
        e = first_chunk * epc + w  # entry index in the tensor
        blk = tl.load(table + e // bsize, mask=inside, other=-1)
        keep = inside & (blk >= 0)  # block -1: not resident
        iu = u % eu  # unit in the entry: row r (row-major over the outer entry dims), unit c of the row
        r = iu // ru
        i2 = r % n2
        i1 = (r // n2) % n1
        i0 = r // (n2 * n1)
        in_entry = (i0.to(tl.int64) * tl.load(row + _S0) + i1.to(tl.int64) * tl.load(row + _S1)
                    + i2.to(tl.int64) * tl.load(row + _S2)) // UNIT + (iu % ru)
        d = blk * (tl.load(row + _BSTRIDE) // UNIT) + (e % bsize).to(tl.int64) * (tl.load(row + _SSTRIDE) // UNIT) \
            + in_entry
        chunk = w // epc
        s = chunk.to(tl.int64) * (chunk_stride // UNIT) + tl.load(row + _SEG) // UNIT + (u - chunk * epc * eu)
        src = staging.to(tl.pointer_type(DT))
        if GATHER:  # -1 entries read as zero
            tl.store(src + s, tl.load(dst + d, mask=keep, other=0), mask=inside)
        else:
            tl.store(dst + d, tl.load(src + s, mask=keep), mask=keep)

    @triton.jit
    def _window_kernel(desc, bt_ptrs, staging, tile_starts, num_tensors, first_chunk, num_chunks, chunk_stride,
                       GATHER: tl.constexpr, TILE_BYTES: tl.constexpr, SEARCH_STEPS: tl.constexpr):
        # one program per tile of total work: tile_starts[t] is the first program of tensor t
        # (prefix sums of each tensor's tile count); a binary search finds the program's tensor
        pid = tl.program_id(0).to(tl.int64)
        lo = pid * 0  # invariant: tile_starts[lo] <= pid < tile_starts[hi]
        hi = lo + num_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(tile_starts + mid) <= pid
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        tile = pid - tl.load(tile_starts + lo)
        row = desc + lo * _COLS
        if tile * TILE_BYTES < num_chunks * tl.load(row + _EPC) * tl.load(row + _EB):
            # the unit must divide every byte offset an address is built from (the staging address
            # and chunk stride are multiples of 16: validate.py)
            align = tl.load(row + _BASE) | tl.load(row + _EB) | tl.load(row + _BSTRIDE) | tl.load(row + _SSTRIDE) \
                | tl.load(row + _ROW) | tl.load(row + _S0) | tl.load(row + _S1) | tl.load(row + _S2)
            if align % 8 == 0:
                _copy_tile(row, bt_ptrs, staging, tile, first_chunk, num_chunks, chunk_stride,
                           GATHER, tl.int64, 8, TILE_BYTES)
            elif align % 4 == 0:
                _copy_tile(row, bt_ptrs, staging, tile, first_chunk, num_chunks, chunk_stride,
                           GATHER, tl.int32, 4, TILE_BYTES)
            elif align % 2 == 0:
                _copy_tile(row, bt_ptrs, staging, tile, first_chunk, num_chunks, chunk_stride,
                           GATHER, tl.int16, 2, TILE_BYTES)
            else:
                _copy_tile(row, bt_ptrs, staging, tile, first_chunk, num_chunks, chunk_stride,
                           GATHER, tl.uint8, 1, TILE_BYTES)


def _launch(reg: Registration, a: WindowArgs, staging: torch.Tensor, chunk_stride: int, gather: bool,
            desc: torch.Tensor | None) -> None:
    device = a.kv[0].device
    if desc is None:
        desc = descriptor_table(reg, a.kv, device)
    bt_ptrs, _tables = block_table_pointers(a.block_tables, device)  # _tables: keep them alive
    window_bytes = a.num_chunks * max(reg.segment_bytes(i) for i in range(reg.num_tensors))
    assert window_bytes < 2**31, "unit indices are int32: split windows over 2 GiB per tensor"
    if device.type == "cuda":
        tile_bytes = _GPU_TILE_BYTES
    else:  # the interpreter runs programs one after another, each vectorised: few, large tiles
        tile_bytes = min(max(triton.next_power_of_2(window_bytes), _INTERP_TILE_BYTES[0]), _INTERP_TILE_BYTES[1])
    starts = _tile_starts(reg, a.num_chunks, tile_bytes, device)
    steps = max(1, (reg.num_tensors - 1).bit_length())  # ceil(log2(num_tensors))
    _window_kernel[(int(starts.total),)](desc, bt_ptrs, staging, starts.table, reg.num_tensors, a.first_chunk,
                                         a.num_chunks, chunk_stride, GATHER=gather, TILE_BYTES=tile_bytes,
                                         SEARCH_STEPS=steps, num_warps=8)


class _Starts:
    def __init__(self, table: torch.Tensor, total: int) -> None:
        self.table, self.total = table, total


_STARTS: dict[tuple, _Starts] = {}


def _tile_starts(reg: Registration, num_chunks: int, tile_bytes: int, device: torch.device) -> _Starts:
    """Prefix sums of the tensors' tile counts (num_tensors + 1 entries) on `device`: the grid is the
    total work, not the largest tensor's tiles times the tensor count. Cached per window shape."""
    key = (reg.fingerprint, num_chunks, tile_bytes, str(device))
    hit = _STARTS.get(key)
    if hit is None:
        starts = [0]
        for i in range(reg.num_tensors):
            starts.append(starts[-1] + -(-num_chunks * reg.segment_bytes(i) // tile_bytes))
        hit = _Starts(torch.tensor(starts, dtype=torch.int64).to(device), starts[-1])
        if len(_STARTS) > 64:
            _STARTS.clear()
        _STARTS[key] = hit
    return hit


def _window(reg: Registration, a: WindowArgs) -> tuple[torch.Tensor, int]:
    """(the window's staging, its chunk stride): 1-D, the window's bytes; 2-D (chunk-strided), the
    window's rows."""
    rows = a.staging[: a.num_chunks] if a.staging.dim() == 2 else a.staging[: a.num_chunks * reg.chunk_bytes]
    return rows, a.chunk_stride


def install(reg: Registration, a: WindowArgs, stream=None, desc: torch.Tensor | None = None) -> None:
    """One launch (`desc`: the destinations' descriptor table on their device, when the caller has it)."""
    device = a.kv[0].device
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        staging, stride = _window(reg, a)
        if staging.device != device:  # host staging: one bulk copy to the device
            if staging.dim() == 2:  # the span of the rows, gaps included: one copy, same stride
                staging = staging.as_strided(((a.num_chunks - 1) * stride + reg.chunk_bytes,), (1,))
            staging = staging.to(device, non_blocking=True)
        _launch(reg, a, staging, stride, False, desc)


def gather(reg: Registration, a: WindowArgs, stream=None, desc: torch.Tensor | None = None) -> None:
    device = a.kv[0].device
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        out, stride = _window(reg, a)
        if out.device == device:
            buf = out
        else:  # gathered contiguous on the device, copied back below
            buf, stride = torch.empty(out.shape, dtype=torch.uint8, device=device), reg.chunk_bytes
        buf.zero_()  # padding between segments and chunk tails (only the rows of strided staging)
        _launch(reg, a, buf, stride, True, desc)
        if buf is not out:  # host staging: one bulk copy back (the rows only, never the gaps)
            out.copy_(buf, non_blocking=True)
