"""Scheduler side: the planner (probe, force-local markers, loads recorded at allocation) and the
save triggers.

The planner probes every TP rank's keys (`probe_all_ranks`), so N is the prefix every rank holds. Per
step the recorded loads and the saves that became due go to the workers (BSRConnectorMetadata).

Loads: with load_mode "async" (default) get_num_new_matched_tokens answers load_async=True, so vLLM
keeps the request in WAITING_FOR_REMOTE_KVS while the workers' loaders restore it and the engine goes
on stepping; the workers report it in finished_recving (failed_recving when it failed closed).
"sync" loads before the step's forward, on the step thread (for comparison).

Markers: a load reported failed (failed_recving, or invalid blocks in sync mode) sets the request's
force-local marker; while it holds, get_num_new_matched_tokens answers 0 without a lookup. The
marker is cleared when the request is next scheduled (admitted RUNNING: it prefills locally) or
torn down.

Saves: every request is tracked from admission (bsr_runtime/save_triggers.py, engine-neutral: this
side tells it what vLLM scheduled); in each step whose scheduled tokens complete prompt chunks, a
SaveSpec for those chunks goes out and the workers gather them after the forward
pass (while every group's blocks of those tokens are resident: vLLM frees sliding-window blocks
once they leave the window) and put them in the background. Chunks a load restored are held by the
tier already and are not saved again; a request whose load failed is saved again as it is
recomputed, rewriting every chunk.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from ...connector_config import ConnectorConfig, write_report
from ...planner import Planner
from ...save_triggers import SaveTriggers
from ...tiers.base import Tier
from .metadata import BSRConnectorMetadata, SaveSpec
from .metrics import BSRConnectorStats
from .registration import block_lists
from .request_keys import VllmKeyInputs

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, reg, tiers: list[Tier], model: str, tp_world: int,
                 block_ids_of: Callable[[str], object], kv_cache_config=None,
                 block_pool: Callable[[], object] | None = None) -> None:
        self.cfg = cfg
        self.reg = reg
        self.block_ids_of = block_ids_of  # request id -> its current block ids per group (vLLM's)
        self.kv_cache_config = kv_cache_config  # vLLM's
        self.block_pool = block_pool  # () -> vLLM's block pool (its prefix cache), None before it is bound
        self.load_async = cfg.load_async
        self.planner = Planner(reg, tiers, tp_world=tp_world, salt=cfg.salt, model=model, probe_all_ranks=True,
                               probe_timeout_s=cfg.timeouts.probe_s, probe_wait_s=cfg.tuning.probe_wait_s,
                               key_inputs=VllmKeyInputs(), restore_partial_chunk=cfg.restore_partial_chunk,
                               unavailable_cooldown_s=cfg.tuning.unavailable_cooldown_s)
        self._refused_taken: dict[str, int] = {}  # planner.stats.refused at the last take_stats()
        self.inflight: dict[str, tuple[int, set[int]]] = {}  # request -> (chunks, blocks) of its load
        self.save_triggers = SaveTriggers(reg.chunk_tokens)  # which prompt chunks to save, in which step
        # the latest (event, request id): early_lookup, probe, skip, load, marker_set, marker_cleared (tests, logs)
        self.events: deque[tuple[str, str]] = deque(maxlen=4096)

    @property
    def markers(self):
        return self.planner.markers

    @property
    def keyspace(self):
        return self.planner.keyspace

    @property
    def tiers(self) -> list[Tier]:
        return self.planner.tiers

    # -- admission -------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        """The request arrived: its lookup starts on the probe thread, so it is often done by the time
        the engine first asks (async loads), unless vLLM's own prefix cache holds the prompt already."""
        if self.load_async and not self._cached_by_vllm(request) and self.planner.start_lookup(request) is not None:
            self.events.append(("early_lookup", request.request_id))

    def _cached_by_vllm(self, request) -> bool:
        """Whether vLLM's own prefix cache holds the block before the prompt's last token: the engine's hit
        then covers all BSR could restore, and a lookup started now would only take the interpreter from
        the step's prefill. One KV-cache group only (block hashes at its block size); False when unsure,
        and the lookup starts now as for any request (get_num_new_matched_tokens decides either way)."""
        pool = self.block_pool() if self.block_pool is not None else None
        groups = self.kv_cache_config.kv_cache_groups if self.kv_cache_config is not None else ()
        if pool is None or len(groups) != 1:
            return False
        bs = groups[0].kv_cache_spec.block_size
        n = getattr(request, "num_prompt_tokens", 0)
        hashes = getattr(request, "block_hashes", None) or ()
        last = (n - 1) // bs - 1
        if last < 0 or len(hashes) != n // bs:
            return False
        return pool.get_cached_block(hashes[last], [0]) is not None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """With async loads the lookup runs on a probe thread of the planner: None (vLLM asks again next
        step) until it answered, or passed probe_timeout_s (a miss); the step thread pays neither key
        derivation nor tier round trips."""
        skipped, probes = self.planner.stats.skipped_by_marker, self.planner.stats.probes
        if self.load_async:
            n = self.planner.match_in_background(request, num_computed_tokens)
            if n is None:
                return None, False
        else:
            n = self.planner.match(request, num_computed_tokens)
        rid = request.request_id
        if self.planner.stats.skipped_by_marker > skipped:
            self.events.append(("skip", rid))
        elif self.planner.stats.probes > probes or self.load_async:
            self.events.append(("probe", rid))
        return n, bool(n) and self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.planner.allocated(request, block_lists(blocks), num_external_tokens)
        rid = request.request_id
        if self.cfg.save_tiers and rid not in self.save_triggers and self._keyable(request):
            tokens = request.prompt_token_ids or ()
            ct = self.reg.chunk_tokens
            n = len(tokens) // ct
            align = self.planner.block_align
            partial = (len(tokens) - n * ct) // align * align if self.planner.restore_partial_chunk and n else 0
            if n > 0:
                inputs = self.planner.inputs(request)
                self.save_triggers.track(rid, tokens, inputs.salt, inputs.features, partial)

    def _keyable(self, request) -> bool:
        """False for a request whose inputs BSR cannot key (the planner counts it, once per request)."""
        why = self.planner.refused(request)
        if why is not None:
            self.events.append(("refused", request.request_id))
        return why is None

    def take_stats(self) -> BSRConnectorStats | None:
        """The scheduler's counters since the last call (vLLM adds them to the workers')."""
        stats = BSRConnectorStats()
        for why, n in list(self.planner.stats.refused.items()):
            stats.add("requests_unkeyed", n - self._refused_taken.get(why, 0), why)
            self._refused_taken[why] = n
        return None if stats.is_empty() else stats

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update: nothing stored
        before is restored into this engine again (a new epoch in every key: Planner.new_epoch), and the
        prompts tracked for saving are dropped (their KV may predate the change)."""
        self.planner.new_epoch()
        self.save_triggers.clear()
        self.events.append(("epoch", str(self.planner.stats.epochs)))
        return True

    # -- per step --------------------------------------------------------------------------
    def build_connector_meta(self, so) -> BSRConnectorMetadata:
        loads = self.planner.take_loads()
        load_ids = {spec.request_id for spec in loads}
        for spec in loads:
            self.inflight[spec.request_id] = (spec.num_chunks, {b for ids in spec.block_ids for b in ids if b >= 0})
            self.events.append(("load", spec.request_id))
            self.save_triggers.loaded(spec.request_id, spec.num_chunks, bool(spec.partial_tokens))
        for new in so.scheduled_new_reqs:
            if new.req_id not in load_ids:
                self._running(new.req_id)
            self.save_triggers.scheduled(new.req_id, new.num_computed_tokens, first=True)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._running(rid)  # scheduled again (e.g. recomputing after a failed load)
            self.save_triggers.scheduled(rid, cached.num_computed_tokens[i], first=False)
        return BSRConnectorMetadata(loads, self._due_saves(so), idle=so.total_num_scheduled_tokens == 0)

    def _due_saves(self, so) -> list[SaveSpec]:
        """The chunks completed by this step's forward (or before it: a local hit), saved after the
        forward; the block table as the KV cache manager holds it now (blocks freed from a sliding
        window are vLLM's null block: -1 here, never gathered)."""
        return [SaveSpec(r.request_id, r.tokens, r.num_chunks, block_lists(self.block_ids_of(r.request_id)), r.salt,
                         r.overwrite, r.first_chunk, r.features, r.partial_tokens)
                for r in self.save_triggers.due(so.num_scheduled_tokens)]

    def _running(self, rid: str) -> None:
        if self.planner.running(rid):
            self.events.append(("marker_cleared", rid))

    def update_connector_output(self, out) -> None:
        invalid = set(getattr(out, "invalid_block_ids", None) or ())
        failed = set(getattr(out, "failed_recving", None) or ())
        for rid in getattr(out, "finished_recving", None) or ():
            if rid not in failed and (rid not in self.inflight or not (self.inflight[rid][1] & invalid)):
                self.inflight.pop(rid, None)  # committed
        if not invalid and not failed:
            return
        for rid, (_, blocks) in list(self.inflight.items()):
            if rid in failed or blocks & invalid:
                self.planner.load_failed(rid, "external load failed: reported by the workers")
                self.events.append(("marker_set", rid))
                write_report(self.cfg.report_path, {"role": "scheduler", "event": "marker_set", "request_id": rid})
                del self.inflight[rid]
                self.save_triggers.load_failed(rid)  # saved again as the recompute goes, every chunk rewritten

    def request_finished(self, request, block_ids) -> tuple[bool, None]:
        """Teardown. The blocks may be freed at once: saves gather during the step, loads of an aborted
        request are reported finished only after their last install completed."""
        rid = request.request_id
        self.inflight.pop(rid, None)
        self.save_triggers.forget(rid)
        if self.planner.finished(rid):
            self.events.append(("marker_cleared", rid))
        return False, None

    def close(self) -> None:
        self.planner.close()
