"""The store path: gather a request's prefix from destination blocks and put it, window by
window, through the same window loop and staging bound as the restore."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bsr_kernels import Registration, gather_window
from bsr_kernels.staging_arena import ArenaLease, StagingArena, work_stream
from bsr_kernels.validate import check_destinations

from .admission import Admission, WindowReservation
from .keys import KeySpace, PrefixKeys
from .plan import Window, plan_windows
from .state_hash import ChunkHasher
from .tiers.base import FETCH_HEADROOM, Tier, put_replacing
from .validation import check_int
from .window_loop import WindowFailed, WindowLoop


@dataclass
class StoreReport:
    tier: str
    num_chunks: int
    bytes_written: int
    seconds: float
    peak_staging_bytes: int
    state_hash: str


class TierSink:
    """A store's bytes to a tier, window by window through its reservation's staging (the loop's WindowSink).
    Making one starts nothing."""

    def __init__(self, tier: Tier, keys: PrefixKeys, hasher: ChunkHasher) -> None:
        self.tier, self.keys, self.hasher = tier, keys, hasher

    def stage(self, window: Window, reservation: WindowReservation) -> TierStoreWindow:
        return TierStoreWindow(self, reservation.lease, window)


class TierStoreWindow:
    """A store window: its staging lease, gathered into, then put to the tier (the loop's StoreWindow)."""

    def __init__(self, sink: TierSink, lease: ArenaLease, window: Window) -> None:
        self.sink, self.lease = sink, lease
        self.keys = sink.keys.window(window.first_chunk, window.num_chunks)
        self._released = False

    def runs(self) -> list[tuple[int, int, torch.Tensor]]:
        return [(0, self.lease.num_chunks, self.lease.view)]

    def synchronize(self, stream) -> None:
        self.lease.record(stream)
        self.lease.synchronize()

    def put(self) -> None:
        self.sink.hasher.update(self.lease.view)
        put_replacing(self.sink.tier, self.keys, self.lease.chunks(), headroom=self.lease.arena.headroom)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.lease.release()

    def abandon(self, stream) -> None:
        if not self._released:
            self.synchronize(stream)
            self.release()


def store_prefix(reg: Registration, tier: Tier, keyspace: KeySpace, tokens: Sequence[int],
                 kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor], num_chunks: int | None = None,
                 window_chunks: int = 32, backend: str = "auto", progress: Callable[[int], None] | None = None,
                 *, stream=None, first_chunk: int = 0) -> StoreReport:
    """Write chunks first_chunk..num_chunks-1 (default: every whole chunk of `tokens`) to `tier`
    (first_chunk > 0: the tier already holds the chunks before it).

    Staging holds at most `window_chunks` chunks (an arena of its own). Returns the canonical state hash of what
    was written (see state_hash.py)."""
    if keyspace.fingerprint != reg.fingerprint:
        raise ValueError("keyspace was built for another registration")
    if isinstance(window_chunks, bool) or not isinstance(window_chunks, int) or window_chunks <= 0:
        raise ValueError(f"store window must be a positive integer, got {window_chunks!r}")
    keys = PrefixKeys(keyspace, tokens, reg.chunk_tokens)
    n_total = keys.num_chunks if num_chunks is None else check_int("num_chunks", num_chunks, lo=0, hi=keys.num_chunks)
    kv, _ = check_destinations(reg, kv, block_tables, 0, n_total, gather=True)  # each window's gather re-reads them
    tables = tuple(block_tables)
    if not 0 <= first_chunk <= n_total:
        raise ValueError(f"first_chunk {first_chunk} outside 0..{n_total}")
    # header room before each chunk: a tier that stores a header with each object writes it there
    arena = StagingArena(reg.chunk_bytes, max(1, min(window_chunks, n_total - first_chunk)), headroom=FETCH_HEADROOM)
    loop = WindowLoop(Admission(arena), work_stream(kv, stream))  # each put waits for its window's gather
    hasher = ChunkHasher()

    def gather(view: torch.Tensor, first: int, n: int) -> str:
        backend_used = gather_window(view, reg, kv, tables, first, n, backend=backend, stream=stream)
        if progress is not None:
            progress(n)
        return backend_used

    t0 = time.perf_counter()
    tier.register_staging(arena.buffer)
    try:
        windows = (dataclasses.replace(w, first_chunk=first_chunk + w.first_chunk)
                   for w in plan_windows(n_total - first_chunk, arena.capacity_chunks))
        loop.store(windows, TierSink(tier, keys, hasher), gather)
    except WindowFailed as e:
        raise e.cause from e  # a store raises what failed it (the loop's clean-up already ran)
    finally:
        tier.unregister_staging(arena.buffer)
    stored = n_total - first_chunk
    return StoreReport(tier.name, stored, stored * reg.chunk_bytes, time.perf_counter() - t0,
                       arena.peak_bytes, hasher.hexdigest())

