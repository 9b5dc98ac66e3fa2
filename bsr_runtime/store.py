"""The store path: gather a request's prefix from destination blocks and put it, window by
window, with the same staging bound as the restore."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bsr_kernels import Registration, StagingPool, gather_window

from .keys import KeySpace, PrefixKeys
from .plan import plan_windows
from .state_hash import ChunkHasher
from .tiers.base import Tier


@dataclass
class StoreReport:
    tier: str
    num_chunks: int
    bytes_written: int
    seconds: float
    peak_staging_bytes: int
    state_hash: str


def store_prefix(reg: Registration, tier: Tier, keyspace: KeySpace, tokens: Sequence[int],
                 kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor], num_chunks: int | None = None,
                 window_chunks: int = 32, backend: str = "auto", progress=None,
                 first_chunk: int = 0) -> StoreReport:
    """Write chunks first_chunk..num_chunks-1 (default: every whole chunk of `tokens`) to `tier`
    (first_chunk > 0: the tier already holds the chunks before it).

    Returns the canonical state hash of what was written (see state_hash.py)."""
    if keyspace.fingerprint != reg.fingerprint:
        raise ValueError("keyspace was built for another registration")
    if window_chunks <= 0:
        raise ValueError(f"store window must be positive, got {window_chunks}")
    keys = PrefixKeys(keyspace, tokens, reg.chunk_tokens)
    n_total = (keys.num_chunks if num_chunks is None else num_chunks) - first_chunk
    if n_total < 0:
        raise ValueError(f"first_chunk {first_chunk} is past the {n_total + first_chunk} chunks to store")
    pool = StagingPool(reg.chunk_bytes, max(1, min(window_chunks, n_total)))
    tier.register_staging(pool.buffer)
    hasher = ChunkHasher()
    t0 = time.perf_counter()
    try:
        for win in plan_windows(n_total, pool.capacity_chunks):
            lease = pool.acquire(win.num_chunks)
            first = first_chunk + win.first_chunk
            try:
                gather_window(lease.view, reg, kv, block_tables, first, win.num_chunks, backend=backend)
                hasher.update(lease.view)
                tier.put(keys.window(first, win.num_chunks),
                         [lease.chunk(i) for i in range(win.num_chunks)])
            finally:
                pool.release(lease)
            if progress is not None:
                progress(win.num_chunks)
    finally:
        tier.unregister_staging(pool.buffer)
    return StoreReport(tier.name, n_total, n_total * reg.chunk_bytes, time.perf_counter() - t0,
                       pool.peak_bytes, hasher.hexdigest())
