"""The windowed retrieve through LMCache's L1, on BSR's one window loop (bsr_runtime/window_loop.py).

Each window of at most W chunks is fetched by `L1Source.fetch`: `submit_prefetch_task` of the window's keys
(L2 -> L1 loads by LMCache's prefetch controller), `wait_prefetch_status` + `query_prefetch_status`
(every key must be a hit, or the retrieve fails), `read_prefetched_results` (the staged L1
objects), the install straight from L1 memory (zero copy: each run of objects that are contiguous
in the L1 arena is one launch of the retrieve's one WindowInstaller), synchronize,
`finish_read_prefetched` (temporary objects are freed by LMCache) and `delete_l1_keys` of the
L2-loaded keys a retaining prefetch policy kept. Then the next window. W = 0 is LMCache's
whole-plan prefetch: one window of N chunks.

Admission: the retrieve runs under the adapter's admission, SerialAdmission (process-wide, shared
with BoundedRestorer) by default or a ByteBudget B from which the loop reserves each window's W*c
bytes, so concurrent requests cannot multiply the L1 staging.

Failure (missing key, timeout, install error, admission refused, any exception): the report has
ok=False, committed_tokens = 0, `invalid_block_ids` = per group every destination block id the
retrieve could have written (`bsr_runtime.retrieve.request_block_ids`), `force_local` set (the
request id is added to `adapter.force_local` and to an optional shared `markers` table), and every
lock and staged object of the retrieve released, so L1 usage returns to its pre-retrieve value. A
prefetch that misses its deadline is still running inside LMCache: its result is collected when it
lands (within 1 s on this thread, later on a reaper thread: `LatePrefetches`) and released the same
way.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import GroupedObjectKeys, ObjectKey, PrefetchHandle, PrefetchTaskSpec
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_kernels import WindowInstaller
from bsr_runtime.plan import Window, count_windows, plan_windows
from bsr_runtime.restore import MAX_WINDOW_CHUNKS, RestoreReport, RestoreRequest
from bsr_runtime.retrieve import request_block_ids
from bsr_runtime.window_loop import WindowFailed, WindowLoop

from .objects import LMCacheKeys, _owners, _runs

if TYPE_CHECKING:
    from .adapter import LMCacheAdapter


logger = init_logger(__name__)

# A window's prefetch is tagged "<request id>/bsr-w<index>" (the retrieve) or "bsr-w" (LMCacheTier.fetch).
# LMCache logs one INFO line per completed prefetch; a windowed restore would log N/W of them (2,047 at
# W = 1 for a 512K-token prefix). Below DEBUG they are dropped, and the retrieve logs one line of its
# own, as LMCache's whole-plan prefetch does (the tier's restores have their reports).
WINDOW_TAG = "bsr-w"
_WINDOW_ID = re.compile(r"(^|/)bsr-w\d*$")


class _WindowPrefetchLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, str) and _WINDOW_ID.search(a) for a in args)


def fold_window_lines() -> None:
    """Install the filter on LMCache's StorageManager logger, once per process (LMCacheAdapter does)."""
    sm_logger = logging.getLogger(StorageManager.__module__)
    if not any(isinstance(f, _WindowPrefetchLines) for f in sm_logger.filters):
        sm_logger.addFilter(_WindowPrefetchLines())


@dataclass
class LMCacheRestoreReport(RestoreReport):
    hit_chunks: int = 0  # chunks LMCache reported resident (all windows)
    l1_baseline_bytes: int = 0  # L1 used when the retrieve started
    l1_peak_bytes: int = 0  # peak L1 used during the retrieve
    l1_after_bytes: int = 0  # L1 used after it (== baseline unless a retaining policy kept keys at W = 0)
    l1_capacity_bytes: int = 0
    l1_object_bytes: int = 0  # bytes LMCache allocates per object: align_up(c, align_bytes)
    install_launches: int = 0
    l1_samples: int = 0
    invalid_block_ids: list[list[int]] = field(default_factory=list)  # per group, on failure
    force_local: bool = False


class L1WindowError(RuntimeError):
    """A window LMCache could not serve (or install from); the message is the report's error."""


def _label(index: int, first: int, n: int) -> str:
    return f"window {index} (chunks {first}..{first + n - 1})"


def release_result(sm: StorageManager, result, keys: list[ObjectKey], evict_loaded: bool) -> None:
    """Return a prefetch result's read locks (nothing was read) and, with `evict_loaded`, delete the
    keys it loaded from L2 (objects a retaining policy kept; temporary ones are gone already)."""
    hit_keys = [keys[i] for i in result.hit_cells[0].get_indices_list()]
    if hit_keys:
        sm.finish_read_prefetched(hit_keys, read_locks=1, l1_owners=_owners(result, hit_keys))
    if evict_loaded:
        evict_l2_loaded(sm, result, keys)


def evict_l2_loaded(sm: StorageManager, result, keys: list[ObjectKey]) -> None:
    loaded = [keys[i] for i in result.l2_hit_cells[0].get_indices_list()]
    if loaded:
        sm.delete_l1_keys(loaded)


class LatePrefetches:
    """Prefetches whose result did not come in time: collected when it lands (within 1 s on the
    calling thread, later on a reaper thread) and released, so nothing stays resident."""

    def __init__(self, sm: StorageManager, timeout_s: Callable[[], float]) -> None:
        self.sm, self._timeout_s = sm, timeout_s  # the adapter's prefetch timeout, read when needed
        self._reapers: list[threading.Thread] = []

    def wait(self, handle: PrefetchHandle, keys: list[ObjectKey], timeout_s: float):
        """The prefetch's result, or None after `timeout_s` (then settled late)."""
        if self.sm.wait_prefetch_status(handle, timeout_s):
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                return result
        self.settle(handle, keys)
        return None

    def settle(self, handle: PrefetchHandle, keys: list[ObjectKey]) -> None:
        def settle(wait_s: float) -> bool:
            if not self.sm.wait_prefetch_status(handle, wait_s):
                return False
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                release_result(self.sm, result, keys, evict_loaded=True)
            return True

        timeout_s = self._timeout_s()
        if settle(min(1.0, timeout_s)):
            return
        t = threading.Thread(target=settle, args=(max(60.0, 4 * timeout_s),),
                             name="bsr-lmcache-late-prefetch", daemon=True)
        t.start()
        self._reapers = [r for r in self._reapers if r.is_alive()] + [t]

    def join(self) -> None:
        for t in self._reapers:
            t.join(timeout=self._timeout_s())


_PREFETCHING, _LOCKED, _READING, _DONE = range(4)


class L1Source:
    """A retrieve's bytes from LMCache's L1, prefetched window by window (the loop's WindowSource).
    Making one starts nothing; `fetch` submits one window's prefetch."""

    def __init__(self, ad: LMCacheAdapter, keys: LMCacheKeys, request_id: str, *, evict_retained: bool,
                 synchronize: Callable[[], None], on_hits: Callable[[int], None]) -> None:
        self.ad, self.keys, self.request_id = ad, keys, request_id
        self.evict_retained, self.synchronize, self.on_hits = evict_retained, synchronize, on_hits

    def fetch(self, win: Window, reservation) -> L1RestoreStage:
        keys = self.keys.window(win.first_chunk, win.num_chunks)
        spec = PrefetchTaskSpec([GroupedObjectKeys(keys, 0, self.ad.layout)], num_kv_readers=1,
                                fetching_policy="prefix")
        handle = self.ad.sm.submit_prefetch_task(spec, external_request_id=f"{self.request_id}/{WINDOW_TAG}{win.index}")
        return L1RestoreStage(self, win, keys, handle)


class L1RestoreStage:
    """A restore window prefetched by LMCache into its L1 (the window loop's FetchedWindow).

    States: prefetching (the task is LMCache's) -> locked (its result taken: every hit read-locked)
    -> reading (inside `read_prefetched_results`: the L1 objects are installed from) -> done."""

    def __init__(self, source: L1Source, win: Window, keys: list[ObjectKey], handle: PrefetchHandle) -> None:
        ad = source.ad
        self.sm, self.late, self.tracker = ad.sm, ad.late, ad.tracker
        self.chunk_bytes, self.object_bytes = ad.reg.chunk_bytes, ad.l1_object_bytes
        self.timeout_s = ad.config.prefetch_timeout_s
        self.index, self.label = win.index, _label(win.index, win.first_chunk, win.num_chunks)
        self.first, self.keys, self.handle = win.first_chunk, keys, handle
        self.evict_retained, self._sync, self.on_hits = source.evict_retained, source.synchronize, source.on_hits
        self.result = self.owners = self._read = None
        self._state = _PREFETCHING

    def require_complete(self) -> list[tuple[int, int, torch.Tensor]]:
        n = len(self.keys)
        ok = self.sm.wait_prefetch_status(self.handle, self.timeout_s)
        result = self.sm.query_prefetch_status(self.handle) if ok else None
        self.tracker.sample()
        if result is None:
            raise L1WindowError(f"{self.label}: prefetch not complete within {self.timeout_s}s")
        self.result, self._state = result, _LOCKED
        hit = result.hit_cells[0].get_indices_list()
        self.on_hits(len(hit))
        if len(hit) != n:
            missing = next(i for i in range(n) if i >= len(hit) or hit[i] != i)
            raise L1WindowError(
                f"{self.label}: LMCache holds {len(hit)}/{n} chunks; chunk {self.first + missing} is not "
                "resident (missing in L1 and L2, or L1 had no room)"
            )
        self.owners = _owners(result, self.keys)
        read = self.sm.read_prefetched_results(self.keys, self.owners)
        objs = read.__enter__()  # raising here (before it yields): the read locks are still ours
        self._read, self._state = read, _READING
        if objs is None:
            raise L1WindowError(f"window {self.index}: prefetched objects not readable in L1")
        try:
            return list(_runs(objs, self.chunk_bytes, self.object_bytes))
        except Exception as e:
            raise L1WindowError(f"{self.label}: install failed: {type(e).__name__}: {e}") from e

    def synchronize(self, stream) -> None:
        self._sync()  # installs from L1 are synchronized device-wide (or on the adapter's stream)

    def release(self) -> None:
        """The window is installed: leave the read context normally (the read locks are then ours to
        return), finish the read (frees temporary objects), evict retained L2-loaded keys."""
        if self._state != _READING:
            return
        self._state = _DONE
        self._read.__exit__(None, None, None)
        self.sm.finish_read_prefetched(self.keys, read_locks=1, l1_owners=self.owners)
        if self.evict_retained:
            evict_l2_loaded(self.sm, self.result, self.keys)

    def abandon(self, stream) -> None:
        """Failure: release everything the window holds, so L1 usage returns to its baseline."""
        state, self._state = self._state, _DONE
        if state == _PREFETCHING:  # still LMCache's: released whenever its result lands
            self.late.settle(self.handle, self.keys)
        elif state == _LOCKED:
            release_result(self.sm, self.result, self.keys, evict_loaded=True)
        elif state == _READING:
            try:
                self._sync()  # an install may have been launched on the L1 objects
            finally:
                # read_prefetched_results returns the read locks itself when it yielded None or the
                # body raised: leave it with an exception, then drop what the window loaded
                err = L1WindowError(f"{self.label} abandoned")
                try:
                    self._read.__exit__(L1WindowError, err, None)
                finally:
                    evict_l2_loaded(self.sm, self.result, self.keys)  # a failed window leaves nothing behind


def retrieve(ad: LMCacheAdapter, req: RestoreRequest, num_chunks: int, window_chunks: int | None = None,
             admission_timeout_s: float | None = None) -> LMCacheRestoreReport:
    """LMCacheAdapter.retrieve: chunks 0..num_chunks-1 of `req` through the window loop."""
    reg, cfg = ad.reg, ad.config
    w = cfg.window_chunks if window_chunks is None else int(window_chunks)
    if not 0 <= w <= MAX_WINDOW_CHUNKS:
        raise ValueError(f"window_chunks (W) must be in [0, {MAX_WINDOW_CHUNKS}], got {w}")
    if num_chunks < 0 or num_chunks * reg.chunk_tokens > len(req.tokens):
        raise ValueError(f"confirmed prefix of {num_chunks} chunks exceeds the request's {len(req.tokens)} tokens")
    keys = ad.keys(req.keyspace, req.tokens)
    # destinations, tables and fingerprint checked once, before any byte moves; each run of L1
    # objects then only has its staging and chunk range checked (not a descriptor table per run)
    installer = WindowInstaller(reg, req.kv, req.block_tables, num_chunks, backend=cfg.install_backend,
                                stream=ad.stream, fingerprint=reg.fingerprint)
    kv = installer.kv
    rep = _new_report(ad, req, num_chunks, w)
    loop = WindowLoop(ad.admission, reg.chunk_bytes, ad.stream, admission_timeout_s=admission_timeout_s)

    def on_hits(n: int) -> None:
        rep.hit_chunks += n

    evict_retained = cfg.evict_retained and w > 0 and not ad.l2_loads_are_temporary

    source = L1Source(ad, keys, req.request_id, evict_retained=evict_retained,
                      synchronize=lambda: ad.synchronize(kv), on_hits=on_hits)

    def install(view: torch.Tensor, first: int, count: int) -> str | None:
        try:
            return installer.install(view, first, count)
        except Exception as e:
            index = first // w if w else 0  # plan_windows at depth 1: window i starts at chunk i*W
            raise L1WindowError(f"{_label(index, index * w, min(w or num_chunks, num_chunks - index * w))}: "
                                f"install failed: {type(e).__name__}: {e}") from e

    t0 = time.perf_counter()
    measure = ad.tracker.start()
    rep.l1_baseline_bytes = measure.baseline
    try:
        with ad.admission.admitted(admission_timeout_s):
            loop.restore(plan_windows(num_chunks, w), source, install)
        rep.ok = True
        rep.committed_tokens = num_chunks * reg.chunk_tokens
    except Exception as e:  # noqa: BLE001 - any failure fails the request closed
        cause = e.cause if isinstance(e, WindowFailed) else e
        rep.error = str(cause) if isinstance(cause, L1WindowError) else f"{type(cause).__name__}: {cause}"
        rep.failed_window = loop.stats.windows_done if loop.stats.failed_window is None else loop.stats.failed_window
    finally:
        ad.tracker.stop(measure)
        _copy_stats(rep, loop, measure, ad.tracker.used(), t0)
    if not rep.ok:
        fail_closed(ad, req, rep)
    _log(rep)
    return rep


def _log(rep: LMCacheRestoreReport) -> None:
    where = f"W={rep.window_chunks}, {rep.windows_installed}/{rep.windows} windows" if rep.window_chunks else \
        "whole plan (W=0)"
    if rep.ok:
        logger.info("BSR retrieve %s: %d chunks (%d hit) in %.1f ms, %s, L1 peak +%d B",
                    rep.request_id, rep.num_chunks, rep.hit_chunks, rep.total_s * 1e3, where, rep.peak_staging_bytes)
    else:
        logger.warning("BSR retrieve %s failed closed after %.1f ms, %s: %s", rep.request_id, rep.total_s * 1e3,
                       where, rep.error)


def _new_report(ad: LMCacheAdapter, req: RestoreRequest, num_chunks: int, w: int) -> LMCacheRestoreReport:
    tier = ad.tier_name()
    return LMCacheRestoreReport(
        request_id=req.request_id, tier=tier, ok=False, num_chunks=num_chunks, committed_tokens=0,
        window_chunks=w, pipeline_depth=1, windows=count_windows(num_chunks, w), windows_installed=0,
        chunk_bytes=ad.reg.chunk_bytes, bytes_moved=0, peak_staging_bytes=0, tiers_tried=[tier],
        l1_capacity_bytes=int(ad.sm.get_l1_usage()[1]), l1_object_bytes=ad.l1_object_bytes,
    )


def _copy_stats(rep: LMCacheRestoreReport, loop: WindowLoop, measure, l1_after: int, t0: float) -> None:
    s = loop.stats
    rep.fetch_s, rep.install_s, rep.sync_s = s.fetch_s, s.install_s, s.sync_s
    rep.windows_installed, rep.bytes_moved = s.windows_done, s.chunks_done * rep.chunk_bytes
    rep.install_launches, rep.backend = s.launches, s.backend
    rep.l1_peak_bytes, rep.peak_staging_bytes = measure.peak, measure.peak - measure.baseline
    rep.l1_after_bytes, rep.l1_samples = l1_after, measure.samples
    rep.total_s = time.perf_counter() - t0


def fail_closed(ad: LMCacheAdapter, req: RestoreRequest, rep: LMCacheRestoreReport) -> None:
    """Every destination block the retrieve could have written is invalid, nothing is committed,
    the request prefills locally (force-local marker)."""
    rep.committed_tokens = 0
    rep.force_local = True
    rep.invalid_block_ids = [sorted(ids) for ids in request_block_ids(ad.reg, req.block_tables, rep.num_chunks)]
    ad.force_local.add(req.request_id)
    if ad.markers is not None:
        ad.markers.set(req.request_id, rep.error or "LMCache retrieve failed")

