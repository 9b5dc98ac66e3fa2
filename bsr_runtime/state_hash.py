"""Canonical state hash: sha256 over the prefix's chunks in the staged layout.

Computed from destination blocks by gathering window by window (padding and -1 entries read
as zero), so the hash of restored blocks equals the hash of the state that was stored,
whatever block ids the two sides used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from bsr_kernels import Registration, gather_window


class ChunkHasher:
    """Incremental hash over staged chunks in prefix order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, staged: torch.Tensor) -> None:
        """Staged bytes: 1-D, or 2-D (chunks, chunk_bytes) rows with gaps between them (hashed row by row:
        the same digest as the rows back to back)."""
        for row in (staged if staged.dim() == 2 else (staged,)):
            self._h.update(row.cpu().numpy().tobytes() if row.device.type != "cpu" else row.numpy())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def state_hash(reg: Registration, kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor],
               num_chunks: int, window_chunks: int = 32) -> str:
    """Hash of chunks 0..num_chunks-1 held in `kv` (bounded: one window of scratch)."""
    hasher = ChunkHasher()
    w = max(1, min(window_chunks, num_chunks))
    buf = torch.empty(w * reg.chunk_bytes, dtype=torch.uint8)
    for first in range(0, num_chunks, w):
        n = min(w, num_chunks - first)
        gather_window(buf, reg, kv, block_tables, first, n, backend="torch")
        hasher.update(buf[: n * reg.chunk_bytes])
    return hasher.hexdigest()
