"""Worker side (one per TP rank): the registered destinations, the loader (restores) and the saver.

Loads: with load_mode "async" start_load_kv hands each load to the loader (bsr_runtime/loader.py)
and returns at once; the restores run on loader threads, their staging shared under the byte budget
B, and each finished load is reported from get_transfer_results, committed or failed closed, only
after its last install completed. The TP ranks agree on q[r][g] over a process group of BSR's own.
A request that finished (aborted) while loading stops at its next window boundary.
With load_mode "sync" the same restore runs on the step thread before the forward, and a failure is
reported by block id (get_block_ids_with_load_errors).

Saves: in wait_for_save, after the step's forward wrote the KV, the saver gathers the complete prompt
chunks the step finished into save staging (bounded) and puts them in the background
(bsr_runtime/saver.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque

import torch

from bsr_kernels.backends import resolve_backend
from bsr_kernels.prepared import prepare

from ...connector_config import ConnectorConfig, write_report
from ...keys import KeySpace
from ...loader import Loader
from ...retrieve import LoadRecord
from ...saver import Saver
from ...tiers.base import Tier
from .metadata import BSRConnectorMetadata
from .metrics import LoadSaveStats
from .registration import destinations

log = logging.getLogger(__name__)
RECORDS = 4096
IDLE_WAIT_S = 0.005  # a step with nothing scheduled waits this long for a load to finish, instead of spinning


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, reg, tiers: list[Tier], model: str, tp_rank: int, tp_world: int,
                 agree=None, *, chunks_per_step: int = 0) -> None:
        self.cfg = cfg
        self.reg = reg
        self.tiers = tiers
        self.tp_rank = tp_rank
        self.restore_config = cfg.restore_config(tiers)
        self.load_async = cfg.load_async
        self.loader = Loader(reg, tiers, None, self.restore_config, budget_bytes=cfg.restore_budget_bytes,
                             max_restores=cfg.tuning.max_concurrent_restores, tp_rank=tp_rank, tp_world=tp_world,
                             salt=cfg.salt, model=model, agree=agree, agree_timeout_s=cfg.timeouts.agree_s,
                             max_staging_retirements=cfg.tuning.max_staging_retirements,
                             unavailable_cooldown_s=cfg.tuning.unavailable_cooldown_s)
        self.keyspace = self.loader.keyspace
        self.saver: Saver | None = None
        save_tiers = [tiers[i] for i in cfg.save_tiers]
        if save_tiers:
            staging = cfg.tuning.save_staging_chunks or 2 * max(cfg.window_chunks, chunks_per_step, 1)
            self.saver = Saver(reg, save_tiers, staging_chunks=staging, backend=cfg.tuning.backend,
                               keyspace=KeySpace(reg.fingerprint, tp_rank, tp_world, cfg.salt, model))
        self.kv: list[torch.Tensor] | None = None
        self._failed_this_step: set[str] = set()
        self._start_hooks: dict[str, str] = {}  # request -> the vLLM call that started its load (records)
        self._load_errors: set[int] = set()
        self.loads: deque[dict] = deque(maxlen=RECORDS)  # the latest load records (tests, demo)
        self.saves: deque[dict] = deque(maxlen=RECORDS)
        self.stats = LoadSaveStats(reg.chunk_bytes, tp_rank)  # vLLM's metrics (get_kv_connector_stats)
        interval = cfg.tuning.gil_switch_interval_s if self.load_async else None
        self._switch_interval = self._shorten_switch_interval(interval)

    @staticmethod
    def _shorten_switch_interval(interval: float | None) -> tuple[float, float] | None:
        """Set the interpreter's switch interval to `interval` if that is shorter (never longer: another
        part of the process may have chosen a short one); (what it was, what we set) to put it back."""
        before = sys.getswitchinterval()
        if interval is None or interval >= before:
            return None
        sys.setswitchinterval(interval)
        log.info("BSR: Python switch interval %.2g s -> %.2g s while background loads run", before, interval)
        return before, sys.getswitchinterval()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = destinations(self.reg, kv_caches)
        # validated and prepared once, at start-up: the first save on a step (and the first restore)
        # finds them prepared (checking a large cache for overlaps takes a while)
        prepare(self.reg, tuple(self.kv), self.cfg.tuning.backend, resolve_backend)
        self.loader.register_kv_caches(self.kv)
        if self.saver is not None:
            self.saver.kv = self.kv

    # -- load ------------------------------------------------------------------------------
    def start_load(self, meta: BSRConnectorMetadata, *, hook: str = "start_load_kv") -> None:
        """Start the step's loads; `hook`: vLLM's call that starts them (the load records say which). vLLM hands
        a step's metadata to handle_preemptions, then to start_load_kv: a load started is not started again
        (its request holds a start hook until its record is reported, at the step's end)."""
        self._failed_this_step = set()
        if self.load_async:
            new = [spec for spec in meta.loads if spec.request_id not in self._start_hooks]
            for spec in new:
                self.loader.submit(spec)
                self._start_hooks[spec.request_id] = hook  # read when the step thread reports the load
            if new and self.cfg.tuning.load_start_wait_s > 0:
                self.loader.wait_started([spec.request_id for spec in new], self.cfg.tuning.load_start_wait_s)
            return
        for spec in meta.loads:
            self._start_hooks[spec.request_id] = hook
            record = self.loader.run(spec)
            self._report_load(record)
            if not record.committed:
                self._failed_this_step.add(spec.request_id)
                for ids in record.invalid_block_ids:
                    self._load_errors.update(ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Sync mode: every block of every failed request. Async mode: none (failures go out per request,
        as failed_recving: vLLM maps block ids to requests only with one KV-cache group)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def transfer_results(self, finished_req_ids: set[str] | None = None, *, idle: bool = False
                         ) -> tuple[set[str], set[str]]:
        """Async mode: (finished receiving, failed among them) since the last call. Requests vLLM finished
        (aborted) while loading are cancelled first; they are reported once their restore stopped."""
        for rid in finished_req_ids or ():
            self.loader.cancel(rid)
            if self.saver is not None:
                self.saver.forget(rid)
        self._drain_saves()
        if not self.load_async:
            return set(), set()
        if idle and self.loader.in_flight:
            self.loader.wait_finished(IDLE_WAIT_S)
        done, failed = set(), set()
        for record in self.loader.take_finished():
            self._report_load(record)
            done.add(record.request_id)
            if not record.committed:
                failed.add(record.request_id)
        return done, failed

    def _report_load(self, record: LoadRecord) -> None:
        """The load's record, with this worker's context, to the report, the metrics and the log."""
        spec = record.spec
        last = record.attempts[-1] if record.attempts else None
        rec = {"role": "worker", "rank": self.tp_rank, "event": "load", "request_id": record.request_id,
               "committed": bool(record.committed), "cancelled": record.cancelled, "num_chunks": record.num_chunks,
               "local_tokens": spec.local_tokens,
               "started_in": self._start_hooks.pop(record.request_id, None),
               "exposed_tokens": min(record.exposed_tokens, spec.num_tokens or record.exposed_tokens),
               "partial_tokens": spec.partial_tokens,
               # prompt tokens prefilled after the restored prefix (vLLM's own prefix cache leaves 1 to 63)
               "recomputed_tokens": len(spec.tokens) - (spec.num_tokens or record.num_chunks * self.reg.chunk_tokens),
               "served_by": record.served_by,
               "tiers_tried": record.tiers_tried, "invalid_blocks": record.invalid_blocks,
               "total_blocks": record.total_blocks,
               "peak_staging_bytes": max((a.peak_staging_bytes for a in record.attempts), default=0),
               "budget_bytes": self.loader.arena.capacity_bytes, "budget_peak_bytes": self.loader.arena.peak_bytes,
               "window_chunks": self.cfg.window_chunks, "pipeline_depth": self.restore_config.pipeline_depth,
               "chunk_bytes": self.reg.chunk_bytes, "load_mode": self.cfg.load_mode,
               "seconds": record.timings.get("restore_s", 0.0), "windows": last.windows if last else 0,
               "valid_per_group": record.valid_per_group, "agreed": record.agreed,
               "fingerprint": self.reg.fingerprint, "model": self.keyspace.model, "error": record.error,
               "cause": None if record.cause is None else record.cause.value, "timings": record.timings}
        self.loads.append(rec)
        self.stats.record_load(rec)
        write_report(self.cfg.report_path, rec)
        if not record.committed and not record.cancelled:
            log.warning("BSR: load of %s failed closed (%d blocks invalid): %s", record.request_id,
                        record.invalid_blocks, record.error)

    def levels(self) -> dict[str, int]:
        """What this worker holds now (vLLM's metrics: gauges): restore staging of the budget B, save
        staging, loads in flight. All 0 once every load and save gave back what it took."""
        return {"restore_staging_bytes": self.loader.staging_bytes,
                "save_staging_bytes": self.saver.arena.live_bytes if self.saver is not None else 0,
                "loads_in_flight": self.loader.in_flight}

    # -- save ------------------------------------------------------------------------------
    def save(self, meta: BSRConnectorMetadata) -> None:
        if self.saver is None:
            return
        for spec in meta.saves:
            if spec.request_id in self._failed_this_step:
                continue  # its blocks hold a failed load; the scheduler saves it again after the recompute
            try:
                self.saver.save(spec.request_id, spec.tokens, spec.first_chunk, spec.num_chunks, spec.block_ids,
                                spec.salt, spec.overwrite, spec.features, spec.partial_tokens)
            except Exception as e:  # noqa: BLE001 - a failed save is a future miss, never an engine error
                log.warning("BSR: save of %s failed: %s: %s", spec.request_id, type(e).__name__, e)
                error = f"{type(e).__name__}: {e}"  # before any tier was asked: a miss in every one
                self._record_save({"event": "save", "request_id": spec.request_id, "ok": False, "stored": 0,
                                   "stored_per_tier": {}, "error": error,
                                   "failed_per_tier": {t.name: error for t in self.saver.tiers}})
        self._drain_saves()

    def _drain_saves(self) -> None:
        if self.saver is None:
            return
        for rec in self.saver.take_finished():
            self._record_save(rec)

    def _record_save(self, rec: dict) -> None:
        rec = {"role": "worker", "rank": self.tp_rank, **rec}
        self.saves.append(rec)
        self.stats.record_save(rec)
        write_report(self.cfg.report_path, rec)

    def wait_saves(self, timeout: float = 30.0) -> bool:
        """Wait until every queued put finished (tests, shutdown) and record them."""
        done = self.saver is None or self.saver.wait_idle(timeout)
        self._drain_saves()
        return done

    def close(self) -> None:
        """Stop loads and saves within shutdown_timeout_s in all: one deadline shared by the loader and the
        saver (the saver gets what the loader left of it), not one timeout each."""
        deadline = time.monotonic() + self.cfg.timeouts.shutdown_s
        self.loader.close(self.cfg.timeouts.shutdown_s)
        if self.saver is not None:
            self.saver.close(max(0.0, deadline - time.monotonic()))
            self._drain_saves()
        if self._switch_interval is not None:
            before, ours = self._switch_interval
            self._switch_interval = None
            if sys.getswitchinterval() == ours:  # unless someone set another since
                sys.setswitchinterval(before)
