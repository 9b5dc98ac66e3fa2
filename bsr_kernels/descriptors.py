"""Descriptor tables shared by the Triton and CUDA backends.

One int64 row per tensor (layout mirrored by `csrc/bsr_layout.h`), plus one int64 table of
block-table base addresses per group. Rows depend only on the destination tensors, so they
are cached by the tensors' addresses; the block-table pointers change per call.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .registration import Registration

# Column order of a descriptor row; keep in sync with csrc/bsr_layout.h (BSR_DESC_*).
DESC_FIELDS = (
    "dst_base",  # address of the destination tensor
    "entry_bytes",  # bytes of one entry (row)
    "block_stride",  # bytes between consecutive blocks
    "seg_offset",  # offset of this tensor's segment inside a staged chunk
    "entries_per_chunk",  # chunk_tokens // token_ratio
    "block_size",  # entries per block
    "group",  # index into the block-table pointer table
    "num_blocks",  # for device-side bounds checks (debug builds)
)
DESC_COLS = len(DESC_FIELDS)

_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_CACHE_MAX = 16


def descriptor_table(reg: Registration, kv: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    key = (reg.fingerprint, str(device), tuple(t.data_ptr() for t in kv), tuple(t.shape[0] for t in kv))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    rows = []
    for i, (spec, t) in enumerate(zip(reg.specs, kv)):
        eb = spec.entry_bytes
        rows.append([
            t.data_ptr(), eb, t.stride(0) * t.element_size(), reg.segment_offsets[i],
            reg.entries_per_chunk(i), spec.block_size, spec.group, t.shape[0],
        ])
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    _CACHE[key] = table
    if len(_CACHE) > _CACHE_MAX:
        _CACHE.popitem(last=False)
    return table


def block_table_pointers(tables: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, tuple]:
    """int64 table of block-table addresses on `device`; also returns the tables kept alive."""
    moved = tuple(t.to(device).contiguous() for t in tables)
    ptrs = torch.tensor([t.data_ptr() for t in moved], dtype=torch.int64).to(device)
    return ptrs, moved
