"""The probe-only lookup of BSR's LMCache server module (the paper's `probe_only`).

LMCache's stock LOOKUP submits one prefetch of the whole hit: it read-locks every L1 hit, loads
every L2 hit into L1 and keeps them locked until RETRIEVE (probing makes the hit set resident, and
the L1 must hold the whole prefix). This module's LOOKUP is a decision, not residency:

    presence per (object group, kv rank) row and chunk: L1 (a prefetch served from L1 only, taking
    no lock) | every L2 adapter (lookup-and-lock, every found key unlocked at once)
    -> the model-wide hit length (every row servable under its attention window)
    -> answered by QUERY_PREFETCH_STATUS / WAIT_PREFETCH_STATUS; nothing reserved, nothing locked

The handlers the stock client relies on stay consistent with "nothing held": the prefetch status
is answered exactly once, FREE_LOOKUP_LOCKS releases nothing (there is nothing to release),
END_SESSION is LMCache's own (plus dropping the request's force-local marker). A request whose
retrieve failed carries a force-local marker: its next lookup answers 0, so it prefills locally
instead of trying the same objects again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from lmcache.logging import init_logger
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    PrefetchLockMode,
    PrefetchTaskSpec,
    ipc_key_to_grouped_object_keys,
)
from lmcache.v1.mp_observability.event import Event, EventType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
from lmcache.v1.multiprocess.modules.lookup import LookupModule
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler

from ...markers import ForceLocalMarkers
from .probe import L2Lookups
from .server_stats import ServerStats

logger = init_logger(__name__)


def servable_length(rows: Sequence[Sequence[bool]], windows: Sequence[int]) -> int:
    """The longest prefix (in chunks) every row can serve: a full-attention row (window < 1) needs
    every chunk of it present, a sliding-window row of w chunks its last min(w, L) chunks
    (LMCache's fold rule, lmcache.v1.distributed.bitmap_ops.fold)."""
    if not rows:
        return 0
    n = len(rows[0])
    for length in range(n, 0, -1):
        if all(all(row[max(0, length - w) if w >= 1 else 0:length]) for row, w in zip(rows, windows)):
            return length
    return 0


class ProbeLookupModule:
    """LOOKUP, QUERY/WAIT_PREFETCH_STATUS, FREE_LOOKUP_LOCKS and END_SESSION of the module; the
    handlers replace LMCache's LookupModule's (same names and signatures; the server's ZMQ
    transport keeps the last handler registered per operation, and plugin modules come last)."""

    def __init__(self, ctx: MPCacheServerContext, stock: LookupModule, markers: ForceLocalMarkers,
                 stats: ServerStats, probe_timeout_s: float) -> None:
        self._ctx, self._stock, self._markers, self._stats = ctx, stock, markers, stats
        self._probe_timeout_s = probe_timeout_s
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()
        self._l2 = L2Lookups(ctx.storage_manager, None, probe_timeout_s)

    @property
    def context(self) -> MPCacheServerContext:
        return self._ctx

    def report_status(self) -> dict:
        return {"bsr_probe_lookups_pending": len(self._hits)}

    def close(self) -> None:
        self._l2.unlock_orphans(wait_s=min(1.0, self._probe_timeout_s))

    # -- handlers ---------------------------------------------------------------------------
    @request_handler(HandlerType.BLOCKING)
    def lookup(self, key: IPCCacheServerKey, tp_size: int) -> None:
        """Probe the request's prefix; its hit length is answered by the prefetch status."""
        self._publish(EventType.MP_REQUEST_START, key.request_id)
        self._publish(EventType.MP_LOOKUP_PREFETCH_START, key.request_id)
        t0 = time.perf_counter()
        try:
            hit, result = self._decide(key)
        except Exception:  # noqa: BLE001 - a failed probe is a miss: the request prefills locally
            logger.exception("BSR probe of request %s failed; answering 0", key.request_id)
            hit, result = 0, "miss"
        self._stats.lookup_answered(result)
        logger.info("BSR probe of request %s: %d chunks hit (%s) in %.3f seconds, nothing held", key.request_id, hit,
                    result, time.perf_counter() - t0)
        with self._lock:
            self._hits[key.request_id] = hit

    @request_handler(HandlerType.BLOCKING)
    def query_prefetch_status(self, request_id: str) -> int | None:
        """The probe's hit length, once (LMCache's exactly-once semantics); 0 when unknown."""
        with self._lock:
            return self._hits.pop(request_id, 0)

    @request_handler(HandlerType.BLOCKING)
    def wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        """The probe answered during LOOKUP already: nothing to wait for."""
        return self.query_prefetch_status(request_id)

    @request_handler(HandlerType.BLOCKING)
    def free_lookup_locks(self, key: IPCCacheServerKey, tp_size: int) -> None:
        """A probe holds nothing, so there is nothing to release."""
        return None

    @request_handler(HandlerType.BLOCKING)
    def end_session(self, request_id: str) -> None:
        """LMCache's own END_SESSION, and the request's force-local marker dropped."""
        self._markers.clear_on_teardown(request_id)
        with self._lock:
            self._hits.pop(request_id, None)
        self._stock.end_session(request_id)

    # -- the probe ----------------------------------------------------------------------------
    def _decide(self, key: IPCCacheServerKey) -> tuple[int, str]:
        if self._markers.is_set(key.request_id):
            return 0, "force_local"
        rows = self._rows(key)
        if not rows:
            return 0, "miss"
        present = self._presence(rows)
        hit = servable_length(present, [row.sliding_window_size for row in rows])
        self._record(key, hit)
        self._publish_hit(key, hit, len(rows[0].keys))
        return hit, "hit" if hit else "miss"

    def _rows(self, key: IPCCacheServerKey) -> list[GroupedObjectKeys]:
        """One row of object keys per (object group, kv rank), as LMCache's lookup builds them; the
        session records the lookup so LMCache's END_SESSION and key resolution find it."""
        ctx = self._ctx
        registry = ctx.layout_desc_registry
        if registry.find(key.model_name, key.world_size) is None:
            logger.error("BSR probe: no KV cache registered for model %s world size %d", key.model_name,
                         key.world_size)
            return []
        hashes = ctx.token_hasher.compute_chunk_hashes(list(key.token_ids), end=key.end)
        layouts = registry.find_group_layout_descs(key.model_name, key.world_size)
        if not hashes or not layouts:
            return []
        attn = registry.find_attn_desc(key.model_name, key.world_size)
        session = ctx.session_manager.get_or_create(key.request_id)
        session.set_tokens(list(key.token_ids))
        session.begin_lookup(key, tuple(attn.num_chunks_in_sw))
        return ipc_key_to_grouped_object_keys(key, hashes, list(range(attn.num_object_groups)), layouts, attn)

    def _presence(self, rows: list[GroupedObjectKeys]) -> list[list[bool]]:
        """Per row and chunk: held by L1 or by any L2 adapter. No lock survives the call."""
        present = [self._in_l1(row) for row in rows]
        for row, here in zip(rows, present):
            missing = [i for i, p in enumerate(here) if not p]
            if not missing:
                continue
            keys = [row.keys[i] for i in missing]
            hits, errors = self._l2.lookup(keys, {row.object_group_id: row.layout_desc})
            for message in errors:
                logger.warning("BSR probe: %s", message)
            for hit in hits.values():
                for j, found in enumerate(hit):
                    if found:
                        here[missing[j]] = True
        return present

    def _in_l1(self, row: GroupedObjectKeys) -> list[bool]:
        """Which keys of the row L1 holds: LMCache's prefetch served from L1 only, on this thread,
        taking no lock (NO_LOCK; policy "full" over one row reports every present key)."""
        spec = PrefetchTaskSpec([row], fetching_policy="full", lock_mode=PrefetchLockMode.NO_LOCK)
        sm = self._ctx.storage_manager
        handle = sm.submit_prefetch_task(spec, external_request_id="bsr-probe", skip_l2=True)
        result = sm.query_prefetch_status(handle)
        here = [False] * len(row.keys)
        if result is not None and result.hit_cells:
            for i in result.hit_cells[0].get_indices_list():
                here[i] = True
        return here

    def _record(self, key: IPCCacheServerKey, hit: int) -> None:
        """The lookup's result on the session: its hit length, no group locked, no L1 owner."""
        self._ctx.session_manager.get_or_create(key.request_id).record_prefetch_result(hit, (), None)

    def _publish_hit(self, key: IPCCacheServerKey, hit: int, requested: int) -> None:
        """LMCache's lookup event, so its hit-rate metrics count BSR's lookups too (the probe does
        not tell L1 from L2 hits: they are counted as L2's)."""
        chunk = self._ctx.chunk_size
        self._ctx.event_bus.publish(Event(
            event_type=EventType.MP_LOOKUP_PREFETCH_END, session_id=key.request_id,
            metadata={"found_count": hit, "requested_tokens": requested * chunk, "hit_tokens": hit * chunk,
                      "l1_hit_tokens": 0, "l2_hit_tokens": hit * chunk, "l1_hit_keys": 0, "l2_hit_keys": 0,
                      "early_exit_reason": "", "model_name": key.model_name, "cache_salt": key.cache_salt}))

    def _publish(self, event_type: EventType, request_id: str) -> None:
        self._ctx.event_bus.publish(Event(event_type=event_type, session_id=request_id))
