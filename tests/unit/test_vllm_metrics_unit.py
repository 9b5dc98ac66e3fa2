"""The connector's stats (integrations/vllm/metrics.py) as vLLM moves them: recorded by each TP worker
from its load and save records, summed over workers, rebuilt from the payload in the front end,
exported to Prometheus. Expected values are written out from the records. The real server's
/metrics is tested in tests/test_vllm_serve.py."""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from bsr_runtime.integrations.vllm.connector import BSRConnector  # noqa: E402
from bsr_runtime.integrations.vllm.metrics import LoadSaveStats, failure_cause  # noqa: E402

C = 1000  # chunk bytes


def _load(rank: int, committed: bool, error: str | None = None) -> dict:
    return {"rank": rank, "event": "load", "committed": committed, "num_chunks": 4,
            "exposed_tokens": 1024 if committed else 0, "windows": 2, "chunk_bytes": C, "seconds": 0.25,
            "peak_staging_bytes": 2 * C if rank == 0 else 3 * C, "error": error}


def _save(rank: int, ok: bool, stored: int) -> dict:
    return {"rank": rank, "event": "save", "ok": ok, "stored": stored, "peak_staging_bytes": C, "seconds": 0.1}


def test_failure_causes():
    assert failure_cause("filesystem: CorruptObjectError: crc mismatch") == "corrupt"
    assert failure_cause("mooncake: MissingObjectError: k; filesystem: CorruptObjectError: x") == "missing"
    assert failure_cause("FetchTimeoutError: deadline passed") == "timeout"
    assert failure_cause("mooncake: TierUnavailableError: down") == "unavailable"
    assert failure_cause("another rank or group was invalid (commit rule)") == "commit_rule"
    assert failure_cause("filesystem: holds 3/12 chunks") == "missing"
    assert failure_cause("load failed: ValueError: block id out of range") == "other"
    assert failure_cause(None) == "other"


def test_two_workers_summed_and_exported():
    rank0, rank1 = LoadSaveStats(C), LoadSaveStats(C)
    assert rank0.take() is None  # nothing recorded: vLLM gets no stats object
    for stats, rank in ((rank0, 0), (rank1, 1)):
        stats.record_load(_load(rank, True))
        stats.record_load(_load(rank, False, "filesystem: CorruptObjectError: crc" if rank else
                                "another rank or group was invalid (commit rule)"))
        stats.record_save(_save(rank, True, 3))
        stats.record_save(_save(rank, False, 0))
    stats.record_load({"rank": 0})  # malformed: logged and dropped, never raised
    a, b = rank0.take(), rank1.take()
    assert rank0.take() is None  # taken: the next interval starts empty
    payload = pickle.loads(pickle.dumps(a.aggregate(b).to_dict()))  # workers -> engine core -> front end
    front = BSRConnector.build_kv_connector_stats(payload)
    assert front.data == payload and front.data is not payload
    assert front.reduce() == {
        "bsr_loads_committed": 1, "bsr_loads_failed[commit_rule]": 1, "bsr_restore_windows": 2,
        "bsr_restored_bytes": 2 * 4 * C, "bsr_restored_tokens": 1024, "bsr_saved_bytes": 2 * 3 * C,
        "bsr_saved_chunks": 3, "bsr_saves_failed": 2, "bsr_loads": 2, "bsr_restore_seconds_max": 0.25,
        "bsr_peak_staging_bytes": 3 * C}

    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # the only field the base class reads
    prom = BSRConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:bsr_loads_failed_total", {**labels, "cause": "corrupt"}) == 0
    prom.observe(payload, 0)
    prom.observe(payload, 0)  # a second interval adds up; the peak stays the largest seen
    prom.observe({"counters": {"loads_committed": {"": "x"}}}, 0)  # malformed: dropped, never raised
    value = functools.partial(reg.get_sample_value, labels=labels)
    assert value("vllm:bsr_loads_committed_total") == 2
    assert reg.get_sample_value("vllm:bsr_loads_failed_total", {**labels, "cause": "commit_rule"}) == 2
    assert value("vllm:bsr_restored_tokens_total") == 2048
    assert value("vllm:bsr_restored_bytes_total") == 16 * C
    assert value("vllm:bsr_saved_chunks_total") == 6 and value("vllm:bsr_saves_failed_total") == 4
    assert value("vllm:bsr_restore_seconds_count") == 4 and value("vllm:bsr_restore_seconds_sum") == 1.0
    assert value("vllm:bsr_peak_staging_bytes") == 3 * C
    # names already registered (a second logger in one process): the metrics are off, nothing raised
    assert BSRConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}) is None
