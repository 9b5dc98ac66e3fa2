"""The connector in real vLLM engines over a real Mooncake master with a standalone store host,
tier fallback (Mooncake fails after the probe, the filesystem tier serves), and LMCache's own
storage stack (FS and Mooncake L2) as a tier.

The store-host test restores in a fresh engine (as a deployment restores what another process
saved); the others restore in the engine that saved, once it has forgotten its own copy
(U.forget_local_kv: no prefix-cache hit, every KV block poisoned; for LMCache, nothing in L1)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

from bsr_harness.faulty_tier import FaultyTier  # noqa: E402

W = 2
N = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=5)


@pytest.fixture(scope="module")
def tokens():
    return U.prompt(N * U.CHUNK + 33, seed=21)


@pytest.fixture(scope="module")
def cold(model, tokens):
    return U.cold_output(model, tokens)


@pytest.fixture(scope="module")
def store_host(module_mooncake_master):
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    with MooncakeStoreHost(module_mooncake_master, 256 << 20, wait_forgotten=False) as host:
        yield host


def _kv(tiers: list[dict], salt: str) -> dict:
    """Restores of W chunks a window; save staging for the whole prompt, so that no save is skipped for
    want of staging while a busy machine's puts run (the prefix would miss)."""
    return U.kv_transfer(tiers, window_chunks=W, tuning={"save_staging_chunks": N}, salt=salt)


def _mooncake(master, **kw) -> dict:
    return {"type": "mooncake", "master_address": master.master_address,
            "metadata_server": master.metadata_server, **kw}


def _save(llm, tokens, cold) -> None:
    """The engine prefills `tokens` (cold's output) and saves all N chunks."""
    out = U.generate(llm, tokens)
    worker = U.worker_connector().worker
    assert worker.wait_saves(60)
    saves = worker.saves  # one record per step that completed chunks
    assert saves and all(s["ok"] for s in saves), [s.get("error") for s in saves]
    assert sum(s["stored"] for s in saves) == N
    assert out[0] == cold[0] and out[1] == cold[1]


def _restore(llm, tokens, cold) -> dict:
    """The engine restores `tokens` with W=2 (all N chunks, in N/W windows, staging W chunks); its load record."""
    worker = U.worker_connector().worker
    loads_before = len(worker.loads)
    got = U.generate(llm, tokens)
    assert len(worker.loads) == loads_before + 1
    load = worker.loads[-1]
    assert got[2] == N * U.CHUNK and load["committed"] and load["windows"] == N // W
    assert load["peak_staging_bytes"] == W * worker.reg.chunk_bytes
    assert got[0] == cold[0] and got[1] == cold[1]
    return load


def _save_then_restore(model, tokens, cold, tiers, *, salt: str):
    """Engine A saves, a fresh engine B restores with W=2 (the deployment: another process or a
    restarted one restores); returns B's load record."""
    a = U.make_llm(model, _kv(tiers, salt))
    try:
        _save(a, tokens, cold)
    finally:
        U.shutdown(a)
    b = U.make_llm(model, _kv(tiers, salt))
    try:
        return _restore(b, tokens, cold)
    finally:
        U.shutdown(b)


def _save_then_restore_in_one_engine(model, tokens, cold, tiers, *, salt: str):
    """One engine saves, then restores with W=2 after forgetting its own copy (U.forget_local_kv:
    no prefix-cache hit, every block poisoned) with nothing of the prefix in LMCache's L1; returns
    the load record."""
    llm = U.make_llm(model, _kv(tiers, salt))
    try:
        _save(llm, tokens, cold)
        assert U.lmcache_l1_holds_no_object()
        U.forget_local_kv(llm)
        return _restore(llm, tokens, cold)
    finally:
        U.shutdown(llm)


@pytest.mark.mooncake
def test_mooncake_master_and_store_host(model, tokens, cold, module_mooncake_master, store_host):
    """(b) objects put by engine A live on the store host (the engines mount no segment) and are
    restored by engine B through the master."""
    load = _save_then_restore(model, tokens, cold, [_mooncake(module_mooncake_master)], salt="mooncake")
    assert load["served_by"] == "mooncake"


@pytest.mark.mooncake
def test_fallback_mooncake_fails_filesystem_serves(model, tokens, cold, module_mooncake_master, store_host, tmp_path):
    """Both tiers save; the Mooncake object of chunk 6 is evicted between the probe and the load, so the
    load fails over to the filesystem tier, which serves the whole prefix. One engine saves and, after
    forgetting its own copy (U.forget_local_kv), restores."""
    tiers = [_mooncake(module_mooncake_master, save=True), {"type": "filesystem", "root": str(tmp_path), "save": True}]
    llm = U.make_llm(model, _kv(tiers, "fallback"))
    try:
        U.generate(llm, tokens)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        for name in ("mooncake", "filesystem"):  # both tiers save
            assert sum(s["stored_per_tier"].get(name, 0) for s in worker.saves if s["ok"]) == N
        U.forget_local_kv(llm)
        sched = U.scheduler_connector(llm).scheduler
        from bsr_runtime.keys import PrefixKeys

        key = PrefixKeys(sched.keyspace, tokens, U.CHUNK).window(6, 1)[0]
        faulty = sched.tiers[0] = FaultyTier(sched.tiers[0], close_inner=False)
        faulty.plan.drop_after_probe = {key}  # evicted between the probe and the load
        loads_before = len(worker.loads)
        got = U.generate(llm, tokens)
        assert len(worker.loads) == loads_before + 1
        load = worker.loads[-1]
    finally:
        U.shutdown(llm)
    assert load["committed"] and load["served_by"] == "filesystem"
    assert load["tiers_tried"] == ["mooncake", "filesystem"]
    assert got[2] == N * U.CHUNK and got[0] == cold[0] and got[1] == cold[1]


def test_lmcache_fs_tier(model, tokens, cold, tmp_path):
    """(c) LMCache's StorageManager with its FS L2 adapter as the tier."""
    tiers = [{"type": "lmcache-filesystem", "root": str(tmp_path)}]
    load = _save_then_restore_in_one_engine(model, tokens, cold, tiers, salt="lmc")
    assert load["served_by"].startswith("lmcache")


@pytest.mark.mooncake
def test_lmcache_mooncake_tier(model, tokens, cold, module_mooncake_master, store_host):
    """(c) LMCache's StorageManager with the Mooncake L2 adapter, objects on the store host."""
    tier = {"type": "lmcache-mooncake", "master_address": module_mooncake_master.master_address,
            "metadata_server": module_mooncake_master.metadata_server}
    load = _save_then_restore_in_one_engine(model, tokens, cold, [tier], salt="lmc-mooncake")
    assert load["served_by"].startswith("lmcache")
