"""Issue 39: one Mooncake cluster shared by several engines, all real processes on loopback: a
`mooncake_master` (client TTL 2 s: it forgets a lost host 2 s after its last heartbeat), three store
hosts (`mooncake_client`) and two `vllm serve` engines of one tiny local model, started once for the
module. Engine A saves 2 copies of every object (replica_num 2), engine B one. Every output is compared
with a cold prefill of its prompt in B (a `cache_salt` of its own: nothing restored), tokens and logprobs.

1. cross-engine reuse: B restores what A saved, its objects spread over the hosts (the master's view);
2. replicas: a host holding A's objects killed (SIGKILL) before B's restore, which still commits;
3. a lost host without replicas, before B's restore and during it: the load fails closed within the
   fetch timeout, B recomputes, the repair save re-stores the prefix on the surviving hosts, the next
   restore commits; no staging or budget left;
4. a restarted master (SIGKILL, started again: every object gone): both engines keep serving;
5. a soak (14 s here, for the test suite's time; benchmarks/mooncake_cluster_soak.py runs 10 minutes):
   both engines, mixed requests, a host killed and restarted every 4 s.
Tests 1-4 send one request at a time: outputs bit for bit the cold ones. In the soak two clients per
engine share its steps, which moves the prefill steps' boundaries (docs/vllm.md, "Output identical to a
cold prefill"): tokens identical, logprobs within the last bits.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

import vllm_server as S  # noqa: E402
import vllm_util as U  # noqa: E402

from bsr_harness.cluster_soak import CONNECTOR, SoakPlan, cluster_engines, run_soak, wait_idle  # noqa: E402
from bsr_harness.mooncake_cluster import MooncakeCluster  # noqa: E402

pytestmark = pytest.mark.mooncake

CHUNKS = 6
TTL_S = 2
FETCH_TIMEOUT_S = CONNECTOR["timeouts"]["fetch_s"]
LEVELS_ZERO = dict.fromkeys(("vllm:bsr_restore_staging_bytes", "vllm:bsr_save_staging_bytes",
                             "vllm:bsr_loads_in_flight"), 0.0)


class Env:
    def __init__(self, cluster: MooncakeCluster, a: S.VllmServer, b: S.VllmServer) -> None:
        self.cluster, self.a, self.b = cluster, a, b
        self.master = cluster.master


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    work = tmp_path_factory.mktemp("mooncake-cluster")
    model = U.build_tiny_llama(work / "model", seed=39)
    cluster = MooncakeCluster(hosts=3, segment_bytes=64 << 20, client_ttl_s=TTL_S).start()
    engines = []
    try:
        engines = cluster_engines(cluster, model, work, replica_nums=(2, 1))
        yield Env(cluster, *engines)
    finally:
        for e in engines:
            e.stop()
        cluster.stop()
    assert not cluster.master.running() and not any(h.running() for h in cluster.hosts)


def _cold(env: Env, tokens: list[int], tag: str) -> tuple[list[int], list[float]]:
    """B's cold prefill of `tokens` (a key space of its own: nothing restored, nothing of it reused), once
    its save has landed (the keys of a later save are told apart by what the master lists)."""
    before = env.master.keys()
    resp = env.b.complete(tokens, cache_salt=f"cold-{tag}")
    assert S.cached_tokens(resp) == 0
    _new_keys(env, before, CHUNKS)
    _levels_zero(env.b)
    return S.completion_tokens(resp)


def _new_keys(env: Env, before: set[str], n: int) -> list[str]:
    """The `n` keys the master lists beyond `before` (it lists a key from the start of its put: wait_idle
    tells when the engine's puts finished)."""
    deadline = time.monotonic() + 20
    while len(env.master.keys() - before) < n:
        assert time.monotonic() < deadline, f"{len(env.master.keys() - before)} of {n} objects stored"
        time.sleep(0.1)
    keys = sorted(env.master.keys() - before)
    assert len(keys) == n, keys
    return keys


def _saved_by(engine: S.VllmServer, env: Env, tokens: list[int]) -> tuple[list[str], tuple]:
    """`engine` prefills `tokens` (a miss) and saves them: (the keys of its objects, its output)."""
    before = env.master.keys()
    resp = engine.complete(tokens)
    assert S.cached_tokens(resp) == 0
    keys = _new_keys(env, before, CHUNKS)
    _levels_zero(engine)  # its puts finished
    return keys, S.completion_tokens(resp)


def _restored(engine: S.VllmServer, tokens: list[int]) -> tuple[dict, float]:
    """`engine`'s completion of `tokens` with its own prefix cache dropped (the tiers must serve it)."""
    assert engine.post("/reset_prefix_cache")["success"]
    t = time.monotonic()
    resp = engine.complete(tokens)
    return resp, time.monotonic() - t


def _counter(engine: S.VllmServer, name: str, **labels: str) -> float:
    return S.bsr_value(engine.metrics(), name, **labels)


def _levels_zero(engine: S.VllmServer) -> None:
    assert wait_idle(engine) == LEVELS_ZERO, "staging, budget or a load left behind"


def _on_host(env: Env, keys: list[str]) -> tuple[str, dict[str, list[str]]]:
    """(the store host the first key's first copy is on, where every key is): the host a get reads."""
    where = env.master.placement(keys)
    return where[keys[0]][0], where


def test_cross_engine_reuse_through_three_store_hosts(env):
    tokens = U.prompt(CHUNKS * U.CHUNK + 30, seed=391)
    cold = _cold(env, tokens, "reuse")
    keys, saved = _saved_by(env.a, env, tokens)
    assert saved == cold  # two engines of one model: one cold output
    where = env.master.placement(keys)
    hosts = {h for copies in where.values() for h in copies}
    print(f"\nA's {len(keys)} objects, 2 copies each, over the hosts: "
          f"{ {h: sum(h in c for c in where.values()) for h in sorted(hosts)} }")
    assert all(len(set(c)) == 2 for c in where.values()), where  # replica_num 2: two hosts each
    assert hosts <= {s for h in env.cluster.hosts for s in h.segments} and len(hosts) >= 2
    committed = _counter(env.b, "vllm:bsr_loads_committed_total")
    resp, _ = _restored(env.b, tokens)
    assert S.cached_tokens(resp) == CHUNKS * U.CHUNK
    assert S.completion_tokens(resp) == cold
    assert _counter(env.b, "vllm:bsr_loads_committed_total") == committed + 1


def test_a_second_copy_serves_a_restore_after_its_host_was_killed(env):
    tokens = U.prompt(CHUNKS * U.CHUNK + 31, seed=392)
    cold = _cold(env, tokens, "replica")
    keys, _ = _saved_by(env.a, env, tokens)
    victim, where = _on_host(env, keys)
    host = env.cluster.host_named(victim)
    host.kill()
    try:
        resp, seconds = _restored(env.b, tokens)
        print(f"\nhost {victim} (first copy of {sum(c[0] == victim for c in where.values())} objects) killed; "
              f"B restored in {seconds:.2f} s")
        assert S.cached_tokens(resp) == CHUNKS * U.CHUNK, "the restore did not commit from the surviving copies"
        assert S.completion_tokens(resp) == cold
        assert seconds < FETCH_TIMEOUT_S + 5
    finally:
        env.cluster.restart_host(env.cluster.hosts.index(host))
    _levels_zero(env.b)


def _repaired(env: Env, tokens: list[int], keys: list[str], victim: str, cold: tuple) -> None:
    """After B's failed load and recompute: its repair save put every object on a surviving host, and the
    next restore commits with the cold output."""
    deadline = time.monotonic() + 20
    while True:
        where = env.master.placement(keys)
        if all(c and victim not in c for c in where.values()):
            break
        assert time.monotonic() < deadline, f"the repair save did not re-store the prefix on the survivors: {where}"
        time.sleep(0.2)
    resp, _ = _restored(env.b, tokens)
    assert S.cached_tokens(resp) == CHUNKS * U.CHUNK, "the restore after the repair did not commit"
    assert S.completion_tokens(resp) == cold


def test_a_lost_host_without_replicas_fails_the_load_closed_then_the_repair_commits(env):
    tokens = U.prompt(CHUNKS * U.CHUNK + 32, seed=393)
    keys, cold = _saved_by(env.b, env, tokens)  # B's own first prefill: cold, one copy of each object
    victim, _ = _on_host(env, keys)
    host = env.cluster.host_named(victim)
    failed = _counter(env.b, "vllm:bsr_loads_failed_total", cause="missing")
    host.kill()
    try:
        resp, seconds = _restored(env.b, tokens)
        print(f"\nhost {victim} killed before the restore: served in {seconds:.2f} s, "
              f"{S.cached_tokens(resp)} tokens restored")
        assert S.cached_tokens(resp) == 0 and S.completion_tokens(resp) == cold  # failed closed, recomputed
        assert seconds < FETCH_TIMEOUT_S
        assert _counter(env.b, "vllm:bsr_loads_failed_total", cause="missing") == failed + 1
        _repaired(env, tokens, keys, victim, cold)
    finally:
        env.cluster.restart_host(env.cluster.hosts.index(host))
    _levels_zero(env.b)


def test_a_host_lost_during_the_restore_fails_it_closed(env):
    """The host hangs (SIGSTOP) while B's restore reads from it, then dies (SIGKILL): the read that hung
    returns, the load fails closed at once (not at the fetch timeout), B recomputes, the repair commits."""
    tokens = U.prompt(CHUNKS * U.CHUNK + 33, seed=394)
    keys, cold = _saved_by(env.b, env, tokens)
    victim, _ = _on_host(env, keys)
    host = env.cluster.host_named(victim)
    failed = _counter(env.b, "vllm:bsr_loads_failed_total", cause="missing")
    host.pause()
    box: dict = {}
    try:
        assert env.b.post("/reset_prefix_cache")["success"]
        request = threading.Thread(target=lambda: box.setdefault("resp", env.b.complete(tokens)), daemon=True)
        request.start()
        _wait_in_flight(env.b)
        time.sleep(0.5)  # the read hangs on the host
        t0 = time.monotonic()
        host.kill()
        request.join(FETCH_TIMEOUT_S + 15)
        seconds = time.monotonic() - t0
    finally:
        host.kill()
        env.cluster.restart_host(env.cluster.hosts.index(host))
    print(f"\nhost {victim} hung, then killed during the restore: served {seconds:.2f} s after the kill")
    assert "resp" in box, f"B's request hung ({seconds:.1f} s after the host died)"
    assert S.cached_tokens(box["resp"]) == 0 and S.completion_tokens(box["resp"]) == cold
    assert seconds < FETCH_TIMEOUT_S
    assert _counter(env.b, "vllm:bsr_loads_failed_total", cause="missing") == failed + 1
    _repaired(env, tokens, keys, victim, cold)
    _levels_zero(env.b)


def _wait_in_flight(engine: S.VllmServer) -> None:
    deadline = time.monotonic() + 10
    while S.bsr_value(engine.metrics(), "vllm:bsr_loads_in_flight") < 1:
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.05)


def test_a_restarted_master_leaves_every_engine_serving(env):
    tokens = U.prompt(CHUNKS * U.CHUNK + 34, seed=395)
    cold = _cold(env, tokens, "master")
    env.master.kill()
    try:
        for engine in (env.a, env.b):  # the master down: a miss, recomputed, the save fails (counted)
            resp, seconds = _restored(engine, tokens)
            assert S.cached_tokens(resp) == 0 and S.completion_tokens(resp) == cold
            assert seconds < CONNECTOR["timeouts"]["probe_s"] + 5, f"{seconds:.1f} s with the master down"
    finally:
        t = time.monotonic()
        env.master.start()
        env.cluster.wait_mounted()
        print(f"\nmaster restarted; the store hosts mounted again in {time.monotonic() - t:.1f} s")
    deadline = time.monotonic() + 20
    while True:  # A finds the restarted master (empty): a miss, recomputed, saved again
        resp, _ = _restored(env.a, tokens)
        assert S.completion_tokens(resp) == cold
        if len(env.master.keys()) >= CHUNKS:
            break
        assert time.monotonic() < deadline, "engine A never saved into the restarted master"
        time.sleep(0.5)
    deadline = time.monotonic() + 20
    while True:
        resp, _ = _restored(env.b, tokens)
        assert S.completion_tokens(resp) == cold
        if S.cached_tokens(resp) == CHUNKS * U.CHUNK:
            break
        assert time.monotonic() < deadline, "engine B never restored through the restarted master"
        time.sleep(0.5)
    for engine in (env.a, env.b):
        _levels_zero(engine)


def test_soak_two_engines_while_hosts_are_killed_and_restarted(env):
    plan = SoakPlan(duration_s=14, kill_every_s=4, prefix_chunks=4, new_prefix_chunks=2, p_new=0.2, p_abort=0.2)
    figures = run_soak([env.a, env.b], env.cluster, plan, log=print)
    assert figures["lost"] == 0 and not figures["hung_threads"], figures
    assert figures["host_kills"] >= 2 and sum(figures["loads_committed"]) > 0, figures
    # engine B's puts (one copy) placed on a killed host are put again on a live one (without that: 13 failed
    # saves here); engine A's (two copies) too, but with fewer live hosts known than copies the master places
    # the rest, so a save may still fail (10-minute soak: 23 of A's, 2 of B's; this soak beside the rest of the
    # suite: up to 2 of B's). A failed save is a later miss, never wrong KV
    assert figures["saves_failed"][1] <= 4, figures
    assert figures["tokens_identical"] == figures["answered"], figures
    assert figures["levels_at_end"] == [LEVELS_ZERO, LEVELS_ZERO], figures
    assert all(not any(held.values()) for held in figures["engine_at_end"]), figures  # no request, no block held
    assert max(figures["rss_growth_mib"]) < 64, figures
