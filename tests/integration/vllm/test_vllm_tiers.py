"""The connector in real vLLM engines over a real Mooncake master with a standalone store host,
tier fallback (Mooncake fails after the probe, the filesystem tier serves), and LMCache's own
storage stack (FS and Mooncake L2) as a tier."""

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
def store_host(mooncake_master):
    from bsr_harness.mooncake_launcher import MooncakeStoreHost

    with MooncakeStoreHost(mooncake_master, 256 << 20) as host:
        yield host


def _mooncake(master, **kw) -> dict:
    return {"type": "mooncake", "master_address": master.master_address,
            "metadata_server": master.metadata_server, **kw}


def _save_then_restore(model, tokens, cold, tiers, *, salt: str):
    """Engine A saves, a fresh engine B restores with W=2; returns B's load record."""
    a = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt=salt))
    try:
        out = U.generate(a, tokens)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        saves = worker.saves  # one record per step that completed chunks
        assert saves and all(s["ok"] for s in saves), [s.get("error") for s in saves]
        assert sum(s["stored"] for s in saves) == N
        assert out[0] == cold[0] and out[1] == cold[1]
    finally:
        U.shutdown(a)
    b = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt=salt))
    try:
        got = U.generate(b, tokens)
        worker = U.worker_connector().worker
        load = worker.loads[-1]
    finally:
        U.shutdown(b)
    assert got[2] == N * U.CHUNK and load["committed"] and load["windows"] == N // W
    assert load["peak_staging_bytes"] == W * worker.reg.chunk_bytes
    assert got[0] == cold[0] and got[1] == cold[1]
    return load


@pytest.mark.mooncake
def test_mooncake_master_and_store_host(model, tokens, cold, mooncake_master, store_host):
    """(b) objects put by engine A live on the store host (the engines mount no segment) and are
    restored by engine B through the master."""
    load = _save_then_restore(model, tokens, cold, [_mooncake(mooncake_master)], salt="mooncake")
    assert load["served_by"] == "mooncake"


@pytest.mark.mooncake
def test_fallback_mooncake_fails_filesystem_serves(model, tokens, cold, mooncake_master, store_host, tmp_path):
    tiers = [_mooncake(mooncake_master, save=True), {"type": "filesystem", "root": str(tmp_path), "save": True}]
    a = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt="fallback"))
    try:
        U.generate(a, tokens)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        for name in ("mooncake", "filesystem"):  # both tiers save
            assert sum(s["stored_per_tier"].get(name, 0) for s in worker.saves if s["ok"]) == N
    finally:
        U.shutdown(a)
    b = U.make_llm(model, U.kv_transfer(tiers, window_chunks=W, salt="fallback"))
    try:
        sched = U.scheduler_connector(b).scheduler
        from bsr_runtime.keys import PrefixKeys

        key = PrefixKeys(sched.keyspace, tokens, U.CHUNK).window(6, 1)[0]
        faulty = sched.tiers[0] = FaultyTier(sched.tiers[0], close_inner=False)
        faulty.plan.drop_after_probe = {key}  # evicted between the probe and the load
        got = U.generate(b, tokens)
        load = U.worker_connector().worker.loads[-1]
    finally:
        U.shutdown(b)
    assert load["committed"] and load["served_by"] == "filesystem"
    assert load["tiers_tried"] == ["mooncake", "filesystem"]
    assert got[2] == N * U.CHUNK and got[0] == cold[0] and got[1] == cold[1]


def test_lmcache_fs_tier(model, tokens, cold, tmp_path):
    """(c) LMCache's StorageManager with its FS L2 adapter as the tier."""
    load = _save_then_restore(model, tokens, cold, [{"type": "lmcache-fs", "root": str(tmp_path)}], salt="lmc")
    assert load["served_by"].startswith("lmcache")


@pytest.mark.mooncake
def test_lmcache_mooncake_tier(model, tokens, cold, mooncake_master, store_host):
    """(c) LMCache's StorageManager with the Mooncake L2 adapter, objects on the store host."""
    tier = {"type": "lmcache-mooncake", "master_address": mooncake_master.master_address,
            "metadata_server": mooncake_master.metadata_server}
    load = _save_then_restore(model, tokens, cold, [tier], salt="lmc-mooncake")
    assert load["served_by"].startswith("lmcache")
