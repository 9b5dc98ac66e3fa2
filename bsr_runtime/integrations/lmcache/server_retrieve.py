"""The windowed RETRIEVE of BSR's LMCache server module (lmcache_driven transfer: the server copies).

LMCache's stock RETRIEVE copies the objects its LOOKUP locked, the whole prefix at once. Here the
lookup locked nothing (server_lookup.py), and RETRIEVE runs BSR's one window loop
(bsr_runtime/window_loop.py) over the request's range, W chunks at a time:

    per window G_j: prefetch its objects into L1 (one LMCache prefetch per object group)
      -> require complete (every key by the fetch's deadline, read from L1)
      -> map onto the window's block slice (each group's block ids cut to the window's chunks)
      -> transfer (LMCache's own copy, transfer_kv_per_object_group)
      -> synchronize (the stream the copies ran on) -> release (read locks returned, the objects the
         prefetch loaded from L2 deleted from L1) -> advance

so the L1 a restore holds is at most W chunks' objects whatever the prefix length (depth 2: window
j+1 prefetched while window j is copied, both of W chunks: at most 2W, the paper's RWS at depth 2).
Fail closed: a missing, late or damaged object or a transfer error fails the
whole retrieve (every window held is abandoned, nothing stays locked); vLLM's connector then
reports every block of the request invalid and recomputes (kv_load_failure_policy "recompute"),
and the request's force-local marker makes its next lookup answer 0. With several object groups
(hybrid models) one failed group fails the retrieve, so the whole prefix collapses; TP ranks retrieve
separately and vLLM fails the request when any rank's retrieve failed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import lmcache.lmcache_native as lmcache_native
from lmcache import torch_dev
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import LMCacheDrivenTransferModule, get_layout_desc
from lmcache.v1.multiprocess.native_completion import submit_callback_to_stream
from lmcache.v1.multiprocess.object_group_transfer import (
    downsample_and_stage_block_ids,
    transfer_kv_per_object_group,
)
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler
from lmcache.v1.platform.stream import synchronize_stream

from bsr_kernels.staging_arena import StagingWaitTimeout

from ...markers import ForceLocalMarkers
from ...plan import Window, plan_windows
from ...tiers.base import CorruptObjectError, FetchTimeoutError, MissingObjectError
from ...window_loop import WindowFailed, WindowLoop
from .prefetch import LatePrefetches, evict_l2_loaded, release_result
from .server_stats import ServerStats

logger = init_logger(__name__)

_PREFETCHING, _LOCKED, _READING, _DONE = range(4)


@dataclass(frozen=True)
class GroupPlan:
    """One object group of a retrieve: its keys over the request's range, the first chunk it
    retains (a sliding-window group only its trailing window), its layout and kernel groups."""

    group: int
    keys: list[ObjectKey]
    first: int
    layout: MemoryLayoutDesc
    kernel_groups: tuple[int, ...]


@dataclass
class RetrievePlan:
    """What a retrieve's windows need: the groups, the engine's (downsampled) block ids per kernel
    group, the blocks each kernel group has per chunk, and the tokens the engine holds already."""

    cache_context: Any
    groups: list[GroupPlan]
    block_ids: list[list[int]]
    blocks_per_chunk: list[int]
    skip_first_n_tokens: int
    chunk_tokens: int
    transfer_key: str


@dataclass
class _Part:
    """One object group's share of a window: one LMCache prefetch of chunks first..first+len-1."""

    plan: GroupPlan
    first: int
    keys: list[ObjectKey]
    handle: Any
    result: Any = None
    owners: dict | None = None
    read: Any = None
    objects: list = field(default_factory=list)
    state: int = _PREFETCHING


class ServerWindow:
    """One window prefetched into LMCache's L1 (the loop's SubmittedWindow): its parts' objects are
    read-locked from fetched to release; `abandon` returns everything on a failure path."""

    def __init__(self, source: ServerL1Source, window: Window, parts: list[_Part], deadline: float) -> None:
        self.source, self.window, self.parts, self.deadline = source, window, parts, deadline
        self.sm = source.sm
        self._held = 0

    def fetched(self) -> list[tuple[int, int, ServerWindow]]:
        """Every key of every part in L1 and read; the loop's single run is the window itself (its
        objects are LMCache MemoryObjs, copied by LMCache's transfer, not a staged tensor)."""
        for part in self.parts:
            self._complete(part)
        return [(0, self.window.num_chunks, self)]

    def _complete(self, part: _Part) -> None:
        n = len(part.keys)
        left = max(0.001, self.deadline - time.monotonic())
        result = self.source.late.wait(part.handle, part.keys, left)
        if result is None:  # released by LatePrefetches when it lands
            part.state = _DONE
            raise FetchTimeoutError(f"LMCache prefetch of {n} objects of group {part.plan.group} missed its deadline")
        part.result, part.state = result, _LOCKED
        hit = result.hit_cells[0].get_indices_list() if result.hit_cells else []
        if len(hit) != n:
            raise MissingObjectError(f"LMCache holds {len(hit)}/{n} objects of group {part.plan.group} from chunk "
                                     f"{part.first} (missing in L1 and L2, damaged, or L1 had no room)")
        part.owners = _owners(result, part.keys)
        part.read = self.sm.read_prefetched_results(part.keys, part.owners)
        objects = part.read.__enter__()  # raising here: the read locks are still ours (_LOCKED)
        part.state = _READING
        if objects is None or len(objects) != n:
            raise CorruptObjectError(f"LMCache: prefetched objects of group {part.plan.group} not readable in L1")
        part.objects = list(objects)

    def synchronize(self, stream) -> None:
        """The copies read L1 memory: wait for them before the objects are unlocked."""
        cc = self.source.plan.cache_context
        synchronize_stream(cc.device, cc.stream)

    def release(self) -> None:
        """Transferred and synchronized: leave the reads, return the locks, delete what the prefetch
        loaded from L2 (a retaining prefetch policy would keep it: the bound is W objects)."""
        try:
            for part in self.parts:
                if part.state != _READING:
                    continue
                part.state = _DONE
                part.read.__exit__(None, None, None)
                self.sm.finish_read_prefetched(part.keys, read_locks=1, l1_owners=part.owners)
                evict_l2_loaded(self.sm, part.result, part.keys)
        finally:
            self._unhold()

    def abandon(self, stream) -> None:
        """Failure: synchronize what may read the objects, release every part, whatever its state."""
        try:
            with contextlib.suppress(Exception):
                self.synchronize(stream)
            for part in self.parts:
                with contextlib.suppress(Exception):
                    self._abandon(part)
        finally:
            self._unhold()

    def _abandon(self, part: _Part) -> None:
        state, part.state = part.state, _DONE
        if state == _PREFETCHING:  # still LMCache's: released whenever its result lands
            self.source.late.settle(part.handle, part.keys)
        elif state == _LOCKED:
            release_result(self.sm, part.result, part.keys, evict_loaded=True)
        elif state == _READING:
            # read_prefetched_results returns the read locks itself when the body raised
            err = CorruptObjectError("window abandoned")
            try:
                part.read.__exit__(CorruptObjectError, err, None)
            finally:
                evict_l2_loaded(self.sm, part.result, part.keys)

    def hold(self, objects: int) -> None:
        self._held += objects
        self.source.hold(objects)

    def _unhold(self) -> None:
        self.source.drop(self._held)
        self._held = 0


class ServerL1Source:
    """A retrieve's windows from LMCache's L1 (the loop's WindowSource): `fetch` submits one
    prefetch per object group of the window's chunks that group retains."""

    def __init__(self, sm: StorageManager, plan: RetrievePlan, late: LatePrefetches, timeout_s: float,
                 stats: ServerStats) -> None:
        self.sm, self.plan, self.late, self.timeout_s, self.stats = sm, plan, late, timeout_s, stats
        self.live_objects = 0
        self.peak_objects = 0

    def submit(self, window: Window, reservation=None) -> ServerWindow:
        staged = ServerWindow(self, window, [], time.monotonic() + self.timeout_s)
        end = window.first_chunk + window.num_chunks
        try:
            for group in self.plan.groups:
                first = max(window.first_chunk, group.first)
                if first >= end:
                    continue  # a sliding-window group retains none of this window's chunks
                keys = group.keys[first:end]
                spec = PrefetchTaskSpec([GroupedObjectKeys(keys, group.group, group.layout)], num_kv_readers=1)
                handle = self.sm.submit_prefetch_task(spec, external_request_id=f"bsr-w{window.index}")
                staged.parts.append(_Part(group, first, keys, handle))
                staged.hold(len(keys))  # the prefetch fills L1 with them from now until release
        except BaseException:
            staged.abandon(None)
            raise
        return staged

    def hold(self, objects: int) -> None:
        self.live_objects += objects
        self.peak_objects = max(self.peak_objects, self.live_objects)
        self.stats.hold(objects)

    def drop(self, objects: int) -> None:
        self.live_objects -= objects
        self.stats.drop(objects)


def transfer_window(plan: RetrievePlan, staged: ServerWindow, first_chunk: int, num_chunks: int) -> str:
    """Map the window onto its block slice and copy it in with LMCache's own transfer: per object
    group, its objects and the block ids of the chunks it retains in this window."""
    cc = plan.cache_context
    for part in staged.parts:
        count = len(part.objects)
        sliced: list[list[int]] = [[] for _ in plan.block_ids]
        for kg in part.plan.kernel_groups:
            bpc = plan.blocks_per_chunk[kg]
            sliced[kg] = plan.block_ids[kg][part.first * bpc:(part.first + count) * bpc]
        staged_ids = cc.stage_block_ids(sliced)
        skip = max(0, plan.skip_first_n_tokens - part.first * plan.chunk_tokens)
        transfer_kv_per_object_group(cc, staged_ids, part.objects, object_group_id=part.plan.group,
                                     batch_size=cc.max_batch_size, skip_first_n_tokens=skip,
                                     direction=lmcache_native.TransferDirection.H2D,
                                     transfer_key=plan.transfer_key, block_ids_host=sliced)
    return "lmcache"


def failure_cause(e: BaseException) -> str:
    """The cause label of a failed retrieve (server_stats.CAUSES)."""
    cause = e.cause if isinstance(e, WindowFailed) else e
    if isinstance(cause, MissingObjectError):
        return "missing"
    if isinstance(cause, FetchTimeoutError):
        return "late"
    if isinstance(cause, CorruptObjectError):
        return "damaged"
    if isinstance(e, WindowFailed):
        return "transfer"
    return "other"


def _owners(result, keys: list[ObjectKey]) -> dict | None:
    owners = getattr(result, "l1_owners", None)
    if not owners:
        return None
    return {k: owners[k] for k in keys if k in owners} or None


class WindowedRetrieveModule:
    """RETRIEVE of the module (lmcache_driven): replaces LMCacheDrivenTransferModule.retrieve (same
    name, signature and scheduling: blocking, per-client affinity); registration, store and the
    worker bookkeeping stay LMCache's (`stock`)."""

    def __init__(self, ctx: MPCacheServerContext, stock: LMCacheDrivenTransferModule, markers: ForceLocalMarkers,
                 stats: ServerStats, window_chunks: int, depth: int, fetch_timeout_s: float,
                 admission_timeout_s: float = 120.0) -> None:
        self._ctx, self._stock, self._markers, self._stats = ctx, stock, markers, stats
        self.window_chunks, self.depth, self.fetch_timeout_s = window_chunks, depth, fetch_timeout_s
        self.admission_timeout_s = admission_timeout_s
        self._late = LatePrefetches(ctx.storage_manager, lambda: fetch_timeout_s)
        # one restore at a time in the server: the L1 all restores hold is at most W chunks' objects
        self._serial = threading.Lock()

    @property
    def context(self) -> MPCacheServerContext:
        return self._ctx

    def report_status(self) -> dict:
        return {"bsr_server_module": {"window_chunks": self.window_chunks, "pipeline_depth": self.depth,
                                      **self._stats.snapshot()}}

    def close(self) -> None:
        self._late.join()

    @request_handler(HandlerType.BLOCKING, requires_client_affinity=True)
    def retrieve(self, key: IPCCacheServerKey, instance_id: int, gpu_block_ids: list[list[int]],
                 event_ipc_handle: bytes, skip_first_n_tokens: int = 0) -> tuple[bytes, bool]:
        """Copy the request's range into the engine's blocks window by window; (completion event,
        success). Never raises: a handler that raises leaves the client waiting for its timeout."""
        entry = self._stock.get_and_touch_context_entry(instance_id)
        if entry is None:
            logger.warning("BSR retrieve: unregistered instance %d; failing request %s", instance_id,
                           key.request_id)
            self._failed(key, "unregistered", 0)
            return b"", False
        cc, backend = entry.cache_context, entry.event_backend
        if backend is None:
            self._failed(key, "unregistered", 0)
            return b"", False
        with torch_dev.device(cc.device), torch_dev.stream(cc.stream):
            event = backend.create_event(cc.device)
            try:
                ok = self._retrieve(key, entry, instance_id, gpu_block_ids, event_ipc_handle, skip_first_n_tokens)
            except Exception as e:  # noqa: BLE001 - fail closed, never leave the client waiting
                logger.exception("BSR retrieve of request %s failed", key.request_id)
                self._failed(key, "other", 0)
                ok = False
                del e
            finally:
                backend.record_event(event, cc.stream)
        return backend.export_event(event, cc.device), ok

    def _retrieve(self, key: IPCCacheServerKey, entry, instance_id: int, gpu_block_ids: list[list[int]],
                  event_ipc_handle: bytes, skip_first_n_tokens: int) -> bool:
        t0 = time.perf_counter()
        cc = entry.cache_context
        plan = self._plan(key, cc, gpu_block_ids, skip_first_n_tokens)
        if plan is None:
            self._failed(key, "block_ids", 0)
            return False
        self._wait_for_producer(entry, instance_id, event_ipc_handle)
        num_chunks = len(plan.groups[0].keys) if plan.groups else 0
        source = ServerL1Source(self._ctx.storage_manager, plan, self._late, self.fetch_timeout_s, self._stats)
        # no staging of BSR's: the windows are installed from the objects L1 holds, which the source pins
        loop = WindowLoop(None, stream=cc.stream, depth=self.depth)
        try:
            if not self._serial.acquire(timeout=self.admission_timeout_s):
                raise StagingWaitTimeout(f"retrieve not admitted within {self.admission_timeout_s}s")
            try:
                loop.restore(plan_windows(num_chunks, self.window_chunks * self.depth, self.depth), source,
                             lambda staged, first, n: transfer_window(plan, staged, first, n))
            finally:
                self._serial.release()
        except Exception as e:  # noqa: BLE001 - every failure fails the retrieve closed
            cause = failure_cause(e)
            logger.warning("BSR retrieve of request %s failed closed (%s): %s", key.request_id, cause, e)
            self._failed(key, cause, source.peak_objects)
            return False
        finally:
            self._stats.windows_done(loop.stats.windows_done, loop.stats.chunks_done)
        self._stats.restore_done(source.peak_objects, None)
        st = loop.stats
        logger.info("BSR retrieved %d tokens in %.3f seconds (%d windows of at most %d chunks, peak %d L1 objects; "
                    "seconds in submit %.3f, fetch %.3f, transfer %.3f, synchronize+release %.3f)",
                    num_chunks * self._ctx.chunk_size, time.perf_counter() - t0, st.windows_done,
                    self.window_chunks, source.peak_objects, st.submit_s, st.fetch_s, st.install_s, st.sync_s)
        return True

    def _plan(self, key: IPCCacheServerKey, cc, gpu_block_ids: list[list[int]],
              skip_first_n_tokens: int) -> RetrievePlan | None:
        """The retrieve's groups and block ids, as LMCache's RETRIEVE resolves them; None when the
        engine sent fewer block ids than the range needs (a copy would write out of bounds)."""
        manager = cc.kv_layer_groups_manager
        num_groups = manager.num_object_groups
        keys = self._ctx.resolve_obj_keys(key, list(range(num_groups)))
        num_chunks = len(keys[0])
        chunk = self._ctx.chunk_size
        blocks_per_chunk = [cc.calculate_num_blocks(chunk, kg) for kg in range(manager.num_kernel_groups)]
        if any(len(ids) < num_chunks * bpc for ids, bpc in zip(gpu_block_ids, blocks_per_chunk, strict=True)):
            logger.error("BSR retrieve: block id underflow for request %s", key.request_id)
            return None
        block_ids = [list(ids[:num_chunks * bpc]) for ids, bpc in zip(gpu_block_ids, blocks_per_chunk)]
        downsample_and_stage_block_ids(cc, block_ids)  # cuts each chunk's blocks to those kept, in place
        kept = [len(ids) // num_chunks if num_chunks else 0 for ids in block_ids]
        attn = manager.get_attn_desc()
        groups = []
        for g in range(num_groups):
            if attn.group_kinds and attn.group_kinds[g] == "aux":
                continue  # connector-private groups are never served by a retrieve (as LMCache's)
            window = attn.num_chunks_in_sw[g]
            first = 0 if window < 0 else max(0, num_chunks - window)
            groups.append(GroupPlan(g, keys[g], first, get_layout_desc(cc, self._ctx.chunk_size, g),
                                    tuple(manager.object_groups[g].kernel_group_indices)))
        return RetrievePlan(cc, groups, block_ids, kept, skip_first_n_tokens, self._ctx.chunk_size,
                            transfer_key=f"bsr-{key.request_id}")

    def _wait_for_producer(self, entry, instance_id: int, event_ipc_handle: bytes) -> None:
        """The copies wait for the engine's event (its blocks are ready), as LMCache's RETRIEVE does."""
        cc, backend = entry.cache_context, entry.event_backend
        producer = backend.import_event(event_ipc_handle, cc.device)
        backend.wait_event(producer, cc.stream)
        token = cc.hold_imported_event(producer)
        submit_callback_to_stream(cc.cupy_stream, "release_imported_event", (instance_id, token))

    def _failed(self, key: IPCCacheServerKey, cause: str, peak: int) -> None:
        """Fail closed: the force-local marker, the failure counted. The engine recomputes every block."""
        self._markers.set(key.request_id, "retrieve failed")
        self._stats.restore_done(peak, cause)

