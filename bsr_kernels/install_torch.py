"""Pure-torch install/gather: the reference every other backend is compared with.

Clear, not clever: per tensor, compute each window entry's (block, slot) and copy rows with
advanced indexing. Works on CPU and GPU tensors alike.
"""

from __future__ import annotations

import torch

from .registration import Registration
from .validate import WindowArgs


def _entry_map(reg: Registration, i: int, table: torch.Tensor, first_chunk: int, num_chunks: int):
    spec = reg.specs[i]
    per_chunk = reg.entries_per_chunk(i)
    e = torch.arange(first_chunk * per_chunk, (first_chunk + num_chunks) * per_chunk, device=table.device)
    blocks = table[e // spec.block_size]
    slots = e % spec.block_size
    keep = blocks >= 0
    return blocks, slots, keep


def _rows(staging: torch.Tensor, reg: Registration, i: int, num_chunks: int) -> torch.Tensor:
    """The staged rows of tensor i for the window, as a (num_chunks, entries, entry_bytes) view."""
    cb, off = reg.chunk_bytes, reg.segment_offsets[i]
    seg = staging[: num_chunks * cb].view(num_chunks, cb)[:, off : off + reg.segment_bytes(i)]
    return seg.unflatten(1, (reg.entries_per_chunk(i), reg.specs[i].entry_bytes))


def _byte_view(t: torch.Tensor, eb: int) -> torch.Tensor:
    return t.view(torch.uint8).view(t.shape[0], t.shape[1], eb)


def install_torch(reg: Registration, a: WindowArgs) -> None:
    for i, spec in enumerate(reg.specs):
        dst = a.kv[i]
        table = a.block_tables[spec.group].to(dst.device)
        blocks, slots, keep = _entry_map(reg, i, table, a.first_chunk, a.num_chunks)
        rows = _rows(a.staging, reg, i, a.num_chunks).flatten(0, 1).to(dst.device, non_blocking=True)
        _byte_view(dst, spec.entry_bytes)[blocks[keep], slots[keep]] = rows[keep.to(rows.device)]


def gather_torch(reg: Registration, a: WindowArgs) -> None:
    """Inverse of install: destination blocks -> staging. Padding and -1 entries read as zero."""
    a.staging[: a.num_chunks * reg.chunk_bytes].zero_()
    for i, spec in enumerate(reg.specs):
        src = a.kv[i]
        table = a.block_tables[spec.group].to(src.device)
        blocks, slots, keep = _entry_map(reg, i, table, a.first_chunk, a.num_chunks)
        rows = torch.zeros(blocks.numel(), spec.entry_bytes, dtype=torch.uint8, device=src.device)
        rows[keep] = _byte_view(src, spec.entry_bytes)[blocks[keep], slots[keep]]
        view = _rows(a.staging, reg, i, a.num_chunks)
        view.copy_(rows.view(view.shape), non_blocking=True)
