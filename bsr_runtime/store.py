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
from .plan import plan_windows
from .saver import Saver
from .state_hash import ChunkHasher
from .tiers.base import Tier, TierError
from .validation import check_int

PUT_WAIT_S = 600.0  # the most the store waits for its puts, at a time (a tier's own bounds come first)


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
    (first_chunk > 0: the tier already holds the chunks before it) through a Saver whose staging holds
    `window_chunks`, two windows in flight; a block not resident (-1) is stored as zeros (Saver's zero_gaps:
    these states are built whole here, not by an engine). Raises TierError when a put failed. Returns the
    canonical state hash of the chunks written, hashed from the staging they were put from (state_hash.py)."""
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
    hasher = ChunkHasher()  # over what was staged and put, window by window in prefix order
    saver = Saver(reg, [tier], staging_chunks=w, keyspace=keyspace, backend=backend, stream=stream, zero_gaps=True,
                  on_staged=hasher.update)
    saver.kv = list(kv)
    ids = [torch.as_tensor(t, dtype=torch.int64) for t in block_tables]  # once, not per window
    try:
        # two windows in flight (ceil(W/2) and floor(W/2) chunks, as a restore's at depth 2): one gathered
        # while the one before it is put
        for window in plan_windows(n_total, w, 2, first_chunk):
            at, n = window.first_chunk, window.num_chunks
            _wait_for_room(saver, n, tier)
            _raise_failed(saver, tier)
            skipped = saver.save("store", tokens, at, at + n, ids, keyspace.salt, overwrite=True,
                                 features=keyspace.features)
            if skipped is not None:  # its staging had room: a bug if it ever happens
                raise RuntimeError(f"store of chunks {at}..{at + n - 1} skipped: {skipped.get('skipped')}")
            if progress is not None:
                progress(n)
        if not saver.wait_idle(PUT_WAIT_S):
            raise TierError(f"{tier.name}: the store's puts took over {PUT_WAIT_S:.0f} s")
        _raise_failed(saver, tier)
    finally:
        saver.close(PUT_WAIT_S)
    stored = n_total - first_chunk
    return StoreReport(tier.name, stored, stored * reg.chunk_bytes, time.perf_counter() - t0,
                       saver.arena.peak_bytes, hasher.hexdigest())


def _wait_for_room(saver: Saver, num_chunks: int, tier: Tier) -> None:
    """Until the saver's staging has a run of `num_chunks` free (the put of an earlier window ended); this
    thread is its only other user, so the save that follows gets it."""
    try:
        saver.arena.acquire(num_chunks, PUT_WAIT_S).release()
    except TimeoutError as e:
        raise TierError(f"{tier.name}: a put held the store's staging for over {PUT_WAIT_S:.0f} s") from e


def _raise_failed(saver: Saver, tier: Tier) -> None:
    for rec in saver.take_finished():
        if not rec.get("ok"):
            first, end = rec.get("first_chunk", 0), rec.get("num_chunks", 0)  # a save record's range is first..end-1
            raise TierError(f"{tier.name}: store of chunks {first}..{end - 1} failed: {rec.get('error')}")
