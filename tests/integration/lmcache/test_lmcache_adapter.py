"""BSR inside LMCache 0.5.6's real multiprocess storage stack (StorageManager, L1 manager, prefetch and
store controllers, FS L2 adapter on tmp dirs, the Mooncake L2 plugin against a real mooncake_master).

No mocks of LMCache. Registration: DeepSeek-V4-Flash geometry at scale 1/1024 (167 tensors, 3
groups, c = 132,032 B), 40 chunks (10,240 tokens) stored once per module.
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
from restore_util import random_tables  # noqa: E402

from bsr_harness.testdata import POISON  # noqa: E402
from bsr_kernels import gather_window, presets  # noqa: E402
from bsr_runtime.admission import ByteBudget  # noqa: E402
from bsr_runtime.integrations.lmcache import (  # noqa: E402
    LMCacheAdapter,
    LMCacheKeys,
    build_storage_manager,
    fs_l2_config,
    load_adapter_config,
    mooncake_l2_config,
)
from bsr_runtime.keys import KeySpace  # noqa: E402
from bsr_runtime.restore import RestoreRequest  # noqa: E402
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

    def key(self, chunk: int):
        return LMCacheKeys(self.space, self.tokens, REG.chunk_tokens).window(chunk, 1)[0]


def config(**kw):
    return load_adapter_config(**kw)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """N chunks written into an FS L2 directory through LMCache's own write path (small L1)."""
    s = Stored(str(tmp_path_factory.mktemp("lmcache-fs")))
    with LMCacheAdapter.create(REG, 8 * OBJ_4K, [fs_l2_config(s.base)], config(window_chunks=8)) as ad:
        rep = ad.store(s.space, s.tokens, s.kv, s.tables)
        assert rep.state_hash == s.hash[N]
        assert rep.peak_staging_bytes <= 8 * OBJ_4K
        assert ad.l1_usage()[0] == 0  # flushed: everything lives in the FS L2 only
    assert len([f for f in os.listdir(s.base) if f.endswith(".data")]) == N
    return s


@pytest.fixture(scope="module")
def small(stored):
    """L1 of 32 objects (< N): a windowed retrieve must work, the whole plan cannot fit."""
    with LMCacheAdapter.create(REG, 32 * OBJ_4K, [fs_l2_config(stored.base)], config()) as ad:
        yield ad


class Sampler:
    """Polls LMCache's get_l1_usage() on its own thread, independently of the adapter's tracker."""

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
        self._started.wait()  # sampling before the retrieve starts
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


@contextmanager
def moved_aside(path: str):
    aside = path + ".aside"
    shutil.move(path, aside)
    try:
        yield
    finally:
        shutil.move(aside, path)


class Markers:
    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def set(self, request_id: str, reason: str = "") -> None:
        self.reasons[request_id] = reason


def all_block_ids(req: RestoreRequest, n: int = N) -> list[list[int]]:
    """Every destination block of the restored prefix, per group (-1 = not resident)."""
    tokens = n * REG.chunk_tokens
    return [sorted(int(b) for b in t[: REG.blocks_needed(g, tokens)].tolist() if b >= 0)
            for g, t in enumerate(req.block_tables)]


# ---------------------------------------------------------------------------------------------
def test_probe_only_holds_nothing(stored):
    with LMCacheAdapter.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)], config(probe_only=True),
                               prefetch_policy="retain") as ad:
        sm = ad.sm
        # make chunks 0-1 resident in L1 (a legacy lookup with a retaining policy, then released)
        legacy = LMCacheAdapter(REG, sm, config(probe_only=False))
        held = legacy.lookup(stored.space, stored.tokens, num_chunks=2)
        assert held.resident and held.prefix_chunks == 2
        legacy.release_lookup(held)
        base = sm.get_l1_usage()[0]
        assert base == 2 * OBJ_4K

        with Sampler(sm) as s:
            p1 = ad.probe(stored.space, stored.tokens)
            p2 = ad.lookup(stored.space, stored.tokens)  # probe_only: lookup() is the probe
        assert s.peak == base and sm.get_l1_usage()[0] == base  # no allocation, ever
        assert p1.prefix_chunks == N and p1.hits == N and not p1.errors
        assert p1.l1_bitmap[:2] == b"\x01\x01" and sum(p1.l1_bitmap) == 2
        assert list(p1.l2_bitmaps.values())[0] == b"\x01" * N
        assert not p2.resident and p2.prefix_chunks == N and p2.probe.bitmap == p1.bitmap

        # a retaining prefetch policy keeps L2-loaded objects in L1: the windowed retrieve deletes them
        req = stored.request(seed=5, rid="retain")
        rep = ad.retrieve(req, N, window_chunks=4)
        assert rep.ok and rep.peak_staging_bytes <= 4 * OBJ_4K and sm.get_l1_usage()[0] == base
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]

        # no lock held: the L1 hits are deletable, and the whole free L1 can be written
        fresh = LMCacheKeys(KeySpace(REG.fingerprint, salt="other"), stored.tokens, 256).window(0, 6)
        assert len(sm.reserve_write(fresh, ad.layout)) == 6 and sm.get_l1_usage()[0] == 8 * OBJ_4K
        deleted, skipped = sm.delete_l1_keys([stored.key(0), stored.key(1)])
        assert (deleted, skipped) == (2, 0)


@pytest.mark.parametrize("w", [1, 3, 32, 0])
def test_windowed_retrieve_small_l1(stored, small, w):
    """L1 holds 32 objects, the prefix 40: W > 0 restores hash-equal with L1 peak = min(W, N)
    objects; the whole plan (W = 0) gets zero hits from LMCache and fails closed."""
    sm = small.sm
    req = stored.request(seed=w, rid=f"w{w}")
    base = sm.get_l1_usage()[0]
    with Sampler(sm) as s:
        rep = small.retrieve(req, N, window_chunks=w)
    assert sm.get_l1_usage()[0] == base == rep.l1_after_bytes == rep.l1_baseline_bytes
    if w == 0:
        assert not rep.ok and rep.hit_chunks == 0 and rep.committed_tokens == 0
        assert rep.force_local and req.request_id in small.force_local
        assert rep.invalid_block_ids == all_block_ids(req)
        assert rep.peak_staging_bytes == 0  # LMCache's all-or-nothing reservation allocated nothing
        return
    assert rep.ok, rep.error
    assert rep.committed_tokens == N * REG.chunk_tokens and rep.hit_chunks == N
    assert rep.windows == rep.windows_installed == -(-N // w)
    assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
    # RWS: LMCache's L1 usage above the baseline never exceeds one window of objects
    assert rep.peak_staging_bytes == min(w, N) * OBJ_4K  # W*c + W*(align padding)
    assert s.peak - base <= min(w, N) * OBJ_4K and s.samples >= 3  # a 2-window retrieve takes a few ms
    assert rep.l1_samples >= rep.windows
    # a window's 4 KiB-aligned objects lie OBJ_4K apart in L1: one strided launch per window
    assert rep.install_launches == rep.windows
    assert not rep.invalid_block_ids and not rep.force_local


def test_prefix_eight_times_larger_than_l1(stored):
    """L1 holds 5 objects, the prefix 40 (8x): W = 4 restores it hash-equal, LMCache's own L1
    usage (sampled on another thread throughout) never above one window; W = 0 gets nothing."""
    with LMCacheAdapter.create(REG, 5 * OBJ_4K, [fs_l2_config(stored.base)], config()) as ad:
        assert ad.l1_usage()[1] < N * OBJ_4K / 8 + OBJ_4K
        req = stored.request(seed=81, rid="eightfold")
        with Sampler(ad.sm) as s:
            rep = ad.retrieve(req, N, window_chunks=4)
        assert rep.ok, rep.error
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert s.samples >= 3 and s.peak <= 4 * OBJ_4K and rep.peak_staging_bytes == 4 * OBJ_4K
        whole = ad.retrieve(stored.request(seed=82, rid="eightfold-w0"), N, window_chunks=0)
        assert not whole.ok and whole.hit_chunks == 0 and whole.committed_tokens == 0


def test_whole_plan_needs_n_objects_and_is_bit_exact(stored):
    """The capacity ladder's other side: W = 0 passes once L1 holds N objects; L1 aligned to 64 B
    (c is a multiple of 64) makes LMCache's batch contiguous, so the install is one launch."""
    with LMCacheAdapter.create(REG, N * C, [fs_l2_config(stored.base)], config(), align_bytes=64) as ad:
        assert ad.l1_object_bytes == C
        req = stored.request(seed=50, rid="whole")
        rep = ad.retrieve(req, N, window_chunks=0)
        assert rep.ok, rep.error
        assert rep.peak_staging_bytes == N * C and rep.install_launches == 1 and rep.windows == 1
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert ad.l1_usage()[0] == 0
        req2 = stored.request(seed=51, rid="windowed")
        rep2 = ad.retrieve(req2, N, window_chunks=8)
        assert rep2.ok and rep2.install_launches == rep2.windows == 5 and rep2.peak_staging_bytes == 8 * C
        assert state_hash(REG, req2.kv, req2.block_tables, N) == stored.hash[N]


def test_missing_key_after_probe_fails_closed(stored, small):
    sm = small.sm
    probe = small.probe(stored.space, stored.tokens)
    assert probe.prefix_chunks == N
    path = str(sm.l2_adapters()[0][1]._key_to_path(stored.key(21)))
    req = stored.request(seed=60, rid="missing")
    base = sm.get_l1_usage()[0]
    marks = Markers()
    small.markers = marks  # a shared force-local table (anything with set(request_id, reason))
    try:
        with moved_aside(path):  # evicted between probe and retrieve
            rep = small.retrieve(req, N, window_chunks=8)
            assert small.probe(stored.space, stored.tokens).prefix_chunks == 21
    finally:
        small.markers = None
    assert "chunk 21" in marks.reasons["missing"]
    assert not rep.ok and rep.committed_tokens == 0
    assert rep.failed_window == 2 and rep.windows_installed == 2 and "chunk 21" in rep.error
    assert rep.invalid_block_ids == all_block_ids(req)  # every group, every block: partial installs too
    assert rep.force_local and "missing" in small.force_local
    small.clear_force_local("missing")
    assert "missing" not in small.force_local
    assert sm.get_l1_usage()[0] == base == rep.l1_after_bytes  # chunks 16..20 of window 2 were loaded
    assert rep.peak_staging_bytes <= 8 * OBJ_4K


def test_prefetch_timeout_fails_closed_and_late_objects_are_released(stored, small, monkeypatch):
    sm = small.sm
    base = sm.get_l1_usage()[0]
    (_, plugin), = small.l2_adapters()
    load_one = plugin._load_one

    def slow_load_one(key, obj):  # the prefetch surely misses a 1 us deadline, whoever holds the GIL
        time.sleep(0.02)
        return load_one(key, obj)

    monkeypatch.setattr(plugin, "_load_one", slow_load_one)
    impatient = LMCacheAdapter(REG, sm, config(prefetch_timeout_s=1e-6))
    req = stored.request(seed=65, rid="late")
    rep = impatient.retrieve(req, N, window_chunks=8)
    assert not rep.ok and rep.failed_window == 0 and "not complete within" in rep.error
    assert rep.committed_tokens == 0 and rep.invalid_block_ids == all_block_ids(req)
    def settled():  # the late prefetch ran, its result was taken and its objects released
        st = sm.report_status()["prefetch_controller"]
        busy = st["submission_queue_size"] + st["pending_queue_size"] + st["in_flight_request_count"]
        return busy == 0 and st["completed_results_count"] == 0 and sm.get_l1_usage()[0] == base

    deadline = time.monotonic() + 20
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled()
    impatient.close()  # joins the thread that released the late prefetch
    monkeypatch.setattr(plugin, "_load_one", load_one)
    assert small.retrieve(stored.request(seed=66), N, window_chunks=8).ok


def test_one_installer_per_retrieve(stored, small, monkeypatch):
    """The destinations are validated and the install state prepared once per retrieve (not once
    per run of L1 objects: that cost ~0.9 ms a launch at 1/64 scale); each run is one install, and a
    window's objects, OBJ_4K apart in L1, are one run."""
    import bsr_runtime.integrations.lmcache.retrieve as lm_retrieve

    made, installs = [], []

    class Counting(lm_retrieve.WindowInstaller):
        def __init__(self, *a, **kw):
            made.append(a[3])  # num_chunks
            super().__init__(*a, **kw)

        def install(self, view, first, count):
            installs.append((first, count))
            return super().install(view, first, count)

    monkeypatch.setattr(lm_retrieve, "WindowInstaller", Counting)
    req = stored.request(seed=69, rid="one-installer")
    rep = small.retrieve(req, N, window_chunks=8)
    assert rep.ok, rep.error
    assert made == [N] and len(installs) == rep.install_launches == rep.windows  # one strided run a window
    assert sorted(installs) == [(f, min(8, N - f)) for f in range(0, N, 8)]
    assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
    bad = stored.request(seed=70, rid="bad-destinations")
    bad.block_tables[0][0] = 10**9  # a block id past the destination: refused before any byte moves
    with pytest.raises(ValueError):
        small.retrieve(bad, N, window_chunks=8)
    assert made == [N, N] and len(installs) == rep.windows


def test_unexpected_install_error_fails_closed_and_releases_everything(stored, small, monkeypatch):
    """A failure of no usual kind (a KeyError inside the install of window 1, from a patched
    installer) fails the request closed, returns L1 usage to its baseline and every budget byte."""
    import bsr_runtime.integrations.lmcache.retrieve as lm_retrieve

    class Flaky(lm_retrieve.WindowInstaller):
        def install(self, view, first, count):
            if first >= 8:
                raise KeyError("no such tensor")
            return super().install(view, first, count)

    monkeypatch.setattr(lm_retrieve, "WindowInstaller", Flaky)
    budget = ByteBudget(8 * C)
    ad = LMCacheAdapter(REG, small.sm, config(), admission=budget)
    base = small.sm.get_l1_usage()[0]
    req = stored.request(seed=67, rid="keyerror")
    with Sampler(small.sm) as s:
        rep = ad.retrieve(req, N, window_chunks=8)
    assert not rep.ok and rep.committed_tokens == 0 and rep.force_local and "keyerror" in ad.force_local
    assert rep.failed_window == 1 and rep.windows_installed == 1
    assert rep.error.startswith("window 1 (chunks 8..15): install failed: KeyError")
    assert rep.invalid_block_ids == all_block_ids(req)  # window 0's blocks too
    assert small.sm.get_l1_usage()[0] == base == rep.l1_after_bytes and s.peak - base <= 8 * OBJ_4K
    assert budget.used_bytes == 0 and budget.peak_bytes == 8 * C
    monkeypatch.undo()
    ok = ad.retrieve(stored.request(seed=68, rid="after"), N, window_chunks=8)
    assert ok.ok and budget.used_bytes == 0 and small.sm.get_l1_usage()[0] == base


def test_store_gather_error_aborts_the_batch_and_releases_everything(stored, tmp_path, monkeypatch):
    """A gather failing in batch 1 of a store raises what failed; the batch's L1 reservations are
    aborted (L1 usage back to 0) and the budget is whole again."""
    import bsr_runtime.integrations.lmcache.store as lm_store

    made: list = []

    class Flaky(lm_store.WindowInstaller):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def gather(self, out, first, count):
            if first >= 4:
                raise KeyError("gather")
            return super().gather(out, first, count)

    monkeypatch.setattr(lm_store, "WindowInstaller", Flaky)
    budget = ByteBudget(4 * C)
    with LMCacheAdapter.create(REG, 8 * OBJ_4K, [fs_l2_config(str(tmp_path))], config(), admission=budget) as ad:
        with pytest.raises(KeyError, match="gather"):
            ad.store(stored.space, stored.tokens, stored.kv, stored.tables, 12)
        assert len(made) == 2  # one installer per store (and one for the hash scratch), not one per run
        assert ad.l1_usage()[0] == 0 and budget.used_bytes == 0
        assert ad.probe(stored.space, stored.tokens, 12).prefix_chunks == 4  # batch 0 was stored
        monkeypatch.undo()
        assert ad.store(stored.space, stored.tokens, stored.kv, stored.tables, 12).state_hash == stored.hash[12]
        assert ad.l1_usage()[0] == 0 and budget.used_bytes == 0


def test_config_from_lmcache_env(stored, monkeypatch):
    monkeypatch.setenv("LMCACHE_PREFETCH_WINDOW_CHUNKS", "7")
    monkeypatch.setenv("LMCACHE_PROBE_ONLY", "true")
    monkeypatch.setenv("LMCACHE_FS_LOAD_CONCURRENCY", "3")
    with LMCacheAdapter.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)]) as ad:
        assert (ad.config.window_chunks, ad.config.probe_only, ad.config.fs_load_concurrency) == (7, True, 3)
        assert ad.sm.l2_adapters()[0][1].load_concurrency == 3
        look = ad.lookup(stored.space, stored.tokens)
        assert not look.resident and look.prefix_chunks == N and ad.l1_usage()[0] == 0
        req = stored.request(seed=70)
        rep = ad.retrieve(req, N)
        assert rep.ok and rep.window_chunks == 7 and rep.windows == 6 and rep.peak_staging_bytes == 7 * OBJ_4K
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]

        monkeypatch.setenv("LMCACHE_PROBE_ONLY", "false")
        legacy = LMCacheAdapter(REG, ad.sm)  # config from the environment again
        assert not legacy.config.probe_only
        held = legacy.lookup(stored.space, stored.tokens, num_chunks=5)  # LMCache's lookup: resident
        assert held.resident and held.prefix_chunks == 5 and ad.l1_usage()[0] == 5 * OBJ_4K
        legacy.release_lookup(held)
        assert ad.l1_usage()[0] == 0
        cliff = legacy.lookup(stored.space, stored.tokens)  # the whole plan does not fit: no reuse
        assert cliff.prefix_chunks == 0 and ad.l1_usage()[0] == 0

    monkeypatch.setenv("LMCACHE_PREFETCH_WINDOW_CHUNKS", "-1")
    with pytest.raises(ValueError, match="window_chunks"):
        load_adapter_config()


def test_fs_load_concurrency_same_bits_and_bytes(stored):
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    results = {}
    keys = LMCacheKeys(stored.space, stored.tokens, 256).window(0, 12)
    for conc in (1, 4):
        l2 = [fs_l2_config(stored.base, load_concurrency=conc)]
        with LMCacheAdapter.create(REG, 16 * OBJ_4K, l2, config()) as ad:
            sm = ad.sm
            assert sm.l2_adapters()[0][1].load_concurrency == conc
            req = stored.request(seed=80 + conc)
            rep = ad.retrieve(req, N, window_chunks=16)
            assert rep.ok and state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
            assert rep.peak_staging_bytes == 16 * OBJ_4K
            path = str(sm.l2_adapters()[0][1]._key_to_path(keys[5]))
            with moved_aside(path):  # one load of the task fails: its bit alone is clear
                h = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, ad.layout)],
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


def test_admission_serializes_concurrent_retrieves(stored):
    """Two requests at once on an L1 of one window: the byte budget B = W*c admits one window at a
    time, so both restore (without it the second reservation would find L1 full)."""
    w = 8
    with LMCacheAdapter.create(REG, w * OBJ_4K, [fs_l2_config(stored.base)], config(window_chunks=w),
                               admission=ByteBudget(w * C)) as ad:
        reqs = [stored.request(seed=90 + i, rid=f"c{i}") for i in range(2)]
        reps = [None, None]

        def run(i):
            reps[i] = ad.retrieve(reqs[i], N)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        with Sampler(ad.sm) as s:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for rep, req in zip(reps, reqs):
            assert rep.ok, rep.error
            assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert s.peak <= w * OBJ_4K and ad.admission.peak_bytes <= w * C and ad.l1_usage()[0] == 0


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
    with LMCacheAdapter.create(REG, 4 * OBJ_4K, [mc_l2(mooncake_master)], config(window_chunks=4)) as ad:
        plugin = ad.sm.l2_adapters()[0][1]
        assert type(plugin).__name__ == "BSRMooncakeL2Adapter" and plugin.report_status()["l1_registered"]
        rep = ad.store(stored.space, stored.tokens, stored.kv, stored.tables, n)
        assert rep.state_hash == stored.hash[n] and ad.l1_usage()[0] == 0
        p = ad.probe(stored.space, stored.tokens)
        assert p.prefix_chunks == n and not plugin.locked_keys()
        req = stored.request(seed=110, rid="mc")
        r = ad.retrieve(req, n)
        assert r.ok, r.error
        assert r.windows == 3 and r.peak_staging_bytes == 4 * OBJ_4K and r.l1_after_bytes == 0
        assert state_hash(REG, req.kv, req.block_tables, n) == stored.hash[n]
        assert not plugin.locked_keys()

        # the plugin's load semantics, straight through its L2 interface: one bit per key, a
        # missing key is a clear bit, the bytes land in the caller's buffers
        chunk3 = torch.empty(C, dtype=torch.uint8)
        gather_window(chunk3, REG, stored.kv, stored.tables, 3, 1, backend="torch")
        bufs = [torch.zeros(C, dtype=torch.uint8) for _ in range(2)]
        task = plugin.submit_load_task([stored.key(3), stored.key(n + 1)], [Buffer(b) for b in bufs])
        deadline = time.monotonic() + 20
        while (bits := plugin.query_load_result(task)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bits is not None and bits.get_indices_list() == [0]
        assert torch.equal(bufs[0], chunk3) and not bufs[1].any()

        with unreachable(plugin):  # the adapter cannot reach the store
            bad = ad.retrieve(stored.request(seed=111, rid="mc-down"), n)
        assert not bad.ok and bad.committed_tokens == 0 and bad.l1_after_bytes == 0 and bad.force_local
        assert ad.retrieve(stored.request(seed=112), n).ok


@pytest.mark.mooncake
def test_mooncake_master_stopped_fails_closed(stored):
    from bsr_harness.mooncake_launcher import MooncakeMaster

    n = 6
    with MooncakeMaster() as master:
        with LMCacheAdapter.create(REG, 4 * OBJ_4K, [mc_l2(master)], config(window_chunks=3)) as ad:
            assert ad.store(stored.space, stored.tokens, stored.kv, stored.tables, n).state_hash == stored.hash[n]
            master.stop()
            req = stored.request(seed=120, rid="mc-stopped")
            t = time.monotonic()
            rep = ad.retrieve(req, n)
            assert time.monotonic() - t < 30
            assert not rep.ok and rep.committed_tokens == 0 and rep.invalid_block_ids == all_block_ids(req, n)
            assert ad.l1_usage()[0] == 0 == rep.l1_after_bytes
            master.restart()  # a Mooncake client closes in ~10 s when its master is gone; ~2 s when it is back


@pytest.mark.parametrize("temporary", [True, False])
def test_l2_loaded_objects_left_to_the_default_policy(stored, temporary, monkeypatch):
    """LMCache's default prefetch policy frees what it loaded from L2 when the read finishes: an adapter
    that made its StorageManager with that policy deletes nothing per window; over a StorageManager of
    unknown policy it deletes the L2-loaded keys itself. Either way L1 returns to its baseline."""
    sm = build_storage_manager(32 * OBJ_4K, [fs_l2_config(stored.base)])
    try:
        ad = LMCacheAdapter(REG, sm, config(), l2_loads_are_temporary=temporary)
        deletes = []
        delete = sm.delete_l1_keys
        monkeypatch.setattr(sm, "delete_l1_keys",
                            lambda keys, *a, **k: deletes.append(len(keys)) or delete(keys, *a, **k))
        base = sm.get_l1_usage()[0]
        req = stored.request(seed=71, rid=f"temporary-{temporary}")
        rep = ad.retrieve(req, N, window_chunks=8)
        assert rep.ok, rep.error
        assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash[N]
        assert sm.get_l1_usage()[0] == base == rep.l1_after_bytes
        assert deletes == ([] if temporary else [8] * (N // 8))
    finally:
        sm.close()
    made = LMCacheAdapter.create(REG, 8 * OBJ_4K, [fs_l2_config(stored.base)], config())
    with made:
        assert made.l2_loads_are_temporary


@pytest.mark.parametrize("temporary", [True, False])
def test_lmcache_tier_fetch_leaves_l2_loads_to_the_default_policy(tmp_path, temporary, monkeypatch):
    """LMCacheTier (the vLLM connector's tier): put 6 objects, fetch them into poisoned views; the bytes
    come back, L1 returns to its baseline, and the L2-loaded keys are deleted per fetch only when the
    adapter cannot tell that LMCache frees them."""
    from bsr_runtime.integrations.lmcache.tier import LMCacheTier

    sm = build_storage_manager(16 * OBJ_4K, [fs_l2_config(str(tmp_path))])
    tier = LMCacheTier(LMCacheAdapter(REG, sm, config(), l2_loads_are_temporary=temporary))
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
        sm.close()  # the adapter does not own it
