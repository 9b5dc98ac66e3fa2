"""Scheduler side: probe, allocate-time load records, save triggers, force-local markers.

One core `bsr_runtime.connector.BSRConnector` with no destination tensors; it probes every TP
rank's keys (`probe_all_ranks`), so N is the prefix every rank holds. Per step it ships the
recorded loads and the saves that became due to the workers (BSRConnectorMetadata).

Markers: a load whose blocks come back invalid (update_connector_output) sets the request's
force-local marker; while it holds, get_num_new_matched_tokens answers 0 without a lookup. The
marker is cleared when the request is next scheduled (admitted RUNNING: it prefills locally)
or torn down.

Saves: every request is tracked from admission; in each step whose scheduled tokens complete
prompt chunks, a SaveSpec for those chunks goes out and the worker stores them after the forward
pass (while every group's blocks of those tokens are resident: vLLM frees sliding-window blocks
once they leave the window). A request whose load failed is saved again as it is recomputed,
rewriting every chunk.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...connector import BSRConnector as CoreConnector
from ...connector import request_salt
from ...restore import RestoreConfig
from ...tiers.base import Tier
from .config import ConnectorConfig, write_report
from .metadata import BSRConnectorMetadata, SaveSpec
from .registration import block_lists

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    tokens: list[int]
    num_chunks: int  # complete prompt chunks
    salt: str
    computed: int = 0
    saved_chunks: int = 0  # chunks 0..saved_chunks-1 went out in SaveSpecs
    overwrite: bool = False


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, reg, tiers: list[Tier], model: str, tp_world: int,
                 block_ids_of: Callable[[str], object]) -> None:
        self.cfg = cfg
        self.reg = reg
        self.block_ids_of = block_ids_of  # request id -> its current block ids per group (vLLM's)
        self.load_async = cfg.load_async(reg.num_groups)
        restore = cfg.restore_config(tiers)
        # the scheduler never restores: W = 0 keeps the restorer from allocating a staging pool
        self.core = CoreConnector(reg, tiers, config=RestoreConfig(0, backend=cfg.backend), tp_rank=0,
                                  tp_world=tp_world, salt=cfg.salt, model=model, probe_all_ranks=True)
        self.restore_config = restore
        self.inflight: dict[str, set[int]] = {}  # request -> blocks of its load (until it finishes)
        self._tracked: dict[str, _Tracked] = {}
        # the latest (event, request id): probe, skip, load, marker_set, marker_cleared (tests, logs)
        self.events: deque[tuple[str, str]] = deque(maxlen=4096)

    # -- admission -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        skipped = self.core.stats.skipped_by_marker
        n, load_async = self.core.get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        self.events.append(("skip" if self.core.stats.skipped_by_marker > skipped else "probe", rid))
        return n, bool(n) and (load_async or self.load_async)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.core.update_state_after_alloc(request, block_lists(blocks), num_external_tokens)
        rid = request.request_id
        if self.cfg.save_tiers and rid not in self._tracked:
            tokens = list(request.prompt_token_ids or ())
            n = len(tokens) // self.reg.chunk_tokens
            if n > 0:
                self._tracked[rid] = _Tracked(tokens[: n * self.reg.chunk_tokens], n,
                                              request_salt(self.cfg.salt, request))

    # -- per step --------------------------------------------------------------------------
    def build_connector_meta(self, so) -> BSRConnectorMetadata:
        loads = self.core.take_pending_loads()
        load_ids = {spec.request_id for spec in loads}
        for spec in loads:
            self.inflight[spec.request_id] = {b for ids in spec.block_ids for b in ids if b >= 0}
            self.events.append(("load", spec.request_id))
        for new in so.scheduled_new_reqs:
            if new.req_id not in load_ids:
                self._running(new.req_id)
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.computed = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._running(rid)  # scheduled again (e.g. recomputing after a failed load)
            t = self._tracked.get(rid)
            if t is not None:
                t.computed = cached.num_computed_tokens[i]
        saves = []
        for rid, t in self._tracked.items():
            sched = so.num_scheduled_tokens.get(rid)
            if sched is None:
                continue
            done = min(t.num_chunks, (t.computed + sched) // self.reg.chunk_tokens)
            if done <= t.saved_chunks:
                continue
            # the chunks completed by this step's forward (or before it: a load, a local hit), saved
            # after the forward; the worker skips what the tier holds and chunks with blocks not resident
            # the block table as the KV cache manager holds it now (blocks freed from a sliding window
            # are vLLM's null block: -1 here, never gathered)
            saves.append(SaveSpec(rid, t.tokens[: done * self.reg.chunk_tokens], done,
                                  block_lists(self.block_ids_of(rid)), t.salt, t.overwrite, t.saved_chunks))
            t.saved_chunks = done
        return BSRConnectorMetadata(loads, saves)

    def _running(self, rid: str) -> None:
        if self.core.on_request_running(rid):
            self.events.append(("marker_cleared", rid))

    def update_connector_output(self, out) -> None:
        invalid = set(getattr(out, "invalid_block_ids", None) or ())
        failed = set(getattr(out, "failed_recving", None) or ())
        if not invalid and not failed:
            return
        for rid, blocks in list(self.inflight.items()):
            if rid in failed or blocks & invalid:
                self.core.markers.set(rid, "external load failed: blocks reported invalid")
                self.events.append(("marker_set", rid))
                write_report(self.cfg.report_path, {"role": "scheduler", "event": "marker_set", "request_id": rid})
                del self.inflight[rid]
                t = self._tracked.get(rid)
                if t is not None:  # saved again as the recompute goes, every chunk rewritten
                    t.saved_chunks, t.overwrite = 0, True

    def request_finished(self, request, block_ids) -> tuple[bool, None]:
        rid = request.request_id
        self.inflight.pop(rid, None)
        self._tracked.pop(rid, None)
        if self.core.markers.clear_on_teardown(rid):
            self.events.append(("marker_cleared", rid))
        self.core.request_finished(request, block_ids)
        return False, None

    def close(self) -> None:
        self.core.close()
