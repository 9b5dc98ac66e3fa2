"""The windowed retrieve on the in-memory tier: bound, state hash, probe, failures."""

from __future__ import annotations

import pytest
import torch
from restore_util import fresh_request, store_random_prefix

from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.plan import count_windows, plan_windows, window_sizes
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.state_hash import state_hash

REGS = {
    "dsv4": lambda: presets.dsv4_flash(scale=1 / 64),
    "llama": lambda: presets.llama_like(layers=2, kv_heads=2, head_dim=16, block_size=16),
}


@pytest.fixture(scope="module", params=sorted(REGS))
def stored(request):
    reg = REGS[request.param]()
    tier = FaultyTier(MemoryTier(reg.chunk_bytes, reg.fingerprint))
    return tier, store_random_prefix(reg, tier, num_chunks=7, seed=3)


@pytest.mark.parametrize("w", [0, 1, 3, 32])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n", [6, 7])
def test_restore_bound_and_state(stored, w, depth, n):
    tier, sp = stored
    reg = sp.reg
    req = fresh_request(sp, seed=w * 10 + depth)
    restorer = BoundedRestorer(reg, RestoreConfig(window_chunks=w, pipeline_depth=depth))
    rep = restorer.restore(req, tier, n)
    assert rep.ok, rep.error
    assert rep.committed_tokens == n * reg.chunk_tokens
    assert rep.windows == rep.windows_installed == count_windows(n, w, depth)
    assert rep.bytes_moved == n * reg.chunk_bytes
    expect_peak = (min(w, n) if w else n) * reg.chunk_bytes
    assert rep.peak_staging_bytes == expect_peak
    if n == sp.num_chunks:
        assert state_hash(reg, req.kv, req.block_tables, n) == sp.state_hash
    else:  # a shorter confirmed prefix restores exactly that many chunks
        got = state_hash(reg, req.kv, req.block_tables, n)
        assert got != sp.state_hash
    if restorer.staging is not None:
        assert restorer.staging.live_bytes == 0


def test_plan_windows_cover_the_prefix_once():
    for n in range(0, 40):
        for w in (0, 1, 2, 3, 5, 8, 32):
            for depth in (1, 2):
                wins = list(plan_windows(n, w, depth))
                assert len(wins) == count_windows(n, w, depth)
                covered = [c for win in wins for c in range(win.first_chunk, win.first_chunk + win.num_chunks)]
                assert covered == list(range(n))
                sizes = window_sizes(max(w, 1), depth)
                for a, b in zip(wins, wins[1:]):  # two consecutive (possibly live) windows fit in W
                    assert w == 0 or a.num_chunks + b.num_chunks <= max(w, 1) or len(sizes) == 1
                assert all(w == 0 or win.num_chunks <= sizes[win.index % len(sizes)] for win in wins)


@pytest.mark.parametrize("bad", [dict(window_chunks=-1), dict(window_chunks=1 << 20),
                                 dict(window_chunks=2.5), dict(pipeline_depth=3),
                                 dict(fetch_timeout_s=0)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        RestoreConfig(**bad)


def test_probe_holds_no_staging_and_counts_the_prefix(stored):
    tier, sp = stored
    restorer = BoundedRestorer(sp.reg, RestoreConfig(window_chunks=4))
    keys = PrefixKeys(sp.keyspace, sp.tokens + [1] * sp.reg.chunk_tokens, sp.reg.chunk_tokens)
    restorer.staging.reset_peak()
    res = probe_prefix(tier, keys)
    assert res.prefix_chunks == sp.num_chunks and res.hits == sp.num_chunks
    assert res.bitmap == b"\1" * sp.num_chunks + b"\0"
    assert restorer.staging.live_bytes == 0 and restorer.staging.peak_bytes == 0


def test_probe_bitmap_has_holes_and_prefix_stops_at_first_miss(stored):
    tier, sp = stored
    keys = PrefixKeys(sp.keyspace, sp.tokens, sp.reg.chunk_tokens)
    victim = keys.window(2, 1)
    saved = tier._store.pop(victim[0])
    try:
        res = probe_prefix(tier, PrefixKeys(sp.keyspace, sp.tokens, sp.reg.chunk_tokens))
        assert res.prefix_chunks == 2
        assert res.bitmap[2] == 0 and res.hits == sp.num_chunks - 1
    finally:
        tier._store[victim[0]] = saved


def test_other_registration_or_tenant_probes_as_a_miss(stored):
    tier, sp = stored
    other = presets.dsv4_flash(mtp=True, scale=1 / 64)
    for space in (KeySpace(other.fingerprint), KeySpace(sp.keyspace.fingerprint, salt="tenant-b"),
                  KeySpace(sp.keyspace.fingerprint, tp_rank=1, tp_world=2)):
        res = probe_prefix(tier, PrefixKeys(space, sp.tokens, sp.reg.chunk_tokens))
        assert res.prefix_chunks == 0 and res.hits == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_missing_key_fails_and_releases_everything(stored, depth):
    tier, sp = stored
    keys = PrefixKeys(sp.keyspace, sp.tokens, sp.reg.chunk_tokens)
    victim = keys.window(5, 1)[0]
    saved = tier._store.pop(victim)
    try:
        restorer = BoundedRestorer(sp.reg, RestoreConfig(window_chunks=2, pipeline_depth=depth))
        rep = restorer.restore(fresh_request(sp, seed=1), tier, sp.num_chunks)
        assert not rep.ok and rep.committed_tokens == 0
        assert "MissingObjectError" in rep.error
        assert rep.failed_window == (2 if depth == 1 else 5)  # chunk 5: window 2 of [2,2,2,1], 5 of [1,1,..]
        assert restorer.staging.live_bytes == 0
    finally:
        tier._store[victim] = saved


def test_bad_destinations_rejected_before_any_fetch(stored):
    tier, sp = stored
    req = fresh_request(sp, seed=2)
    req.block_tables[0] = req.block_tables[0][:1]
    restorer = BoundedRestorer(sp.reg, RestoreConfig(window_chunks=2))
    calls = []
    tier.plan.fail_fetch = calls.append
    try:
        with pytest.raises(ValueError, match="too short"):
            restorer.restore(req, tier, sp.num_chunks)
    finally:
        tier.clear()
    assert calls == []


def test_budget_must_hold_one_window():
    reg = REGS["llama"]()
    with pytest.raises(ValueError, match="exceeds the staging budget"):
        BoundedRestorer(reg, RestoreConfig(window_chunks=4), arena=StagingArena(reg.chunk_bytes, 3))


def test_byte_budget_restore_respects_b(stored):
    tier, sp = stored
    budget = StagingArena(sp.reg.chunk_bytes, 3)
    restorer = BoundedRestorer(sp.reg, RestoreConfig(window_chunks=3, pipeline_depth=2), arena=budget)
    req = fresh_request(sp, seed=4)
    rep = restorer.restore(req, tier, sp.num_chunks)
    assert rep.ok, rep.error
    assert budget.live_bytes == 0 and 0 < budget.peak_bytes <= budget.capacity_bytes
    assert state_hash(sp.reg, req.kv, req.block_tables, sp.num_chunks) == sp.state_hash


def test_staging_bytes_never_above_capacity_in_flight(stored):
    """Sample the staging meter from inside the fetch of every window."""
    tier, sp = stored
    restorer = BoundedRestorer(sp.reg, RestoreConfig(window_chunks=3, pipeline_depth=2))
    seen = []
    tier.plan.fail_fetch = lambda keys: seen.append(restorer.staging.live_bytes)
    try:
        rep = restorer.restore(fresh_request(sp, seed=5), tier, sp.num_chunks)
    finally:
        tier.clear()
    assert rep.ok
    assert seen and max(seen) <= 3 * sp.reg.chunk_bytes
    assert torch.tensor(seen).max().item() == 3 * sp.reg.chunk_bytes  # both windows live at once


def test_the_whole_plan_moves_the_same_bytes_through_the_same_calls_as_one_window(tmp_path):
    """The baseline (W = 0) at its best: staging for the largest prefix allocated and touched once,
    before any restore, and the same fetch and install calls as one window of N chunks (counted)."""
    from bsr_kernels import WindowInstaller
    from bsr_runtime.tiers import FilesystemTier

    reg = REGS["dsv4"]()
    calls: list[tuple] = []

    class Counted(FilesystemTier):
        def fetch(self, keys, views, deadline, *, headroom=0):
            calls.append(("fetch", len(keys), sum(v.numel() for v in views), headroom))
            return super().fetch(keys, views, deadline, headroom=headroom)

    class CountedInstaller(WindowInstaller):
        def install(self, staging, first_chunk, num_chunks):
            calls.append(("install", first_chunk, num_chunks, staging.numel()))
            return super().install(staging, first_chunk, num_chunks)

    n = 7
    with Counted(tmp_path, reg.chunk_bytes, reg.fingerprint) as tier:
        sp = store_random_prefix(reg, tier, num_chunks=n, seed=5)
        seen = {}
        for w, cap in ((0, n * reg.chunk_bytes), (n, None)):
            cfg = RestoreConfig(window_chunks=w, max_staging_bytes=cap)
            with BoundedRestorer(reg, cfg, make_installer=CountedInstaller) as restorer:
                assert restorer.staging_capacity_bytes == n * reg.chunk_bytes  # allocated before any restore
                buffer = restorer.staging.buffer.data_ptr()
                for rep_i in range(2):
                    calls.clear()
                    req = fresh_request(sp, seed=rep_i)
                    rep = restorer.restore(req, tier, n)
                    assert rep.ok and state_hash(reg, req.kv, req.block_tables, n) == sp.state_hash
                    assert restorer.staging.buffer.data_ptr() == buffer  # not a fresh pool per restore
                seen[w] = (list(calls), rep.bytes_moved, rep.peak_staging_bytes)
        assert seen[0] == seen[n], "the whole plan took another path than one window of N chunks"
