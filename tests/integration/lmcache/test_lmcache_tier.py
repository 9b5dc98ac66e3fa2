"""BSR inside LMCache 0.5.6's real multiprocess storage stack (StorageManager, L1 manager, prefetch and
store controllers, FS L2 adapter on tmp dirs, the Mooncake L2 plugin against a real mooncake_master),
through the one road in: LMCacheTier under the runtime's store path, BoundedRestorer and Retriever.

No mocks of LMCache. Registration: DeepSeek-V4-Flash geometry at scale 1/1024 (167 tensors, 3
groups, c = 132,032 B), 40 chunks (10,240 tokens) stored once per module. LMCache's L1 usage is
sampled on a thread of its own (`Sampler`), independently of BSR's staging accounting.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")

from kernel_util import random_kv  # noqa: E402
from lmcache_util import chunk_keys, object_path, restore, store  # noqa: E402
from restore_util import random_tables  # noqa: E402

from bsr_harness.testdata import POISON  # noqa: E402
from bsr_kernels import WindowInstaller, gather_window, presets  # noqa: E402
from bsr_kernels.staging_arena import StagingArena  # noqa: E402
from bsr_runtime.integrations.lmcache import (  # noqa: E402
    LMCacheTier,
    build_storage_manager,
    fs_l2_config,
    load_adapter_config,
    mooncake_l2_config,
)
from bsr_runtime.keys import KeySpace, PrefixKeys  # noqa: E402
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest  # noqa: E402
from bsr_runtime.retrieve import Retriever  # noqa: E402
from bsr_runtime.state_hash import state_hash  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REG = presets.dsv4_flash(scale=1 / 1024)
C = REG.chunk_bytes
N = 40
OBJ_4K = -(-C // 4096) * 4096  # LMCache allocates objects at align_up(c, align_bytes)


class Stored:
    def __init__(self, base: str) -> None:
        self.base = base
        gen = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, 50_000, (N * REG.chunk_tokens,), generator=gen).tolist()
        self.space = KeySpace(REG.fingerprint)
        blocks, self.tables = random_tables(REG, N, 11)
        self.kv = random_kv(REG, blocks, 12)
        self.hash = {n: state_hash(REG, self.kv, self.tables, n) for n in (N, 12, 6)}

    def request(self, seed: int, rid: str = "req") -> RestoreRequest:
        blocks, tables = random_tables(REG, N, 100 + seed)
        kv = REG.allocate(blocks)
        for t in kv:
            t.view(torch.uint8).fill_(POISON)
        return RestoreRequest(rid, self.tokens, self.space, kv, tables)

    def keys(self, first: int = 0, count: int = N) -> list[str]:
        return PrefixKeys(self.space, self.tokens, REG.chunk_tokens).window(first, count)


def config(**kw):
    return load_adapter_config(**kw)


class Sampler:
    """Polls LMCache's get_l1_usage() on its own thread."""

    def __init__(self, sm) -> None:
        self.sm = sm
        self.peak = 0
        self.samples = 0
        self._stop, self._started = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sm.get_l1_usage()[0])
            self.samples += 1
            self._started.set()
            time.sleep(0.0002)

    def __enter__(self):
        self._t.start()
        self._started.wait()  # sampling before the work starts
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """N chunks written into an FS L2 directory through the tier's put (LMCache's own write path, small L1)."""
    s = Stored(str(tmp_path_factory.mktemp("lmcache-fs")))
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(s.base)], config()) as tier:
        with Sampler(tier.sm) as sampled:
            rep = store(tier, REG, s.space, s.tokens, s.kv, s.tables, window_chunks=8)
        assert rep.state_hash == s.hash[N]
        assert sampled.peak <= 8 * OBJ_4K  # a put stages one window of objects in L1
        assert tier.l1_usage()[0] == 0  # flushed: everything lives in the FS L2 only
    assert len([f for f in os.listdir(s.base) if f.endswith(".data")]) == N
    return s


@pytest.fixture(scope="module")
def small(stored):
    """L1 of 32 objects (< N): a windowed restore must work, the whole plan cannot fit."""
    with LMCacheTier.create(REG, 32 * OBJ_4K, [fs_l2_config(stored.base)], config()) as tier:
        yield tier


@contextmanager
def moved_aside(path: str):
    aside = path + ".aside"
    shutil.move(path, aside)
    try:
        yield
    finally:
        shutil.move(aside, path)


def all_block_ids(req: RestoreRequest, n: int = N) -> list[list[int]]:
    """Every destination block of the restored prefix, per group (-1 = not resident)."""
    tokens = n * REG.chunk_tokens
    return [sorted(int(b) for b in t[: REG.blocks_needed(g, tokens)].tolist() if b >= 0)
            for g, t in enumerate(req.block_tables)]


# ---------------------------------------------------------------------------------------------
def test_probe_holds_nothing(stored):
    """The tier's probe reports L1 and L2 hits without an allocation or a lock left behind."""
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)], config(evict_retained=False),
                            prefetch_policy="retain") as keeper:
        sm = keeper.sm
        # make chunks 0-1 resident in L1: a fetch under a retaining policy that is told to keep them
        views = [torch.empty(C, dtype=torch.uint8) for _ in range(2)]
        assert keeper.fetch(stored.keys(0, 2), views, time.monotonic() + 30).wait() == 2 * C
        base = sm.get_l1_usage()[0]
        assert base == 2 * OBJ_4K

        with Sampler(sm) as s:
            hits = keeper.probe(stored.keys())
        assert s.peak == base and sm.get_l1_usage()[0] == base  # no allocation, ever
        assert hits == [True] * N

        # the same StorageManager under a tier that evicts what a retaining policy kept: the restore
        # leaves L1 as it found it
        evicting = LMCacheTier(REG, sm, config())
        req = stored.request(seed=5, rid="retain")
        rep = restore(evicting, req, N, 4)
        assert rep.ok, rep.error
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N] and sm.get_l1_usage()[0] == base

        # no lock held: the L1 hits are deletable, and the whole free L1 can be written
        fresh = chunk_keys(keeper, KeySpace(REG.fingerprint, salt="other"), stored.tokens, 0, 6)
        assert len(sm.reserve_write(fresh, keeper.layout)) == 6 and sm.get_l1_usage()[0] == 8 * OBJ_4K
        deleted, skipped = sm.delete_l1_keys(chunk_keys(keeper, stored.space, stored.tokens, 0, 2))
        assert (deleted, skipped) == (2, 0)


@pytest.mark.parametrize("w", [1, 3, 32, 0])
def test_windowed_restore_small_l1(stored, small, w):
    """L1 holds 32 objects, the prefix 40: W > 0 restores hash-equal with LMCache's L1 peak at most
    min(W, N) objects above its baseline; the whole plan (W = 0) gets zero hits from LMCache (its
    all-or-nothing reservation) and fails, having allocated nothing in L1."""
    sm = small.sm
    req = stored.request(seed=w, rid=f"w{w}")
    base = sm.get_l1_usage()[0]
    with Sampler(sm) as s:
        rep = restore(small, req, N, w)
    assert sm.get_l1_usage()[0] == base
    if w == 0:
        assert not rep.ok and rep.committed_tokens == 0 and "LMCache holds 0/40" in rep.error
        assert s.peak == base
        return
    assert rep.ok, rep.error
    assert rep.committed_tokens == N * REG.chunk_tokens
    assert rep.windows == rep.windows_installed == -(-N // w)
    assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
    assert s.peak - base <= min(w, N) * OBJ_4K and s.samples >= 3
    assert rep.peak_staging_bytes == min(w, N) * C  # BSR's staging: W*c


@pytest.mark.parametrize("w", [2, 8])
def test_depth_two_reports_both_windows_loads(stored, small, w):
    """At depth 2 window j+1's prefetch loads its objects into L1 while window j installs: the reported peak
    staging counts both half windows (W chunks' objects, all loaded from L2 here), not one, and stays within
    W*c; LMCache's own L1 peak (sampled) is within the same W objects above its baseline."""
    sm = small.sm
    req = stored.request(seed=90 + w, rid=f"d2-{w}")
    base = sm.get_l1_usage()[0]
    with Sampler(sm) as s, BoundedRestorer(REG, RestoreConfig(window_chunks=w, pipeline_depth=2)) as restorer:
        rep = restorer.restore(req, small, N)
    assert rep.ok, rep.error
    assert rep.windows == -(-N // (w // 2)) and rep.pipeline_depth == 2
    assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
    assert rep.peak_staging_bytes == w * C  # ceil(W/2) + floor(W/2) chunks' loads held together
    assert s.peak - base <= w * OBJ_4K and sm.get_l1_usage()[0] == base


def test_preferred_depth_by_window_size(small):
    """LMCache's per-request work makes depth 2's half windows dear below half windows of 16 MiB: the tier
    prefers depth 1 there and 2 from windows of 32 MiB (what a caller that does not choose gets)."""
    assert [small.preferred_pipeline_depth(mib << 20) for mib in (0, 1, 16, 31, 32, 64, 1024)] == [1, 1, 1, 1, 2, 2, 2]


def test_prefix_eight_times_larger_than_l1(stored):
    """L1 holds 5 objects, the prefix 40 (8x): W = 4 restores it hash-equal, LMCache's own L1
    usage (sampled on another thread throughout) never above one window; W = 0 gets nothing."""
    with LMCacheTier.create(REG, 5 * OBJ_4K, [fs_l2_config(stored.base)], config()) as tier:
        assert tier.l1_usage()[1] < N * OBJ_4K / 8 + OBJ_4K
        req = stored.request(seed=81, rid="eightfold")
        with Sampler(tier.sm) as s:
            rep = restore(tier, req, N, 4)
        assert rep.ok, rep.error
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert s.samples >= 3 and s.peak <= 4 * OBJ_4K
        whole = restore(tier, stored.request(seed=82, rid="eightfold-w0"), N, 0)
        assert not whole.ok and whole.committed_tokens == 0


def test_whole_plan_needs_n_objects_and_is_bit_exact(stored):
    """The capacity ladder's other side: W = 0 passes once L1 holds N objects (L1 aligned to 64 B:
    objects of exactly c)."""
    with LMCacheTier.create(REG, N * C, [fs_l2_config(stored.base)], config(), align_bytes=64) as tier:
        assert tier.l1_object_bytes == C
        req = stored.request(seed=50, rid="whole")
        rep = restore(tier, req, N, 0)
        assert rep.ok, rep.error
        assert rep.windows == 1 and rep.peak_staging_bytes == N * C
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert tier.l1_usage()[0] == 0
        req2 = stored.request(seed=51, rid="windowed")
        rep2 = restore(tier, req2, N, 8)
        assert rep2.ok and rep2.windows == 5 and rep2.peak_staging_bytes == 8 * C
        assert state_hash(REG, req2.kv, req2.block_tables, N) == stored.hash[N]


def test_missing_key_after_probe_fails_closed(stored, small):
    """Chunk 21 evicted between the probe and the restore: window 2 fails, nothing is exposed, every
    destination block of every group is reported invalid, and L1 returns to its baseline."""
    sm = small.sm
    cfg = RestoreConfig(window_chunks=8, pipeline_depth=1)
    with Retriever(REG, [small], cfg, agree=lambda valid, **kw: all(valid)) as retriever:
        plan = retriever.plan(stored.tokens, stored.space)
        assert (plan.num_chunks, plan.tier_index) == (N, 0)
        req = stored.request(seed=60, rid="missing")
        base = sm.get_l1_usage()[0]
        with moved_aside(object_path(small, stored.space, stored.tokens, 21)):
            out = retriever.retrieve(req, plan.num_chunks)
            assert retriever.plan(stored.tokens, stored.space).num_chunks == 21
    assert not out.committed and out.exposed_tokens == 0 and out.outcome == "failed_closed"
    assert [sorted(ids) for ids in out.invalid_block_ids] == all_block_ids(req)  # partial installs too
    (attempt,) = out.attempts
    assert attempt.failed_window == 2 and attempt.windows_installed == 2 and "missing" in attempt.error
    assert sm.get_l1_usage()[0] == base  # chunks 16..20 of window 2 were loaded, then released


def test_fetch_timeout_fails_closed_and_late_objects_are_released(stored, small, monkeypatch):
    sm = small.sm
    base = sm.get_l1_usage()[0]
    (_, plugin), = sm.l2_adapters()
    load_one = plugin._load_one

    def slow_load_one(key, obj):  # the prefetch surely misses a 1 ms deadline, whoever holds the GIL
        time.sleep(0.02)
        return load_one(key, obj)

    monkeypatch.setattr(plugin, "_load_one", slow_load_one)
    impatient = LMCacheTier(REG, sm, config(prefetch_timeout_s=5.0))
    req = stored.request(seed=65, rid="late")
    rep = restore(impatient, req, N, 8, fetch_timeout_s=1e-6)
    assert not rep.ok and rep.failed_window == 0 and "missed its deadline" in rep.error
    assert rep.committed_tokens == 0

    def settled():  # the late prefetch ran, its result was taken and its objects released
        st = sm.report_status()["prefetch_controller"]
        busy = st["submission_queue_size"] + st["pending_queue_size"] + st["in_flight_request_count"]
        return busy == 0 and st["completed_results_count"] == 0 and sm.get_l1_usage()[0] == base

    deadline = time.monotonic() + 20
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled()
    impatient.close()  # joins the thread that released the late prefetch (the StorageManager is small's)
    monkeypatch.setattr(plugin, "_load_one", load_one)
    assert restore(small, stored.request(seed=66), N, 8).ok


def test_unexpected_install_error_fails_closed_and_releases_everything(stored, small):
    """A failure of no usual kind (a KeyError inside the install of window 1, from an installer
    factory) fails the restore, returns L1 usage to its baseline and every budget byte."""

    class Flaky(WindowInstaller):
        def install(self, view, first, count):
            if first >= 8:
                raise KeyError("no such tensor")
            return super().install(view, first, count)

    budget = StagingArena(C, 8)
    base = small.sm.get_l1_usage()[0]
    req = stored.request(seed=67, rid="keyerror")
    cfg = RestoreConfig(window_chunks=8, pipeline_depth=1)
    with BoundedRestorer(REG, cfg, arena=budget, make_installer=Flaky) as restorer, Sampler(small.sm) as s:
        rep = restorer.restore(req, small, N)
    assert not rep.ok and rep.committed_tokens == 0 and "KeyError" in rep.error
    assert rep.failed_window == 1 and rep.windows_installed == 1
    assert small.sm.get_l1_usage()[0] == base and s.peak - base <= 8 * OBJ_4K
    assert budget.live_bytes == 0 and budget.peak_bytes == 8 * C
    with BoundedRestorer(REG, cfg, arena=budget) as restorer:
        ok = restorer.restore(stored.request(seed=68, rid="after"), small, N)
    assert ok.ok and budget.live_bytes == 0 and small.sm.get_l1_usage()[0] == base


def test_put_that_fails_midway_aborts_its_reservations(stored, tmp_path):
    """A copy into the reserved L1 objects failing (a view one byte short) raises; the put's L1
    reservations are aborted (L1 usage back to 0) and nothing reaches L2."""
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(str(tmp_path))], config()) as tier:
        keys = stored.keys(0, 4)
        views = [torch.zeros(C, dtype=torch.uint8) for _ in range(3)] + [torch.zeros(C - 1, dtype=torch.uint8)]
        with pytest.raises(RuntimeError):
            tier.put(keys, views)
        assert tier.l1_usage()[0] == 0 and tier.probe(keys) == [False] * 4
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".data")]
        rep = store(tier, REG, stored.space, stored.tokens, stored.kv, stored.tables, 12, window_chunks=4)
        assert rep.state_hash == stored.hash[12] and tier.l1_usage()[0] == 0


def test_config_from_lmcache_env(stored, monkeypatch):
    monkeypatch.setenv("LMCACHE_FS_LOAD_CONCURRENCY", "3")
    monkeypatch.setenv("LMCACHE_PREFETCH_TIMEOUT_S", "7.5")
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)]) as tier:
        assert (tier.config.fs_load_concurrency, tier.config.prefetch_timeout_s) == (3, 7.5)
        assert tier.sm.l2_adapters()[0][1].load_concurrency == 3
        req = stored.request(seed=70)
        rep = restore(tier, req, N, 7)
        assert rep.ok and rep.windows == 6 and rep.peak_staging_bytes == 7 * C
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
    monkeypatch.setenv("LMCACHE_PREFETCH_WINDOW_CHUNKS", "8")  # the retired adapter road's W
    with pytest.raises(ValueError, match="prefetch_window_chunks"):
        LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)])


def test_fs_load_concurrency_same_bits_and_bytes(stored):
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    results = {}
    for conc in (1, 4):
        l2 = [fs_l2_config(stored.base, load_concurrency=conc)]
        with LMCacheTier.create(REG, 16 * OBJ_4K, l2, config()) as tier:
            sm = tier.sm
            keys = chunk_keys(tier, stored.space, stored.tokens, 0, 12)
            assert sm.l2_adapters()[0][1].load_concurrency == conc
            req = stored.request(seed=80 + conc)
            rep = restore(tier, req, N, 16)
            assert rep.ok and state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
            path = str(sm.l2_adapters()[0][1]._key_to_path(keys[5]))
            with moved_aside(path):  # one load of the task fails: its bit alone is clear
                h = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, tier.layout)],
                                                             fetching_policy="full"))
                assert sm.wait_prefetch_status(h, 30)
                r = sm.query_prefetch_status(h)
            hit = r.hit_cells[0].get_indices_list()
            hit_keys = [keys[i] for i in hit]
            with sm.read_prefetched_results(hit_keys) as objs:
                data = [bytes(o.byte_array) for o in objs]
            sm.finish_read_prefetched(hit_keys)
            assert sm.get_l1_usage()[0] == 0
            results[conc] = (hit, data)
    assert results[1][0] == results[4][0] == [i for i in range(12) if i != 5]
    assert results[1][1] == results[4][1]


def _restore_at_once(tier, reqs, restore_one):
    """Each request restored on a thread of its own, all started together: their reports, and the peak
    of LMCache's L1 usage meanwhile."""
    reps = [None] * len(reqs)

    def run(i):
        reps[i] = restore_one(reqs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    with Sampler(tier.sm) as s:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return reps, s.peak


def test_admission_serializes_concurrent_restores(stored):
    """Two requests at once on an L1 of one window: the staging arena of B = W*c bytes they share admits
    one window at a time, so both restore (without it the second prefetch would find L1 full)."""
    w = 8
    budget = StagingArena(C, w)
    cfg = RestoreConfig(window_chunks=w, pipeline_depth=1)
    with LMCacheTier.create(REG, w * OBJ_4K, [fs_l2_config(stored.base)], config()) as tier:
        reqs = [stored.request(seed=90 + i, rid=f"c{i}") for i in range(2)]

        def restore_one(req):
            with BoundedRestorer(REG, cfg, arena=budget) as restorer:
                return restorer.restore(req, tier, N)

        reps, l1_peak = _restore_at_once(tier, reqs, restore_one)
        for rep, req in zip(reps, reqs):
            assert rep.ok, rep.error
            assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert l1_peak <= w * OBJ_4K and budget.peak_bytes <= w * C and tier.l1_usage()[0] == 0


# ---------------------------------------------------------------------------------------------
# Mooncake L2 plugin against a real mooncake_master
# ---------------------------------------------------------------------------------------------
class Buffer:
    """A host buffer in the shape of an L1 MemoryObj for the plugin's load (data_ptr, get_size,
    get_physical_size)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.data_ptr = t.data_ptr()

    def get_size(self) -> int:
        return self.t.numel()

    def get_physical_size(self) -> int:
        return self.t.numel()  # no padding: each buffer its own tensor


def mc_l2(master, **kw):
    kw.setdefault("global_segment_size", 64 << 20)
    kw.setdefault("connect_timeout_s", 5.0)
    kw.setdefault("rpc_timeout_s", 2.0)
    return mooncake_l2_config(master.master_address, master.metadata_server, **kw)


@contextmanager
def unreachable(plugin):
    """Every store operation of the Mooncake plugin fails as with the master gone (from outside:
    the plugin reaches its client only through its MooncakeTier's `_live_store()`)."""
    from bsr_runtime.tiers.base import TierUnavailableError

    def down():
        raise TierUnavailableError("Mooncake store unreachable (injected)")

    plugin._tier._live_store = down
    try:
        yield
    finally:
        del plugin._tier._live_store


@pytest.mark.mooncake
def test_mooncake_plugin_round_trip(stored, mooncake_master):
    n = 12
    with LMCacheTier.create(REG, 4 * OBJ_4K, [mc_l2(mooncake_master)], config()) as tier:
        plugin = tier.sm.l2_adapters()[0][1]
        assert type(plugin).__name__ == "BSRMooncakeL2Adapter" and plugin.report_status()["l1_registered"]
        rep = store(tier, REG, stored.space, stored.tokens, stored.kv, stored.tables, n, window_chunks=4)
        assert rep.state_hash == stored.hash[n] and tier.l1_usage()[0] == 0
        assert tier.probe(stored.keys(0, n + 1)) == [True] * n + [False] and not plugin.locked_keys()
        req = stored.request(seed=110, rid="mc")
        r = restore(tier, req, n, 4)
        assert r.ok, r.error
        assert r.windows == 3 and tier.l1_usage()[0] == 0
        assert state_hash(REG, req.kv, req.block_tables, n) == stored.hash[n]
        assert not plugin.locked_keys()

        # the plugin's load semantics, straight through its L2 interface: one bit per key, a
        # missing key is a clear bit, the bytes land in the caller's buffers
        chunk3 = torch.empty(C, dtype=torch.uint8)
        gather_window(chunk3, REG, stored.kv, stored.tables, 3, 1, backend="torch")
        bufs = [torch.zeros(C, dtype=torch.uint8) for _ in range(2)]
        okeys = chunk_keys(tier, stored.space, stored.tokens, 3, 1) + chunk_keys(tier, stored.space, stored.tokens,
                                                                                 n + 1, 1)
        task = plugin.submit_load_task(okeys, [Buffer(b) for b in bufs])
        deadline = time.monotonic() + 20
        while (bits := plugin.query_load_result(task)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bits is not None and bits.get_indices_list() == [0]
        assert torch.equal(bufs[0], chunk3) and not bufs[1].any()

        with unreachable(plugin):  # the tier cannot reach the store
            bad = restore(tier, stored.request(seed=111, rid="mc-down"), n, 4)
        assert not bad.ok and bad.committed_tokens == 0 and tier.l1_usage()[0] == 0
        assert restore(tier, stored.request(seed=112), n, 4).ok


@pytest.mark.mooncake
def test_mooncake_master_stopped_fails_closed(stored):
    from bsr_harness.mooncake_launcher import MooncakeMaster

    n = 6
    with MooncakeMaster() as master:
        with LMCacheTier.create(REG, 4 * OBJ_4K, [mc_l2(master)], config()) as tier:
            rep = store(tier, REG, stored.space, stored.tokens, stored.kv, stored.tables, n, window_chunks=3)
            assert rep.state_hash == stored.hash[n]
            master.stop()
            req = stored.request(seed=120, rid="mc-stopped")
            t = time.monotonic()
            rep = restore(tier, req, n, 3)
            assert time.monotonic() - t < 30
            assert not rep.ok and rep.committed_tokens == 0
            assert tier.l1_usage()[0] == 0
            master.restart()  # a Mooncake client closes in ~10 s when its master is gone; ~2 s when it is back


@pytest.mark.parametrize("temporary", [True, False])
def test_lmcache_tier_fetch_leaves_l2_loads_to_the_default_policy(tmp_path, temporary, monkeypatch):
    """Put 6 objects, fetch them into poisoned views; the bytes come back, L1 returns to its baseline,
    and the L2-loaded keys are deleted per fetch only when the tier cannot tell that LMCache frees them
    (LMCache's default prefetch policy frees what it loaded from L2 when the read finishes)."""
    sm = build_storage_manager(16 * OBJ_4K, [fs_l2_config(str(tmp_path))])
    tier = LMCacheTier(REG, sm, config(), l2_loads_are_temporary=temporary)
    try:
        gen = torch.Generator().manual_seed(72)
        src = [torch.randint(0, 256, (C,), dtype=torch.uint8, generator=gen) for _ in range(6)]
        keys = [f"bsr-tier-test-{i}-r0of1-" for i in range(6)]
        tier.put(keys, src)
        deletes = []
        delete = sm.delete_l1_keys
        monkeypatch.setattr(sm, "delete_l1_keys",
                            lambda ks, *a, **k: deletes.append(len(ks)) or delete(ks, *a, **k))
        base = sm.get_l1_usage()[0]
        dst = [torch.full((C,), POISON, dtype=torch.uint8) for _ in range(6)]
        assert tier.fetch(keys[:3], dst[:3], time.monotonic() + 30).wait() == 3 * C
        assert tier.fetch(keys[3:], dst[3:], time.monotonic() + 30).wait() == 3 * C
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        assert sm.get_l1_usage()[0] == base
        assert deletes == ([] if temporary else [3, 3])
    finally:
        tier.close()
        sm.close()  # the tier does not own it
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(str(tmp_path))], config()) as made:
        assert made.l2_loads_are_temporary



# ---------------------------------------------------------------------------------------------
# The restore installs from LMCache's L1 objects (no copy into BSR's staging first)
# ---------------------------------------------------------------------------------------------
class RecordingInstaller(WindowInstaller):
    """Records where each install reads from: (first byte address, last byte address + 1)."""

    reads: list[tuple[int, int]] = []

    def install(self, view, first, count):
        last = view[-1] if view.dim() == 2 else view[-C:]
        type(self).reads.append((view.data_ptr(), last.data_ptr() + C))
        return super().install(view, first, count)


@pytest.mark.parametrize("w", [8, 0])
def test_restore_installs_straight_from_l1(stored, w, monkeypatch):
    """Every install reads LMCache's L1 arena, never BSR's staging pool (which is never leased), and the
    report counts the L1 objects the restore made LMCache load for a window: W*c, their padding as room."""
    monkeypatch.setattr(RecordingInstaller, "reads", [])
    with LMCacheTier.create(REG, N * OBJ_4K, [fs_l2_config(stored.base)], config()) as tier:
        l1 = tier.sm.l1_memory_desc
        req = stored.request(seed=130 + w, rid=f"inplace{w}")
        cfg = RestoreConfig(window_chunks=w, pipeline_depth=1)
        with BoundedRestorer(REG, cfg, make_installer=RecordingInstaller) as restorer:
            rep = restorer.restore(req, tier, N)
            assert rep.ok, rep.error
            assert restorer.staging is None or restorer.staging.peak_bytes == 0  # no staging ever leased
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        reads = RecordingInstaller.reads
        assert len(reads) >= (-(-N // w) if w else 1)  # one install or more per window
        assert all(l1.ptr <= lo < hi <= l1.ptr + l1.size for lo, hi in reads), (reads, l1.ptr, l1.size)
        objects = w or N
        assert rep.peak_staging_bytes == objects * C and rep.header_room_bytes == objects * (OBJ_4K - C)
        assert tier.l1_usage()[0] == 0


def test_damaged_l2_object_fails_closed_with_nothing_installed(stored, small):
    """A flipped payload byte in chunk 3's FS object (its header keeps the old CRC): the plugin's check
    refuses it, the first window fails, no destination byte changes, L1 and the budget come back."""
    from bsr_runtime.integrations.lmcache.fs_l2_object import HEADER_SIZE

    path = object_path(small, stored.space, stored.tokens, 3)
    with open(path, "rb") as f:
        original = f.read()
    damaged = bytearray(original)
    damaged[HEADER_SIZE + C // 2] ^= 0xFF
    budget = StagingArena(C, 8)
    base = small.sm.get_l1_usage()[0]
    req = stored.request(seed=140, rid="damaged-l2")
    try:
        with open(path, "wb") as f:
            f.write(damaged)
        with BoundedRestorer(REG, RestoreConfig(window_chunks=8, pipeline_depth=1), arena=budget) as restorer:
            rep = restorer.restore(req, small, N)
    finally:
        with open(path, "wb") as f:
            f.write(original)
    assert not rep.ok and rep.committed_tokens == 0 and "MissingObjectError" in rep.error
    assert rep.failed_window == 0 and rep.windows_installed == 0
    assert all(bool((t.view(torch.uint8) == POISON).all()) for t in req.kv)  # nothing installed
    assert small.sm.get_l1_usage()[0] == base and budget.live_bytes == 0


class ShortObject:
    raw_tensor = torch.zeros(C - 1, dtype=torch.uint8)


@pytest.mark.parametrize("damage", ["absent", "short"])
def test_damaged_l1_object_fails_closed_with_nothing_installed(stored, small, damage, monkeypatch):
    """LMCache hands back one object of the first window absent or shorter than a chunk: the window fails
    before any of its objects is installed, its read locks and loads are returned, and the next restore
    through the same L1 succeeds."""
    sm = small.sm
    read = sm.read_prefetched_results

    @contextmanager
    def one_damaged(keys, owners=None):
        with read(keys, owners) as objs:
            if objs is not None and keys[0] == chunk_keys(small, stored.space, stored.tokens, 0, 1)[0]:
                objs = list(objs)
                objs[2] = None if damage == "absent" else ShortObject()
            yield objs

    base = sm.get_l1_usage()[0]
    req = stored.request(seed=150, rid=f"damaged-l1-{damage}")
    monkeypatch.setattr(sm, "read_prefetched_results", one_damaged)
    rep = restore(small, req, N, 8)
    monkeypatch.setattr(sm, "read_prefetched_results", read)
    assert not rep.ok and rep.committed_tokens == 0 and "CorruptObjectError" in rep.error
    assert rep.failed_window == 0 and rep.windows_installed == 0
    assert all(bool((t.view(torch.uint8) == POISON).all()) for t in req.kv)  # nothing installed
    assert sm.get_l1_usage()[0] == base
    ok = stored.request(seed=151, rid="after-damage")
    assert restore(small, ok, N, 8).ok and state_hash(REG, ok.kv, ok.block_tables, N) == stored.hash[N]


def test_concurrent_restores_over_a_shared_arena_install_from_l1(stored):
    """The connector's road (a StagingArena shared by concurrent restores, B = one window): three restores
    of the prefix at once through one LMCache tier whose L1 holds one window. Each window still reserves
    its W*c of B, so B bounds what the windows pin in L1 (without it the prefetches would find L1 full or
    the same keys being loaded by another restore); every restore installs from L1 and is hash-equal,
    B and L1 come back."""
    from bsr_kernels.staging_arena import StagingArena

    w = 4
    arena = StagingArena(C, w)
    cfg = RestoreConfig(window_chunks=w, pipeline_depth=1)
    reqs = [stored.request(seed=160 + i, rid=f"arena{i}") for i in range(3)]
    with LMCacheTier.create(REG, w * OBJ_4K, [fs_l2_config(stored.base)], config()) as tier, \
            BoundedRestorer(REG, cfg, arena=arena) as restorer:
        reps, l1_peak = _restore_at_once(tier, reqs, lambda req: restorer.restore(req, tier, N))
        for rep, req in zip(reps, reqs):
            assert rep.ok, rep.error
            assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
            assert rep.peak_staging_bytes == w * C
        assert l1_peak <= w * OBJ_4K and arena.peak_bytes == w * C
        assert arena.live_bytes == 0 and tier.l1_usage()[0] == 0
    arena.close()


def test_tier_floor_reads_every_window_and_raises_on_a_missing_object(stored, small):
    """The tier's own floor through LMCache (bsr_harness/tier_floor.py, printed by bsr wlaw beside BSR's
    seconds): every window of the prefix prefetched, read and released at each W, L1 back to its baseline;
    a chunk gone from L2 raises instead of giving a time."""
    from bsr_harness.tier_floor import tier_floor

    keys = PrefixKeys(stored.space, stored.tokens, REG.chunk_tokens)
    base = small.sm.get_l1_usage()[0]
    out = tier_floor(small, keys, N, [4, 8], repeat=2)
    assert sorted(out) == [4, 8] and all(s > 0 for s in out.values())
    assert small.sm.get_l1_usage()[0] == base
    with moved_aside(object_path(small, stored.space, stored.tokens, 13)), pytest.raises(Exception, match="missing"):
        tier_floor(small, keys, N, [8], repeat=1)
    assert small.sm.get_l1_usage()[0] == base
