"""The connector's counters in vLLM's own metrics: its Prometheus output (`/metrics` of `vllm serve`)
and its periodic "KV Transfer metrics" log line, through vLLM 0.32's KV connector stats hooks.

The worker records each load and save (`LoadSaveStats.record_load` / `record_save`, given the
worker's load and save records); every step vLLM takes what was recorded since the step before
(`take()`, via `get_kv_connector_stats`), sums it over the TP workers (`aggregate`), ships it to the
front end, rebuilds it there (`build_kv_connector_stats`) and hands it to `BSRPromMetrics.observe`.

    vllm:bsr_loads_committed_total            loads that committed (rank 0's view: the outcome is agreed)
    vllm:bsr_loads_failed_total{cause}        loads that failed closed, by cause: the load record's "cause", a
                                              bsr_runtime.causes.FailureCause set where the failure was caught
                                              (FAILURE_CAUSES; never read from the error text)
    vllm:bsr_load_phase_seconds_total{phase}  where the loads' time went (LOAD_PHASES: the scheduler's probe,
                                              queueing for a loader thread and for the byte budget, fetch,
                                              install, agreement, ...), summed over every load
    vllm:bsr_restored_tokens_total            tokens exposed by committed loads
    vllm:bsr_recomputed_tokens_total          prompt tokens prefilled after a committed load's prefix
    vllm:bsr_restore_windows_total            windows of committed loads
    vllm:bsr_restore_seconds                  histogram: restore time of every load (committed or not)
    vllm:bsr_restored_bytes_total             bytes of committed loads, summed over TP ranks
    vllm:bsr_saved_chunks_total{tier}         chunks stored into each tier (rank 0's view)
    vllm:bsr_saved_bytes_total{tier}          bytes stored into each tier, summed over TP ranks
    vllm:bsr_saves_failed_total{tier}         saves that failed in each tier (a later miss, not an error), every
                                              rank: a save stored by one tier and failed by another counts its
                                              chunks under the first and one failure under the second
    vllm:bsr_saves_skipped_total              saves skipped at once for want of save staging (never waited for)
    vllm:bsr_peak_staging_bytes               gauge: the largest staging any load or save held
    vllm:bsr_restore_staging_bytes            gauge: restore staging of the budget B held now, all TP ranks
    vllm:bsr_save_staging_bytes               gauge: save staging held now (puts still running), all TP ranks
    vllm:bsr_loads_in_flight                  gauge: loads started and not yet reported finished, all TP ranks
    vllm:bsr_requests_unkeyed_total{reason}   requests neither saved nor restored: an input BSR cannot key
                                              (prompt_embeds; adapter: its files unreadable), the scheduler's count

The three level gauges are what the workers held at the end of the engine's latest step (a worker ships
them when they changed): after the last request the engine stops stepping, so a put that finished later
shows at the next step (any request).

Request-level counts come from rank 0 alone, since every rank reports the same agreed outcome;
a load failed by another rank's object counts under cause "commit_rule" (that rank's own cause
is in its `report_path` line). The per-tier series show from a tier's first save (the front end does
not know the tier names); the rest from the start, at 0. Recording never raises into the engine: a
malformed record (a cause that is not a FailureCause) is logged and dropped.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ...causes import FailureCause
from ...restore import RESTORE_PHASES

log = logging.getLogger(__name__)

FAILURE_CAUSES = tuple(c.value for c in FailureCause)
# a load record's "timings" (bsr_runtime/loader.py) -> the phase label: the restore's phases (RESTORE_PHASES; the
# admission's wait is labelled by what it waits for, the budget) between the load's own
LOAD_PHASES = {"probe_s": "probe", "queued_s": "queue",
               **{f"{phase}_s": "budget" if phase == "admit" else phase for phase in RESTORE_PHASES},
               "agree_s": "agree", "total_s": "total"}

# counter name -> (documentation, its label's name or None)
COUNTERS: dict[str, tuple[str, str | None]] = {
    "loads_committed": ("BSR connector: loads that committed (restored prefix exposed).", None),
    "loads_failed": ("BSR connector: loads that failed closed (prefix recomputed), by cause.", "cause"),
    "restored_tokens": ("BSR connector: tokens restored by committed loads.", None),
    "recomputed_tokens": ("BSR connector: prompt tokens prefilled after the prefix committed loads restored.", None),
    "restore_windows": ("BSR connector: windows of committed loads.", None),
    "restored_bytes": ("BSR connector: bytes restored by committed loads, all TP ranks.", None),
    "saved_chunks": ("BSR connector: 256-token chunks stored, by tier.", "tier"),
    "saved_bytes": ("BSR connector: bytes stored, by tier, all TP ranks.", "tier"),
    "saves_failed": ("BSR connector: saves that failed (the prefix will miss there), by tier, every TP rank.", "tier"),
    "saves_skipped": ("BSR connector: saves skipped for want of save staging (the prefix will miss).", None),
    "load_phase_seconds": ("BSR connector: seconds of the loads spent in each phase (rank 0).", "phase"),
    "requests_unkeyed": ("BSR connector: requests neither saved nor restored because an input of theirs "
                         "cannot be keyed (prompt_embeds, adapter), by reason.", "reason"),
}
PEAK_STAGING = "peak_staging_bytes"
# gauges of what a worker holds now: name -> documentation (WorkerSide.levels)
LEVELS: dict[str, str] = {
    "restore_staging_bytes": "BSR connector: restore staging (of the byte budget B) held now, all TP ranks.",
    "save_staging_bytes": "BSR connector: save staging held now (puts still running), all TP ranks.",
    "loads_in_flight": "BSR connector: loads started and not yet reported finished, all TP ranks.",
}
RESTORE_SECONDS = "restore_seconds"
RESTORE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "vllm:bsr_"


def load_cause(record: dict[str, Any]) -> str:
    """The cause label of a failed load's record: its "cause" (a FailureCause value; ValueError if not one),
    "other" for a record that carries none."""
    return FailureCause(record.get("cause") or FailureCause.OTHER).value


@dataclass
class BSRConnectorStats(KVConnectorStats):
    """What the connector recorded in one interval, as plain data (string keys, numbers, lists: it
    crosses processes):

        {"counters": {name: {label value or "": n}}, "restore_seconds": [s, ...], "peak_staging_bytes": b,
         "levels": {rank: {level name: value}}}

    Counters add up when intervals or TP workers are aggregated, the peak is their maximum; levels are
    kept per rank (the latest interval's), summed over ranks when exported."""

    def __post_init__(self) -> None:
        for key, empty in (("counters", {}), (RESTORE_SECONDS, []), (PEAK_STAGING, 0)):
            self.data.setdefault(key, empty)

    @classmethod
    def from_payload(cls, data: dict[str, Any] | None) -> BSRConnectorStats:
        """A copy of a payload (to_dict() of another process): aggregating into it leaves the payload
        as vLLM's other metric consumers see it."""
        return cls(data=copy.deepcopy(data) if data else {})

    def reset(self) -> None:
        self.data = {"counters": {}, RESTORE_SECONDS: [], PEAK_STAGING: 0}

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data[RESTORE_SECONDS] or self.data[PEAK_STAGING]
                    or self.data.get("levels"))

    def add(self, name: str, value: float, label: str = "") -> None:
        if value:
            per_label = self.data["counters"].setdefault(name, {})
            per_label[label] = per_label.get(label, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, per_label in other.data.get("counters", {}).items():
            for label, value in per_label.items():
                self.add(name, value, label)
        self.data[RESTORE_SECONDS].extend(other.data.get(RESTORE_SECONDS, ()))
        self.data[PEAK_STAGING] = max(self.data[PEAK_STAGING], other.data.get(PEAK_STAGING, 0))
        if other.data.get("levels"):
            self.data.setdefault("levels", {}).update(other.data["levels"])
        return self

    def level_totals(self) -> dict[str, int]:
        """Each level summed over the ranks that reported one ({} when none did)."""
        totals: dict[str, int] = {}
        for per_rank in self.data.get("levels", {}).values():
            for name, value in per_rank.items():
                totals[name] = totals.get(name, 0) + int(value)
        return totals

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, per_label in sorted(self.data["counters"].items()):
            for label, value in sorted(per_label.items()):
                out[f"bsr_{name}" + (f"[{label}]" if label else "")] = value
        seconds = self.data[RESTORE_SECONDS]
        if seconds:
            out["bsr_loads"] = len(seconds)
            out["bsr_restore_seconds_max"] = round(max(seconds), 6)
        if self.data[PEAK_STAGING]:
            out["bsr_peak_staging_bytes"] = self.data[PEAK_STAGING]
        out.update({f"bsr_{name}": value for name, value in self.level_totals().items()})
        return out


class LoadSaveStats:
    """The worker's recorder: record_load / record_save take the worker's own load and save records
    (the dicts it appends to `loads` / `saves` and to `report_path`); take() hands vLLM what was
    recorded since the last take (None when nothing was). Thread-safe: loads may finish off the
    step thread."""

    def __init__(self, chunk_bytes: int, rank: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.rank = rank
        self._lock = threading.Lock()
        self._stats = BSRConnectorStats()
        self._levels_shipped: dict[str, int] | None = None

    def record_load(self, record: dict[str, Any]) -> None:
        try:
            self._record_load(record)
        except Exception:  # noqa: BLE001 - diagnostics never raise into the engine
            log.warning("BSR: load record not counted: %r", record, exc_info=True)

    def record_save(self, record: dict[str, Any]) -> None:
        try:
            self._record_save(record)
        except Exception:  # noqa: BLE001 - diagnostics never raise into the engine
            log.warning("BSR: save record not counted: %r", record, exc_info=True)

    def _record_load(self, r: dict[str, Any]) -> None:
        first_rank = r.get("rank", 0) == 0
        with self._lock:
            s = self._stats
            if r["committed"]:
                s.add("restored_bytes", r["num_chunks"] * r["chunk_bytes"])
                if first_rank:
                    s.add("loads_committed", 1)
                    s.add("restored_tokens", r["exposed_tokens"])
                    s.add("recomputed_tokens", r.get("recomputed_tokens", 0))
                    s.add("restore_windows", r["windows"])
            elif first_rank:
                s.add("loads_failed", 1, load_cause(r))
            if first_rank:
                s.data[RESTORE_SECONDS].append(float(r["seconds"]))
                for key, phase in LOAD_PHASES.items():
                    s.add("load_phase_seconds", float(r.get("timings", {}).get(key, 0.0)), phase)
            s.data[PEAK_STAGING] = max(s.data[PEAK_STAGING], int(r.get("peak_staging_bytes") or 0))

    def _record_save(self, r: dict[str, Any]) -> None:
        """Per tier: the chunks each tier stored, one failure for each tier that failed (a save that failed
        before any tier was asked, its gather, fails in every tier it was for)."""
        stored = {str(t): int(n) for t, n in (r.get("stored_per_tier") or {}).items()}
        failed = list(r.get("failed_per_tier") or ())
        if not r["ok"] and not failed:
            failed = [t for t in r.get("tiers") or () if t not in stored] or ["unknown"]
        with self._lock:
            s = self._stats
            for tier in failed:
                s.add("saves_failed", 1, str(tier))
            if r.get("skipped"):
                s.add("saves_skipped", 1)
            for tier, n in stored.items():
                s.add("saved_bytes", n * self.chunk_bytes, tier)
                if r.get("rank", 0) == 0:
                    s.add("saved_chunks", n, tier)
            s.data[PEAK_STAGING] = max(s.data[PEAK_STAGING], int(r.get("staging_bytes") or 0))

    def take(self, levels: dict[str, int] | None = None) -> BSRConnectorStats | None:
        """What was recorded since the last take, with `levels` (the worker's gauges now) when they changed
        since they were last shipped; None when there is nothing."""
        try:
            with self._lock:
                if levels is not None and levels != self._levels_shipped:
                    self._stats.data["levels"] = {str(self.rank): dict(levels)}
                    self._levels_shipped = dict(levels)
                if self._stats.is_empty():
                    return None
                out, self._stats = self._stats, BSRConnectorStats()
                return out
        except Exception:  # noqa: BLE001 - diagnostics never raise into the engine
            log.warning("BSR: connector stats dropped", exc_info=True)
            return None


class BSRPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (module docstring), one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=PREFIX + name, documentation=doc,
                                    labelnames=labelnames + ([label] if label else []))
            for name, (doc, label) in COUNTERS.items()
        }
        self._seconds = self._histogram_cls(name=PREFIX + RESTORE_SECONDS,
                                            documentation="BSR connector: seconds per load (committed or not).",
                                            labelnames=labelnames, buckets=list(RESTORE_SECONDS_BUCKETS))
        self._peak = self._gauge_cls(name=PREFIX + PEAK_STAGING, multiprocess_mode="max",
                                     documentation="BSR connector: the largest staging (bytes) a load or save held.",
                                     labelnames=labelnames)
        self._levels = {name: self._gauge_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames,
                                              multiprocess_mode="mostrecent")
                        for name, doc in LEVELS.items()}
        self._peak_seen: dict[int, int] = {}
        for values in per_engine_labelvalues.values():  # every series shows from the start, at 0
            for name, (_, label) in COUNTERS.items():
                if label is None:
                    self._counters[name].labels(*values)
            for cause in FAILURE_CAUSES:
                self._counters["loads_failed"].labels(*values, cause)
            self._seconds.labels(*values)
            self._peak.labels(*values).set(0)
            for gauge in self._levels.values():
                gauge.labels(*values).set(0)

    @classmethod
    def create(cls, vllm_config, metric_types, labelnames: list[str],
               per_engine_labelvalues: dict[int, list[object]]) -> BSRPromMetrics | None:
        """The metrics, or None (a warning; the server runs without them) where they cannot be made."""
        try:
            return cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        except Exception:  # noqa: BLE001 - diagnostics never keep the engine from starting
            log.warning("BSR: the connector's Prometheus metrics are off", exc_info=True)
            return None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        try:
            self._observe(transfer_stats_data, engine_idx)
        except Exception:  # noqa: BLE001 - diagnostics never raise into the engine
            log.warning("BSR: connector stats not exported: %r", transfer_stats_data, exc_info=True)

    def _observe(self, data: dict[str, Any], engine_idx: int) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for name, per_label in data.get("counters", {}).items():
            if name not in self._counters:
                continue
            for label, value in per_label.items():
                counter = self._counters[name]
                (counter.labels(*values, label) if label else counter.labels(*values)).inc(value)
        for seconds in data.get(RESTORE_SECONDS, ()):
            self._seconds.labels(*values).observe(seconds)
        for name, value in BSRConnectorStats(data={"levels": data.get("levels", {})}).level_totals().items():
            if name in self._levels:
                self._levels[name].labels(*values).set(value)
        peak = int(data.get(PEAK_STAGING, 0))
        if peak > self._peak_seen.get(engine_idx, 0):
            self._peak_seen[engine_idx] = peak
            self._peak.labels(*values).set(peak)
