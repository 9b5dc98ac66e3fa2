"""Fail-closed restores against real tiers: a real mooncake_master (module fixture, plus
dedicated masters with a standalone store host for the scenarios that stop one) and files.

Every failing scenario checks what the engine would see: zero external tokens exposed, every
destination block of the request in every HMA group reported invalid (also the blocks that
earlier windows had already filled, which are shown to hold restored bytes), the request
reported per request (failed_recving), a force-local marker that suppresses the next lookup
and is cleared by RUNNING admission, the staging pool back to full capacity, no thread or
child process left behind, and a healthy request restored next with the right state hash.
"""

from __future__ import annotations

import contextlib
import threading
import time

import psutil
import pytest
import torch

from bsr_harness.fault_matrix import (
    DAMAGE_SCENARIOS,
    EXPECTED,
    SCENARIOS,
    FaultMatrix,
    FaultRow,
    make_source,
    run_fault_matrix,
    store,
)
from bsr_harness.faulty_installer import InstallFault
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.standalone_connector import ConnectorRequest, FinishedIds, StandaloneConnector
from bsr_harness.testdata import block_tables, prefix_block_ids
from bsr_kernels import WindowInstaller, presets
from bsr_runtime import commit
from bsr_runtime.markers import ForceLocalMarkers
from bsr_runtime.plan import plan_windows
from bsr_runtime.restore import RestoreConfig
from bsr_runtime.retrieve import LOCAL, LoadRecord, Retriever, request_block_ids
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier

REG = presets.dsv4_flash(scale=1 / 64)  # 5 HMA groups, four with a sliding window
FAILING = [s for s in SCENARIOS if EXPECTED[s] == "failed_closed" and s not in DAMAGE_SCENARIOS]
# the error of the first (remote) attempt names the fault that fired
FIRST_ERROR = {
    "remote_unavailable_before": ("TierUnavailableError",),
    "remote_unavailable_mid": ("TierUnavailableError", "FetchTimeoutError"),
    "remote_and_ssd_absent": ("TierUnavailableError",),
    "key_evicted_after_probe": ("MissingObjectError",),
    "fetch_timeout": ("FetchTimeoutError",),
    "corrupt_object": ("CorruptObjectError",),
    "install_exception": ("InjectedInstallError",),
    "last_window_fault": ("InjectedFault",),
}
# windows the remote attempt installed before its fault (deterministic: faults at fixed windows)
INSTALLED_BEFORE_FAULT = {
    "remote_unavailable_before": 0, "remote_unavailable_mid": 1, "remote_and_ssd_absent": 0,
    "key_evicted_after_probe": 1, "fetch_timeout": 0, "corrupt_object": 1, "install_exception": 1,
    "last_window_fault": 5,
}


# -- leak checks ---------------------------------------------------------------------------------
def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def _children() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
    return out


@contextlib.contextmanager
def nothing_left_behind(allowed_threads=lambda: set(), settle_s: float = 5.0):
    """No new Python thread (beyond `allowed_threads()`, the module's shared Mooncake client)
    and no new child process survives the block; short-lived threads get `settle_s` to end."""
    threads, children = _threads(), _children()
    yield
    deadline = time.monotonic() + settle_s
    while True:
        extra_threads = _threads() - threads - allowed_threads()
        extra_children = _children() - children
        if not extra_threads and not extra_children:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: threads {[t.name for t in extra_threads]}, "
                                 f"child processes {sorted(extra_children)}")
        time.sleep(0.05)


# -- the fault matrix ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix(mooncake_master, tmp_path_factory):
    with FaultMatrix(REG, tmp_path_factory.mktemp("faults"), mooncake_master, num_chunks=5, long_chunks=12,
                     window_chunks=4, depth=2) as m:
        m.shared_remote()  # the module's shared Mooncake client exists before any leak snapshot
        yield m


def _installed_chunks(cfg: RestoreConfig, n: int, windows: int) -> int:
    wins = list(plan_windows(n, cfg.window_chunks, cfg.pipeline_depth))
    return sum(w.num_chunks for w in wins[:windows])


@pytest.mark.mooncake
@pytest.mark.parametrize("scenario", FAILING)
def test_fault_fails_closed(matrix, scenario):
    with nothing_left_behind(matrix.shared_threads):
        res = matrix.run(scenario)
    row, out = res.row, res.outcome
    rid = out.request_id
    n = res.source.num_chunks
    ct = REG.chunk_tokens
    every_block = prefix_block_ids(REG, res.tables, n)  # the oracle, from the request's tables
    assert len(every_block) == REG.num_groups and all(every_block)

    # the probe advertised the prefix; after the failure none of it is exposed
    assert row.tokens == n * ct
    assert out.outcome == row.outcome == "failed_closed"
    assert not out.committed and not out.agreed
    assert out.exposed_tokens == row.exposed_tokens == 0
    assert out.served_by == row.served_by == LOCAL
    # HMA collapse: every block of the request in every group, including earlier windows' blocks
    assert out.invalid_block_ids == every_block
    assert row.invalid_blocks == row.total_blocks == sum(len(s) for s in every_block)
    assert out.valid_per_group == [False] * REG.num_groups
    assert res.load_errors == set().union(*every_block)
    assert res.failed_recving == {rid} and rid in res.finished_recving

    # the intended fault fired, in the intended window
    remote = out.attempts[0]
    assert remote.tier == "mooncake" and not remote.ok
    assert remote.error.startswith(FIRST_ERROR[scenario]), remote.error
    assert remote.windows_installed == INSTALLED_BEFORE_FAULT[scenario]
    assert remote.windows_installed == row.windows_installed
    if remote.windows_installed:  # those windows really landed, and are still reported invalid
        done = _installed_chunks(res.config, n, remote.windows_installed)
        assert 0 < done < n
        assert state_hash(REG, res.kv, res.tables, done) == res.source.hash_of(done)
    if scenario == "last_window_fault":
        assert remote.windows == 6 and remote.failed_window == 5 and res.partial_prefix_hash_ok

    # tier fallback was tried: the filesystem tier was probed and does not hold the prefix
    fs = [a for a in out.attempts if a.tier == "filesystem"]
    assert len(fs) == 1 and not fs[0].ok and fs[0].probed_chunks == 0

    # force-local marker: set, no lookup while set, cleared by RUNNING admission
    assert row.marker_set and row.probes_while_marked == 0 and row.marker_cleared
    # staging back to full capacity
    assert row.staging_leaked_bytes == 0
    # the next healthy request restores with the right state hash
    h = res.healthy
    assert h is not None and h.committed and h.exposed_tokens == res.healthy_source.num_chunks * ct
    hn = res.healthy_source.num_chunks
    assert state_hash(REG, res.kv, res.healthy_tables, hn) == res.healthy_source.state_hash
    dead_remote = scenario.startswith("remote_") and scenario != "remote_fails_ssd_serves"
    assert h.served_by == ("filesystem" if dead_remote else "mooncake")
    assert row.state_hash_ok and row.passed


@pytest.mark.mooncake
@pytest.mark.parametrize("scenario", DAMAGE_SCENARIOS)
def test_damaged_ssd_object_fails_closed(matrix, scenario):
    """The prefix only on the filesystem tier, one object damaged after the probe."""
    with nothing_left_behind(matrix.shared_threads):
        res = matrix.run(scenario)
    row, out = res.row, res.outcome
    n = res.source.num_chunks
    every_block = prefix_block_ids(REG, res.tables, n)
    assert row.tokens == n * REG.chunk_tokens
    assert out.outcome == row.outcome == "failed_closed" and not out.committed
    assert out.exposed_tokens == row.exposed_tokens == 0 and out.served_by == LOCAL
    assert out.invalid_block_ids == every_block and res.load_errors == set().union(*every_block)
    first = out.attempts[0]
    assert first.tier == "filesystem" and not first.ok
    assert first.error.startswith(("CorruptObjectError", "MissingObjectError")), first.error
    assert row.marker_set and row.probes_while_marked == 0 and row.marker_cleared
    assert row.staging_leaked_bytes == 0 and row.state_hash_ok and row.passed


@pytest.mark.mooncake
def test_remote_fails_filesystem_serves_same_state(matrix):
    with nothing_left_behind(matrix.shared_threads):
        res = matrix.run("remote_fails_ssd_serves")
    row, out = res.row, res.outcome
    n = res.source.num_chunks
    assert out.committed and out.agreed and out.served_by == row.served_by == "filesystem"
    assert out.exposed_tokens == row.tokens == n * REG.chunk_tokens
    assert state_hash(REG, res.kv, res.tables, n) == res.source.state_hash
    remote, fs = out.attempts
    assert remote.tier == "mooncake" and not remote.ok and remote.error.startswith("InjectedFault")
    assert remote.windows_installed == 1  # a partial remote state was overwritten by the fallback
    assert fs.tier == "filesystem" and fs.ok and fs.probed_chunks == n
    assert out.invalid_block_ids == tuple(frozenset() for _ in range(REG.num_groups))
    assert res.load_errors == set() and res.failed_recving == set()
    assert not row.marker_set and row.staging_leaked_bytes == 0 and row.state_hash_ok and row.passed


@pytest.mark.mooncake
def test_healthy_restore_commits(matrix):
    with nothing_left_behind(matrix.shared_threads):
        res = matrix.run("healthy")
    out = res.outcome
    n = res.source.num_chunks
    assert out.committed and out.served_by == "mooncake" and out.exposed_tokens == n * REG.chunk_tokens
    assert [a.tier for a in out.attempts] == ["mooncake"]
    assert state_hash(REG, res.kv, res.tables, n) == res.source.state_hash
    assert res.load_errors == set() and res.failed_recving == set() and not res.row.marker_set


@pytest.mark.mooncake
def test_run_fault_matrix_rows(mooncake_master, tmp_path):
    with nothing_left_behind():
        rows = run_fault_matrix(REG, scenarios=["healthy", "corrupt_object"], workdir=tmp_path,
                                master=mooncake_master, num_chunks=3, window_chunks=2)
    assert [r.scenario for r in rows] == ["healthy", "corrupt_object"]
    fields = {"scenario", "outcome", "tokens", "exposed_tokens", "invalid_blocks", "total_blocks", "marker_set",
              "marker_cleared", "staging_leaked_bytes", "served_by", "state_hash_ok"}
    for r in rows:
        assert isinstance(r, FaultRow) and fields <= set(r.to_dict()) and r.passed, r
    assert rows[0].outcome == "committed" and rows[1].outcome == "failed_closed"
    assert rows[1].invalid_blocks == rows[1].total_blocks > 0 and rows[1].exposed_tokens == 0


# -- connector, markers and the commit rule without Mooncake ------------------------------------------
class _Counted:
    def __init__(self, tier):
        self.calls = 0
        orig = tier.probe

        def probe(keys):
            self.calls += 1
            return orig(keys)

        tier.probe = probe


@pytest.fixture
def fs_setup(tmp_path):
    reg = presets.llama_like(layers=2, kv_heads=2, head_dim=16, block_size=16)
    tier = FaultyTier(FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint))
    src = make_source(reg, 3, seed=5, salt="fs")
    store(src, tier)
    blocks, (tables,) = block_tables(reg, [3], 9)
    kv = reg.allocate(blocks)
    conn = StandaloneConnector(reg, [tier], kv, config=RestoreConfig(window_chunks=1, backend="torch"), salt="fs")
    yield reg, tier, src, tables, kv, conn
    conn.close()
    tier.close()


def test_marker_suppresses_lookup_until_running(fs_setup):
    reg, tier, src, tables, kv, conn = fs_setup
    req = ConnectorRequest("r1", src.tokens)
    tokens, load_async = conn.get_num_new_matched_tokens(req, 0)
    assert tokens == 3 * reg.chunk_tokens and load_async is False
    conn.update_state_after_alloc(req, [t.tolist() for t in tables], tokens)
    tier.plan.corrupt_keys = set(src.keys(2, 1))  # the last window is corrupt
    (out,) = conn.start_load()
    tier.clear()
    assert not out.committed and out.exposed_tokens == 0
    fin = conn.get_finished(set())
    assert isinstance(fin, FinishedIds) and fin.failed_recving == {"r1"}
    sending, recving = fin  # unpacks like vLLM's (finished_sending, finished_recving)
    assert sending == set() and recving == {"r1"}
    assert conn.get_finished(set()) == (set(), set())  # drained
    assert conn.get_block_ids_with_load_errors() == set().union(*prefix_block_ids(reg, tables, 3))
    assert conn.get_block_ids_with_load_errors() == set()

    counted = _Counted(tier)
    assert conn.markers.is_set("r1")
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert counted.calls == 0 and conn.stats.skipped_by_marker == 1  # no lookup against the faulty tier
    conn.update_state_after_alloc(req, [t.tolist() for t in tables], 0)
    assert conn.start_load() == []
    assert conn.on_request_running(req) and not conn.markers.is_set("r1") and len(conn.markers) == 0
    # a later admission (e.g. after preemption) may look the prefix up again and restore it
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    assert counted.calls > 0 and tokens == 3 * reg.chunk_tokens
    conn.update_state_after_alloc(req, [t.tolist() for t in tables], tokens)
    (out,) = conn.start_load()
    assert out.committed and state_hash(reg, kv, tables, 3) == src.state_hash
    assert conn.request_finished(req, [t.tolist() for t in tables]) == (False, None)
    assert conn.outcome("r1") is None
    assert conn.retriever.restorer.staging.live_bytes == 0


def test_marker_cleared_on_teardown(fs_setup):
    reg, tier, src, tables, kv, conn = fs_setup
    req = ConnectorRequest("r2", src.tokens)
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, [t.tolist() for t in tables], tokens)
    conn.retriever.restorer.make_installer = InstallFault(0).make
    (out,) = conn.start_load()
    conn.retriever.restorer.make_installer = WindowInstaller
    assert not out.committed and conn.markers.is_set("r2")
    conn.request_finished_all_groups(req, tuple(t.tolist() for t in tables))
    assert not conn.markers.is_set("r2") and conn.markers.cleared_teardown == 1


def test_probe_is_chunk_aligned_and_leaves_a_token(fs_setup):
    reg, tier, src, tables, kv, conn = fs_setup
    ct = reg.chunk_tokens
    exact = ConnectorRequest("exact", src.tokens[: 3 * ct])  # prompt == prefix: one chunk is left to compute
    assert conn.get_num_new_matched_tokens(exact, 0) == (2 * ct, False)
    partial = ConnectorRequest("partial", src.tokens[: 2 * ct + 100])
    assert conn.get_num_new_matched_tokens(partial, 0) == (2 * ct, False)
    assert conn.get_num_new_matched_tokens(partial, ct) == (ct, False)  # beyond a local hit
    assert conn.get_num_new_matched_tokens(partial, 2 * ct) == (0, False)
    other = ConnectorRequest("other", [7] * (3 * ct + 1))
    assert conn.get_num_new_matched_tokens(other, 0) == (0, False)
    for r in (exact, partial, other):
        conn.request_finished(r)


def test_markers_are_bounded():
    m = ForceLocalMarkers(max_entries=3)
    for i in range(5):
        m.set(f"r{i}")
    assert len(m) == 3 and m.evictions == 2
    assert not m.is_set("r0") and not m.is_set("r1") and m.is_set("r4")
    assert m.clear_on_running("r4") and not m.clear_on_running("r4")
    assert m.clear_on_teardown("r3") and len(m) == 1
    with pytest.raises(ValueError):
        ForceLocalMarkers(max_entries=0)


def test_commit_rule_without_a_process_group():
    assert commit.world_size() == 1
    assert commit.agree([True, True, True]) is True
    assert commit.agree([True, False, True]) is False
    assert commit.agree_local([[True, True], [True, True]]) is True
    assert commit.agree_local([[True, True], [True, False]]) is False
    assert commit.make_tag("a", "commit") != commit.make_tag("a", "plan")


def test_hma_collapse_one_invalid_group_invalidates_every_group():
    reg = presets.dsv4_flash(scale=1 / 64)  # 5 groups: 64, 64, 256, 4 and 8 tokens per block
    tables = [torch.tensor([-1, -1, 3, 5]), torch.tensor([-1, -1, 7, 9]), torch.tensor([0]),
              torch.tensor([-1] * 62 + [11, 12]), torch.tensor([-1] * 16 + list(range(20, 36)))]
    blocks = request_block_ids(reg, tables, 1)
    assert blocks == (frozenset({3, 5}), frozenset({7, 9}), frozenset({0}), frozenset({11, 12}),
                      frozenset(range(20, 36)))  # -1: not resident
    local = LoadRecord("r", 1, 256, [True, False, True, True, True], "mooncake", blocks)
    out = local.decide(True)  # even if every other rank agreed
    assert not out.committed and out.exposed_tokens == 0 and out.invalid_block_ids == blocks
    ok = LoadRecord("r", 1, 256, [True] * 5, "mooncake", blocks).decide(False)
    assert not ok.committed and ok.invalid_block_ids == blocks  # another rank failed



def test_the_outcome_carries_the_ranks_own_cause_else_the_commit_rules():
    """Not committed, the cause is this rank's own (corrupt here), else the commit rule (this rank valid,
    another rank or group not), else the agreement (it raised); committed, none."""
    from bsr_harness.memory_tier import MemoryTier
    from bsr_runtime.causes import FailureCause

    reg = presets.dsv4_flash(scale=1 / 64)
    blocks = request_block_ids(reg, [torch.tensor([g + 2]) for g in range(reg.num_groups)], 1)

    def local(valid: bool = True) -> LoadRecord:
        return LoadRecord("r", 1, 256, [valid] * reg.num_groups, "mooncake", blocks)

    own = local()
    own.fail("mooncake: CorruptObjectError: crc", FailureCause.CORRUPT)
    assert own.decide(False).cause is FailureCause.CORRUPT
    assert local().decide(False).cause is FailureCause.COMMIT_RULE
    assert local().decide(True).cause is None

    def broken(valid, *, timeout_s, tag):
        raise commit.AgreementFailed("the reduction timed out")

    with Retriever(reg, [MemoryTier(reg.chunk_bytes, reg.fingerprint)], agree=broken) as r:
        out = r.commit_local(local())
    assert not out.committed and out.cause is FailureCause.AGREEMENT and "agree: " in out.error
