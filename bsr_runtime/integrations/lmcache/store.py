"""The store path through LMCache's L1, on BSR's one window loop (bsr_runtime/window_loop.py).

Each batch is an `L1StoreStage`: with an L2, its keys deleted from L1 and every L2 first (a store
replaces: an L2 lookup cannot tell an old or damaged object from the new one), then `reserve_write`
of its keys -> `gather` (of the store's one `WindowInstaller`) into the reserved L1 objects ->
`finish_write`; LMCache's store controller writes them to every L2 adapter; the path waits until
the L2 adapters hold them and (flush_l1) deletes them from L1, batch by batch, so any length fits a
small L1. A batch is at most W (or 32) chunks that also fit the free L1 and the admission's byte
budget, planned lazily from the L1 left free by the previous batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_kernels import WindowInstaller
from bsr_runtime.keys import KeySpace
from bsr_runtime.plan import Window
from bsr_runtime.state_hash import ChunkHasher
from bsr_runtime.store import StoreReport
from bsr_runtime.window_loop import WindowFailed, WindowLoop

from .objects import _POLL_S, LMCacheKeys, _runs
from .probe import L2Lookups

if TYPE_CHECKING:
    from .adapter import LMCacheAdapter


@dataclass
class StoreJob:
    """What every batch of one store shares."""

    ad: LMCacheAdapter
    keys: LMCacheKeys
    kv: Sequence[torch.Tensor]
    hasher: ChunkHasher
    gather_scratch: Callable[[int], torch.Tensor]  # chunk -> its canonical bytes (for resident objects)
    has_l2: bool
    flush_l1: bool
    timeout_s: float


class L1Sink:
    """A store's bytes to LMCache's L1, batch by batch (the loop's WindowSink)."""

    def __init__(self, job: StoreJob) -> None:
        self.job = job

    def stage(self, win: Window, reservation) -> L1StoreStage:
        return L1StoreStage(self.job, win)


class L1StoreStage:
    """A store batch staged in reserved L1 objects (the window loop's StoreWindow)."""

    def __init__(self, job: StoreJob, win: Window) -> None:
        self.job, self.sm = job, job.ad.sm
        self.first, self.chunk_bytes = win.first_chunk, job.ad.reg.chunk_bytes
        self.object_bytes = job.ad.l1_object_bytes
        self.batch = job.keys.window(win.first_chunk, win.num_chunks)
        if job.has_l2:  # an L2 lookup cannot tell an old (maybe damaged) object from this write's
            delete_everywhere(self.sm, self.batch, time.monotonic() + job.timeout_s)
        self.reserved = self.sm.reserve_write(self.batch, job.ad.layout)
        self.objs = [self.reserved.get(k) for k in self.batch]  # None: already resident, or no room
        self._written = False

    def runs(self) -> list[tuple[int, int, torch.Tensor]]:
        return list(_runs(self.objs, self.chunk_bytes, self.object_bytes))

    def synchronize(self, stream) -> None:
        self.job.ad.synchronize(self.job.kv)  # gathers into L1: device-wide, or on the adapter's stream

    def put(self) -> None:
        """Hash the batch (canonical, chunk order), finish the writes, wait until the batch is in
        L2 and (flush_l1) delete it from L1."""
        job, n = self.job, len(self.batch)
        for i, obj in enumerate(self.objs):
            job.hasher.update(job.gather_scratch(self.first + i) if obj is None else obj.raw_tensor[: self.chunk_bytes])
        if self.reserved:
            self._written = True
            self.sm.finish_write([k for k in self.batch if k in self.reserved])
        if job.has_l2:
            wait_in_l2(job.ad.l2, self.batch, time.monotonic() + job.timeout_s)
        elif len(self.reserved) < n:
            raise RuntimeError(f"{n - len(self.reserved)} objects could not be reserved in L1")
        if job.flush_l1:
            flush_l1(self.sm, self.batch, time.monotonic() + job.timeout_s)

    def release(self) -> None:
        pass  # finished writes belong to LMCache (flushed from L1, or kept by its store policy)

    def abandon(self, stream) -> None:
        if not self._written:
            try:
                self.synchronize(stream)  # a gather may have been launched into the reserved objects
            finally:
                abort_writes(self.sm, list(self.reserved))


def store(ad: LMCacheAdapter, keyspace: KeySpace, tokens: Sequence[int], kv: Sequence[torch.Tensor],
          block_tables: Sequence[torch.Tensor], num_chunks: int | None, batch_chunks: int | None,
          flush_l1: bool, timeout_s: float) -> StoreReport:
    """LMCacheAdapter.store: chunks 0..num_chunks-1 through the window loop; raises what failed."""
    reg = ad.reg
    keys = ad.keys(keyspace, tokens)
    n_total = keys.num_chunks if num_chunks is None else num_chunks
    if not 0 <= n_total <= keys.num_chunks:
        raise ValueError(f"{n_total} chunks requested, the tokens hold {keys.num_chunks}")
    # destinations and tables checked once, before any byte moves; each run of L1 objects then
    # only has its staging and chunk range checked (not a descriptor table per run)
    installer = WindowInstaller(reg, kv, block_tables, n_total, backend=ad.config.install_backend,
                                stream=ad.stream, fingerprint=reg.fingerprint)
    kv = installer.kv
    scratch_installer = WindowInstaller(reg, kv, block_tables, n_total, backend="torch")
    has_l2 = bool(ad.sm.l2_adapters())
    if flush_l1 and not has_l2:
        raise ValueError("flush_l1 needs an L2 adapter (the objects would be lost)")
    want = batch_chunks or ad.config.window_chunks or 32
    budget = getattr(ad.admission, "budget_bytes", None)
    if budget is not None:
        want = max(1, min(want, budget // reg.chunk_bytes))
    scratch = torch.empty(reg.chunk_bytes, dtype=torch.uint8)

    def gather_scratch(chunk: int) -> torch.Tensor:
        scratch_installer.gather(scratch, chunk, 1)
        return scratch

    def gather(view: torch.Tensor, first: int, count: int) -> str:
        return installer.gather(view, first, count)

    job = StoreJob(ad, keys, kv, ChunkHasher(), gather_scratch, has_l2, flush_l1, timeout_s)
    loop = WindowLoop(ad.admission, reg.chunk_bytes, ad.stream, admission_timeout_s=timeout_s)
    t0 = time.perf_counter()
    measure = ad.tracker.start()
    failed = None
    try:
        with ad.admission.admitted(timeout_s):  # the store stages in L1 too: same admission
            loop.store(batches(ad.sm, ad.l1_object_bytes, want, n_total), L1Sink(job), gather)
    except WindowFailed as e:
        failed = e
    finally:
        ad.tracker.stop(measure)
    if failed is not None:
        raise failed.cause  # as before the window loop: the store raises what failed
    return StoreReport(ad.tier_name(), n_total, n_total * reg.chunk_bytes, time.perf_counter() - t0,
                       measure.peak - measure.baseline, job.hasher.hexdigest())


def batches(sm: StorageManager, object_bytes: int, want: int, n_total: int) -> Iterator[Window]:
    """Store windows of at most `want` chunks that fit the L1 free when each is planned."""
    first, index = 0, 0
    while first < n_total:
        used, total = sm.get_l1_usage()
        n = min(want, (total - used) // object_bytes, n_total - first)
        if n <= 0:
            raise MemoryError(f"L1 has no room for one object ({used:,}/{total:,} B used)")
        yield Window(index, first, n, 0)
        first += n
        index += 1


def abort_writes(sm: StorageManager, keys: list[ObjectKey]) -> None:
    """Discard reservations that were never filled. StorageManager has no public abort (its
    finish_write would admit, and store, unwritten bytes): use the L1 manager's
    finish_write_and_delete under the manager's write tag; otherwise LMCache's write TTL
    reclaims them."""
    from lmcache.v1.distributed import storage_manager as smod

    mgr, tag = getattr(sm, "_l1_manager", None), getattr(smod, "_L1_WRITE_TAG", None)
    if keys and mgr is not None and tag is not None:
        mgr.finish_write_and_delete(keys, tag=tag)


def wait_in_l2(l2: L2Lookups, keys: list[ObjectKey], deadline: float) -> None:
    """Until some L2 adapter holds every key."""
    pending = list(keys)
    delay = _POLL_S[0]
    while True:
        found, _errors = l2.lookup(pending)
        present = [any(row[i] for row in found.values()) for i in range(len(pending))]
        pending = [k for k, p in zip(pending, present, strict=True) if not p]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} objects did not reach any L2 adapter in time")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def delete_everywhere(sm: StorageManager, keys: list[ObjectKey], deadline: float) -> None:
    """The keys' objects gone from L1 (waiting out readers' locks) and from every L2 adapter."""
    flush_l1(sm, keys, deadline)
    for _desc, l2 in sm.l2_adapters():
        l2.delete(keys)  # LMCache's adapters log a failed delete and return


def flush_l1(sm: StorageManager, keys: list[ObjectKey], deadline: float) -> None:
    """Delete stored keys from L1; the store controller holds a read lock until its L2 store
    completes, so locked keys are retried."""
    delay = _POLL_S[0]
    while True:
        _deleted, skipped = sm.delete_l1_keys(keys)
        if skipped == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{skipped} stored objects stayed locked in L1")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
