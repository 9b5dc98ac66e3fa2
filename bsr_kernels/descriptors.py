"""Destination geometry and the descriptor tables shared by the Triton, CUDA and CPU backends.

A destination is any strided view of logical shape (num_blocks, block_size, *entry_shape) whose
innermost dimension is contiguous. `geometry` reduces it to byte strides: block stride, slot
stride, a contiguous row of `row_bytes`, and up to MAX_ROW_DIMS outer entry dims (count, stride)
after merging dims that are contiguous with each other (a contiguous entry has none: one row).

One int64 row per tensor (layout mirrored by `csrc/bsr_layout.h`), plus one int64 table of
block-table base addresses per group. Rows depend only on the destination tensors, so they
are cached by the tensors' addresses, shapes and strides; the block-table pointers change per call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .registration import Registration

MAX_ROW_DIMS = 3  # BSR_MAX_ROW_DIMS in csrc/bsr_layout.h

# Column order of a descriptor row; keep in sync with csrc/bsr_layout.h (BSR_DESC_*).
DESC_FIELDS = (
    "dst_base",  # address of the destination view's first byte
    "entry_bytes",  # bytes of one entry (its staged size)
    "block_stride",  # bytes between consecutive blocks
    "seg_offset",  # offset of this tensor's segment inside a staged chunk
    "entries_per_chunk",  # chunk_tokens // token_ratio
    "block_size",  # entries per block
    "group",  # index into the block-table pointer table
    "num_blocks",  # for bounds checks
    "slot_stride",  # bytes between consecutive slots of a block
    "row_bytes",  # contiguous bytes of one row; entry_bytes = row_bytes * rows_per_entry
    "rows_per_entry",  # product of the dim counts below
    "dim0_count", "dim0_stride",  # outer entry dims, outermost first (count 1, stride 0 when unused);
    "dim1_count", "dim1_stride",  # row r of an entry sits at sum(i_k * stride_k) with r in
    "dim2_count", "dim2_stride",  # row-major order of (dim0, dim1, dim2)
)
DESC_COLS = len(DESC_FIELDS)


@dataclass(frozen=True)
class Geometry:
    """Byte strides of one destination; `dims` are (count, stride) of the outer entry dims."""

    block_stride: int
    slot_stride: int
    row_bytes: int
    dims: tuple[tuple[int, int], ...]
    offset: int  # byte offset of the view's first element in its storage

    @property
    def entry_contiguous(self) -> bool:
        return not self.dims

    @property
    def rows_per_entry(self) -> int:
        n = 1
        for c, _ in self.dims:
            n *= c
        return n

    def strides(self) -> list[int]:
        """Every byte stride an address of this destination is built from (alignment checks)."""
        return [self.block_stride, self.slot_stride, self.row_bytes, *(s for _, s in self.dims)]


def geometry(t: torch.Tensor) -> Geometry:
    """Geometry of a destination already checked to have an innermost stride of 1."""
    size = t.element_size()
    row = t.shape[-1] * size
    outer = [(int(n), int(s) * size) for n, s in zip(t.shape[2:-1], t.stride()[2:-1]) if n != 1]
    # merge from the inside: a dim whose stride is the extent inside it continues the row / the dim
    merged: list[tuple[int, int]] = []
    for n, s in reversed(outer):
        if not merged and s == row:
            row *= n
        elif merged and s == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, s))
    return Geometry(t.stride(0) * size, t.stride(1) * size, row, tuple(reversed(merged)),
                    t.storage_offset() * size)


_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_CACHE_MAX = 16


def dest_key(kv: tuple[torch.Tensor, ...]) -> tuple:
    """What a destination tuple's layout depends on: addresses, shapes, strides, dtypes."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in kv)


def descriptor_rows(reg: Registration, kv: tuple[torch.Tensor, ...]) -> list[list[int]]:
    rows = []
    for i, (spec, t) in enumerate(zip(reg.specs, kv)):
        g = geometry(t)
        dims = [(1, 0)] * (MAX_ROW_DIMS - len(g.dims)) + list(g.dims)
        rows.append([
            t.data_ptr(), spec.entry_bytes, g.block_stride, reg.segment_offsets[i], reg.entries_per_chunk(i),
            spec.block_size, spec.group, t.shape[0], g.slot_stride, g.row_bytes, g.rows_per_entry,
            *(x for d in dims for x in d),
        ])
    return rows


def descriptor_table(reg: Registration, kv: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    key = (reg.fingerprint, str(device), dest_key(kv))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    table = torch.tensor(descriptor_rows(reg, kv), dtype=torch.int64).to(device)
    _CACHE[key] = table
    if len(_CACHE) > _CACHE_MAX:
        _CACHE.popitem(last=False)
    return table


_PTRS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_LAST: tuple | None = None  # (tables, device, pointer table, tables kept alive, their addresses): the last call's


def block_table_pointers(tables: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, tuple]:
    """int64 table of block-table addresses on `device`; also returns the tables kept alive.

    Tables already on `device` (WindowInstaller uploads them once per restore) are used in place,
    and their pointer table is cached by address, so a window then uploads nothing; the same tuple of
    tables already there again (an installer's windows) is answered from their addresses alone."""
    global _LAST
    last = _LAST  # one read: the tuple, its device, its addresses and its answer belong together
    if last is not None and last[0] is tables and last[1] == device and \
            all(t.data_ptr() == p for t, p in zip(tables, last[4], strict=True)):
        return last[2], last[3]
    moved = tuple(t.to(device).contiguous() for t in tables)
    key = (str(device), tuple(t.data_ptr() for t in moved))
    ptrs = _PTRS.get(key)
    if ptrs is None:
        ptrs = torch.tensor([t.data_ptr() for t in moved], dtype=torch.int64).to(device)
        _PTRS[key] = ptrs
        if len(_PTRS) > _CACHE_MAX:
            _PTRS.popitem(last=False)
    else:
        _PTRS.move_to_end(key)
    if all(m is t for m, t in zip(moved, tables, strict=True)):  # in place: the kernel reads these very tensors
        _LAST = (tables, device, ptrs, moved, key[1])  # holds `tables`: its identity is not reused meanwhile
    return ptrs, moved
