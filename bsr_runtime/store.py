"""Storing a prefix held in destination blocks, for the harness, benchmarks and tests: through the engine's
own save path (saver.Saver: each window gathered into its staging, then put on its thread, replacing what
is there), a window at a time, so what they store is what an engine's saves store, the same way."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bsr_kernels import Registration
from bsr_kernels.validate import check_destinations

from .keys import KeySpace, PrefixKeys
from .saver import Saver
from .state_hash import state_hash
from .tiers.base import Tier, TierError
from .validation import check_int

PUT_WAIT_S = 600.0  # the most one window's puts may take before the store fails (a tier's own bounds come first)


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
                 window_chunks: int = 32, backend: str = "auto", progress: Callable[[int], None] | None = None,
                 *, stream=None, first_chunk: int = 0) -> StoreReport:
    """Write chunks first_chunk..num_chunks-1 (default: every whole chunk of `tokens`) to `tier`
    (first_chunk > 0: the tier already holds the chunks before it), `window_chunks` at a time through a
    Saver whose staging holds that many; a block not resident (-1) is stored as zeros (Saver's zero_gaps:
    these states are built whole here, not by an engine). Raises TierError when a put failed. Returns the
    canonical state hash of the chunks written (see state_hash.py)."""
    if keyspace.fingerprint != reg.fingerprint:
        raise ValueError("keyspace was built for another registration")
    if isinstance(window_chunks, bool) or not isinstance(window_chunks, int) or window_chunks <= 0:
        raise ValueError(f"store window must be a positive integer, got {window_chunks!r}")
    keys = PrefixKeys(keyspace, tokens, reg.chunk_tokens)
    n_total = keys.num_chunks if num_chunks is None else check_int("num_chunks", num_chunks, lo=0, hi=keys.num_chunks)
    kv, _ = check_destinations(reg, kv, block_tables, 0, n_total, gather=True)
    if not 0 <= first_chunk <= n_total:
        raise ValueError(f"first_chunk {first_chunk} outside 0..{n_total}")
    t0 = time.perf_counter()
    w = max(1, min(window_chunks, n_total - first_chunk))
    saver = Saver(reg, [tier], staging_chunks=w, keyspace=keyspace, backend=backend, stream=stream, zero_gaps=True)
    saver.kv = list(kv)
    ids = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in block_tables]
    try:
        for at in range(first_chunk, n_total, w):
            n = min(w, n_total - at)
            skipped = saver.save("store", tokens, at, at + n, ids, keyspace.salt, overwrite=True,
                                 features=keyspace.features)
            if skipped is not None:  # its staging is free between windows: a bug if it ever happens
                raise RuntimeError(f"store of chunks {at}..{at + n - 1} skipped: {skipped.get('skipped')}")
            if not saver.wait_idle(PUT_WAIT_S):
                raise TierError(f"{tier.name}: the put of chunks {at}..{at + n - 1} took over {PUT_WAIT_S:.0f} s")
            for rec in saver.take_finished():
                if not rec.get("ok"):
                    raise TierError(f"{tier.name}: store of chunks {at}..{at + n - 1} failed: {rec.get('error')}")
            if progress is not None:
                progress(n)
    finally:
        saver.close(PUT_WAIT_S)
    stored = n_total - first_chunk
    return StoreReport(tier.name, stored, stored * reg.chunk_bytes, time.perf_counter() - t0,
                       saver.arena.peak_bytes, state_hash(reg, kv, block_tables, n_total, first_chunk=first_chunk))
