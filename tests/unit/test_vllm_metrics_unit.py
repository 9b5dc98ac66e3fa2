"""The connector's stats (integrations/vllm/metrics.py) as vLLM moves them: recorded by each TP worker
from its load and save records, summed over workers, rebuilt from the payload in the front end,
exported to Prometheus. Expected values are written out from the records. The real server's
/metrics is tested in tests/test_vllm_serve.py."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
from collections import deque
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from bsr_harness.experiments import make_source, store_source  # noqa: E402
from bsr_harness.faulty_tier import FaultyTier  # noqa: E402
from bsr_harness.testdata import block_tables, poison  # noqa: E402
from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.vllm.connector import BSRConnector  # noqa: E402
from bsr_runtime.integrations.vllm.metrics import LoadSaveStats  # noqa: E402
from bsr_runtime.integrations.vllm.worker import WorkerSide  # noqa: E402
from bsr_runtime.keys import KeySpace  # noqa: E402
from bsr_runtime.loader import Loader  # noqa: E402
from bsr_runtime.plan import LoadSpec  # noqa: E402
from bsr_runtime.restore import RestoreConfig  # noqa: E402
from bsr_runtime.saver import Saver  # noqa: E402
from bsr_runtime.tiers import FilesystemTier  # noqa: E402
from bsr_runtime.tiers.base import TierUnavailableError  # noqa: E402

C = 1000  # chunk bytes


def _load(rank: int, committed: bool, cause: str | None = None) -> dict:
    return {"rank": rank, "event": "load", "committed": committed, "num_chunks": 4,
            "exposed_tokens": 1024 if committed else 0, "windows": 2, "chunk_bytes": C, "seconds": 0.25,
            "peak_staging_bytes": 2 * C if rank == 0 else 3 * C, "error": "the text is never read",
            "cause": cause}


def _save(rank: int, stored: dict[str, int], failed: tuple[str, ...] = ()) -> dict:
    return {"rank": rank, "event": "save", "ok": not failed, "stored": max(stored.values(), default=0),
            "stored_per_tier": stored, "failed_per_tier": {t: "TierUnavailableError: down" for t in failed},
            "peak_staging_bytes": C, "seconds": 0.1}


def test_a_load_is_labelled_by_its_records_cause_never_its_text():
    from bsr_runtime.causes import FailureCause

    stats = LoadSaveStats(C)
    for cause in FailureCause:
        stats.record_load(_load(0, False, cause.value))
    stats.record_load(_load(0, False, None))  # a record without a cause: "other"
    stats.record_load(_load(0, False, "no such cause"))  # malformed: dropped, never raised
    counts = stats.take().data["counters"]["loads_failed"]
    assert counts == {**{c.value: 1 for c in FailureCause}, "other": 2}


def test_two_workers_summed_and_exported():
    rank0, rank1 = LoadSaveStats(C), LoadSaveStats(C)
    assert rank0.take() is None  # nothing recorded: vLLM gets no stats object
    for stats, rank in ((rank0, 0), (rank1, 1)):
        stats.record_load(_load(rank, True))
        stats.record_load(_load(rank, False, "corrupt" if rank else "commit_rule"))
        stats.record_save(_save(rank, {"filesystem": 3}))
        stats.record_save(_save(rank, {}, ("filesystem",)))
    stats.record_load({"rank": 0})  # malformed: logged and dropped, never raised
    a, b = rank0.take(), rank1.take()
    assert rank0.take() is None  # taken: the next interval starts empty
    payload = pickle.loads(pickle.dumps(a.aggregate(b).to_dict()))  # workers -> engine core -> front end
    front = BSRConnector.build_kv_connector_stats(payload)
    assert front.data == payload and front.data is not payload
    assert front.reduce() == {
        "bsr_loads_committed": 1, "bsr_loads_failed[commit_rule]": 1, "bsr_restore_windows": 2,
        "bsr_restored_bytes": 2 * 4 * C, "bsr_restored_tokens": 1024, "bsr_saved_bytes[filesystem]": 2 * 3 * C,
        "bsr_saved_chunks[filesystem]": 3, "bsr_saves_failed[filesystem]": 2, "bsr_loads": 2,
        "bsr_restore_seconds_max": 0.25,
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
    fs = {**labels, "tier": "filesystem"}
    assert reg.get_sample_value("vllm:bsr_saved_chunks_total", fs) == 6
    assert reg.get_sample_value("vllm:bsr_saves_failed_total", fs) == 4
    assert value("vllm:bsr_restore_seconds_count") == 4 and value("vllm:bsr_restore_seconds_sum") == 1.0
    assert value("vllm:bsr_peak_staging_bytes") == 3 * C
    # names already registered (a second logger in one process): the metrics are off, nothing raised
    assert BSRConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}) is None


def test_levels_ship_when_they_change_and_export_summed_over_ranks():
    """Issue 39: what the workers hold now (restore staging of B, save staging, loads in flight) is a
    gauge: each rank ships its levels when they changed, the latest per rank wins when intervals are
    aggregated, the export is their sum, and back at zero the gauges read zero."""
    rank0, rank1 = LoadSaveStats(C, 0), LoadSaveStats(C, 1)
    busy = {"restore_staging_bytes": 4 * C, "save_staging_bytes": C, "loads_in_flight": 1}
    idle = dict.fromkeys(busy, 0)
    a, b = rank0.take(busy), rank1.take(busy)
    assert rank0.take(busy) is None  # unchanged: nothing shipped
    payload = a.aggregate(b).to_dict()
    assert BSRConnector.build_kv_connector_stats(payload).reduce() == {
        "bsr_restore_staging_bytes": 8 * C, "bsr_save_staging_bytes": 2 * C, "bsr_loads_in_flight": 2}
    later = rank0.take(idle)
    assert BSRConnector.build_kv_connector_stats(payload).aggregate(later).level_totals() == {
        "restore_staging_bytes": 4 * C, "save_staging_bytes": C, "loads_in_flight": 1}  # rank 1 still busy

    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    prom = BSRConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                           {0: ["m", "0"]})
    value = functools.partial(reg.get_sample_value, labels={"model_name": "m", "engine": "0"})
    assert value("vllm:bsr_restore_staging_bytes") == 0  # shown from the start
    prom.observe(payload, 0)
    assert (value("vllm:bsr_restore_staging_bytes"), value("vllm:bsr_loads_in_flight")) == (8 * C, 2)
    prom.observe({"counters": {"loads_committed": {"": 1}}}, 0)  # an interval without levels leaves them
    assert value("vllm:bsr_save_staging_bytes") == 2 * C
    prom.observe(later.aggregate(rank1.take(idle)).to_dict(), 0)
    assert all(value(f"vllm:bsr_{n}") == 0 for n in busy)


# -- labels from real loads and saves: two filesystem tiers, the worker's own records ---------------
def _reg():
    return presets.dsv4_flash(scale=1 / 64)


def _worker(loader: Loader | None, reg, saver: Saver | None = None) -> SimpleNamespace:
    """What WorkerSide's record methods read of the worker: its records go through its real code."""
    cfg = SimpleNamespace(window_chunks=2, load_mode="async", report_path=None)
    return SimpleNamespace(tp_rank=0, loader=loader, cfg=cfg, reg=reg, saver=saver,
                           restore_config=loader.config if loader else None,
                           keyspace=loader.keyspace if loader else None, loads=deque(), saves=deque(),
                           stats=LoadSaveStats(reg.chunk_bytes), _start_hooks={})


class TwoTiers:
    """A remote and an SSD tier (real files, each under a FaultyTier); the source stored in the remote."""

    def __init__(self, tmp_path, chunks: int = 4) -> None:
        self.reg = reg = _reg()
        for d in ("remote", "ssd"):
            (tmp_path / d).mkdir()
        self.inner = [FilesystemTier(tmp_path / d, reg.chunk_bytes, reg.fingerprint) for d in ("remote", "ssd")]
        self.remote, self.ssd = (FaultyTier(t, close_inner=False) for t in self.inner)
        self.remote.name, self.ssd.name = "remote", "ssd"
        self.src = make_source(reg, chunks, seed=5)
        store_source(self.src, self.inner[0], window_chunks=chunks)
        blocks, (self.tables,) = block_tables(reg, [chunks], 3, spare=1, holes="none")
        self.kv = poison(reg.allocate(blocks))

    def loader(self) -> Loader:
        cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=5.0, backend="cpu")
        return Loader(self.reg, [self.remote, self.ssd], self.kv, cfg, unavailable_cooldown_s=60.0)

    def spec(self, i: int) -> LoadSpec:
        return LoadSpec(f"req-{i}", self.src.tokens, self.src.num_chunks, 0, [t.tolist() for t in self.tables],
                        salt=self.src.keyspace.salt)

    def close(self) -> None:
        for t in (self.remote, self.ssd, *self.inner):
            t.close()


def _load_labels(scene: TwoTiers, loader: Loader, n: int) -> list[dict]:
    """Loads 0..n-1 one after the other, each recorded by the worker's code: each one's failure counters."""
    out = []
    for i in range(n):
        loader.submit(scene.spec(i))
        end = time.monotonic() + 30
        results = []
        while not results:
            assert time.monotonic() < end, "the load never finished"
            loader.wait_finished(0.5)
            results = loader.take_finished()
        worker = _worker(loader, scene.reg)
        WorkerSide._report_load(worker, results[0])
        out.append(worker.stats.take().data["counters"].get("loads_failed"))
    return out


def test_a_load_that_skipped_a_tier_in_cooldown_is_counted_unavailable(tmp_path):
    """The remote is down: the first load finds it unavailable (cooldown starts), the second skips it and
    finds the SSD without the prefix. Both failed because the remote was unreachable (was: `other`)."""
    scene = TwoTiers(tmp_path)
    loader = scene.loader()
    try:
        scene.remote.plan.unavailable = True
        first, second = _load_labels(scene, loader, 2)
        assert first == {"unavailable": 1}
        assert second == {"unavailable": 1}
    finally:
        loader.close(5)
        scene.close()


def test_a_load_whose_input_is_refused_is_counted_bad_input(tmp_path):
    """Block tables for one group fewer than the registration has: the load is refused before any byte
    moves and counted `bad_input` (was: `other`)."""
    scene = TwoTiers(tmp_path)
    loader = scene.loader()
    try:
        spec = scene.spec(0)
        loader.submit(dataclasses.replace(spec, block_ids=spec.block_ids[:-1]))
        end = time.monotonic() + 30
        while not (results := loader.take_finished()):
            assert time.monotonic() < end, "the load never finished"
            loader.wait_finished(0.5)
        worker = _worker(loader, scene.reg)
        WorkerSide._report_load(worker, results[0])
        assert worker.stats.take().data["counters"]["loads_failed"] == {"bad_input": 1}
    finally:
        loader.close(5)
        scene.close()


class MasterUnreachable(TierUnavailableError):
    """A tier's own kind of unavailability: another class name, another message."""


def test_a_reworded_error_changes_neither_label_nor_tier_health(tmp_path):
    """The remote fails with a subclass of TierUnavailableError whose name and text say nothing the old
    text patterns knew: counted `unavailable` and the remote put in its cooldown (the second load skips it)."""
    scene = TwoTiers(tmp_path)
    loader = scene.loader()
    try:
        def down(keys):
            raise MasterUnreachable("the master did not answer")

        scene.remote.plan.fail_fetch = down
        first, second = _load_labels(scene, loader, 2)
        assert first == {"unavailable": 1} and second == {"unavailable": 1}
        assert not loader.retriever.tier_available(scene.remote)
    finally:
        loader.close(5)
        scene.close()


def test_a_timed_out_staging_wait_is_counted_as_staging(tmp_path):
    """Every staging chunk is held (a lease the test keeps): the load's wait for staging ends at its bound
    and is counted under `staging`, its real cause (was: `other`)."""
    scene = TwoTiers(tmp_path)
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, backend="cpu", admission_timeout_s=0.3)
    loader = Loader(scene.reg, [scene.remote, scene.ssd], scene.kv, cfg)
    held = loader.arena.acquire(2)
    try:
        (labels,) = _load_labels(scene, loader, 1)
        assert labels == {"staging": 1}
    finally:
        held.release()
        loader.close(5)
        scene.close()


def test_a_partial_multi_tier_save_counts_what_the_healthy_tier_stored(tmp_path):
    """The SSD is down, the remote stores every chunk: the metrics count the remote's chunks and one
    failed save of the SSD (was: saves_failed 1, saved_chunks 0)."""
    scene = TwoTiers(tmp_path, chunks=3)
    reg = scene.reg
    blocks, (tables,) = block_tables(reg, [3], 5, spare=0, holes="none")  # every block resident
    saver = Saver(reg, [scene.remote, scene.ssd], staging_chunks=4, keyspace=KeySpace(reg.fingerprint),
                  backend="cpu")
    saver.kv = reg.allocate(blocks)
    try:
        scene.ssd.plan.unavailable = True
        tokens = make_source(reg, 3, seed=9).tokens  # a prefix no tier holds yet
        saver.save("r", tokens, 0, 3, [t.tolist() for t in tables], "")
        assert saver.wait_idle(30)
        worker = _worker(None, reg, saver)
        for rec in saver.take_finished():
            WorkerSide._record_save(worker, rec)
        counters = worker.stats.take().data["counters"]
        assert [r["stored_per_tier"] for r in worker.saves] == [{"remote": 3}], list(worker.saves)
        assert counters["saved_chunks"] == {"remote": 3}, counters
        assert counters["saved_bytes"] == {"remote": 3 * reg.chunk_bytes}, counters
        assert counters["saves_failed"] == {"ssd": 1}, counters
    finally:
        scene.ssd.plan.unavailable = False
        saver.close(5)
        scene.close()
