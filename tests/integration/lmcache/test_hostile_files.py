"""Every file BSR opens is opened the filesystem tier's way (no symlink followed, regular files only,
never blocking), every close() is bounded in time even with a stuck worker, and a failed retrieve returns
every byte of L1 it took. Real files, the real LMCache StorageManager with the FS L2 plugin.

Before: a FIFO where an LMCache FS object should be blocked the plugin's load job in a plain open(), the
retrieve failed only by its timeout with L1 left 64 KiB above its baseline, and close() waited forever in
the pool's shutdown; a symlink in an object's place was followed out of the L2 directory."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import pytest
import torch

from bsr_harness.testdata import POISON
from bsr_kernels import presets
from bsr_runtime.keys import KeySpace
from bsr_runtime.restore import RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier, _common

pytestmark = pytest.mark.timeout(300)

REG = presets.dsv4_flash(scale=1 / 1024)
C = REG.chunk_bytes
N = 6
OBJ_4K = -(-C // 4096) * 4096
SPACE = KeySpace(REG.fingerprint, salt="hostile")


def _closes_within(close, seconds: float) -> bool:
    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


@contextlib.contextmanager
def _released_fifo(path):
    """Whatever a test leaves blocked opening the FIFO `path` (the old code's plain open) is let go at the end."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_weights_digest_of_a_fifo_never_blocks(tmp_path):
    """The engine's model identity reads the checkpoint's files (weights_digest): a FIFO put in a weight
    file's place between the listing and the read is an error, not an engine that never starts."""
    from bsr_runtime.weights_digest import file_digest

    fifo = tmp_path / "model-00001.safetensors"
    os.mkfifo(fifo)
    errors = []
    with _released_fifo(fifo):
        t = threading.Thread(target=lambda: errors.append(_raised(file_digest, fifo)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the digest blocked opening a FIFO"
    assert errors and isinstance(errors[0], OSError)


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None


# -- LMCache FS plugin, through the StorageManager -------------------------------------------------
lmcache = pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")

from kernel_util import random_kv  # noqa: E402
from lmcache_util import object_path, restore, store  # noqa: E402
from restore_util import random_tables  # noqa: E402

from bsr_runtime.integrations.lmcache import LMCacheTier, fs_l2_config, load_adapter_config  # noqa: E402


@pytest.fixture
def l2(tmp_path):
    """N chunks stored through LMCache into an FS L2 directory; (base, tokens, hash, object paths)."""
    base = str(tmp_path / "l2")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50_000, (N * REG.chunk_tokens,), generator=gen).tolist()
    blocks, tables = random_tables(REG, N, 5)
    kv = random_kv(REG, blocks, 6)
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base)], load_adapter_config()) as tier:
        store(tier, REG, SPACE, tokens, kv, tables)
        paths = [object_path(tier, SPACE, tokens, i) for i in range(N)]
    return base, tokens, state_hash(REG, kv, tables, N), paths


def _request(tokens, seed: int) -> RestoreRequest:
    blocks, tables = random_tables(REG, N, 100 + seed)
    kv = REG.allocate(blocks)
    for t in kv:
        t.view(torch.uint8).fill_(POISON)
    return RestoreRequest(f"req-{seed}", tokens, SPACE, kv, tables)


def _probed_prefix(tier, tokens) -> int:
    from bsr_runtime.keys import PrefixKeys
    from bsr_runtime.probe import probe_prefix

    return probe_prefix(tier, PrefixKeys(SPACE, tokens, REG.chunk_tokens)).prefix_chunks


def test_fifo_in_place_of_an_object_fails_closed_at_once(l2):
    base, tokens, _, paths = l2
    os.unlink(paths[3])
    os.mkfifo(paths[3])
    with _released_fifo(paths[3]):
        tier = LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base, load_concurrency=2)],
                                  load_adapter_config(prefetch_timeout_s=5.0))
        try:
            baseline = tier.l1_usage()[0]
            t0 = time.monotonic()
            rep = restore(tier, _request(tokens, 1), N, 2, fetch_timeout_s=5.0)
            took = time.monotonic() - t0
            assert not rep.ok and rep.committed_tokens == 0
            assert took < 4.0, f"failed by its timeout ({took:.1f} s), not by refusing the FIFO: {rep.error}"
            assert tier.l1_usage()[0] == baseline  # every byte of L1 it took returned
        finally:
            assert _closes_within(tier.close, 30), "close() hung on the plugin's load job"


def test_symlink_in_place_of_an_object_is_not_followed(l2, tmp_path):
    """An object moved out of the L2 directory and linked back (a valid object, outside the root): refused."""
    base, tokens, _, paths = l2
    outside = tmp_path / "outside.data"
    os.replace(paths[2], outside)
    os.symlink(outside, paths[2])
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base)], load_adapter_config()) as tier:
        assert _probed_prefix(tier, tokens) == 2  # the lookup does not count it
        baseline = tier.l1_usage()[0]
        rep = restore(tier, _request(tokens, 2), N, 8)
        assert not rep.ok and rep.committed_tokens == 0 and tier.l1_usage()[0] == baseline


def test_intact_objects_still_restore(l2):
    base, tokens, want, _ = l2
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base)], load_adapter_config()) as tier:
        req = _request(tokens, 3)
        rep = restore(tier, req, N, 8)
        assert rep.ok and state_hash(REG, req.kv, req.block_tables, N) == want


def test_plugin_store_replaces_a_damaged_file(l2):
    """Storing the same prefix again (the tier's put, through LMCache's own store path) repairs a damaged file."""
    base, tokens, want, paths = l2
    with open(paths[4], "r+b") as f:
        f.seek(os.path.getsize(paths[4]) - 100)
        f.write(b"\xff" * 8)
    blocks, tables = random_tables(REG, N, 5)
    kv = random_kv(REG, blocks, 6)  # the same state as stored (same seeds)
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base)], load_adapter_config()) as tier:
        assert not restore(tier, _request(tokens, 4), N, 8).ok
        store(tier, REG, SPACE, tokens, kv, tables)
        req = _request(tokens, 5)
        assert restore(tier, req, N, 8).ok and state_hash(REG, req.kv, req.block_tables, N) == want


def test_plugin_close_is_bounded_with_a_stuck_job(l2, monkeypatch, caplog):
    from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2Adapter, ConcurrentFSL2AdapterConfig

    base, tokens, _, _ = l2
    monkeypatch.setattr(_common, "CLOSE_TIMEOUT_S", 0.5)
    release = threading.Event()
    ad = ConcurrentFSL2Adapter(ConcurrentFSL2AdapterConfig(base, load_concurrency=1))
    try:
        ad._pool.submit(release.wait, 60)  # a job stuck in the kernel, as far as close() can tell
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            assert _closes_within(ad.close, 20), "close() waited for the stuck job"
            assert time.monotonic() - t0 < 5
        assert any("abandoned" in r.getMessage() for r in caplog.records)
    finally:
        release.set()


# -- the filesystem tier ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["native", "per-object"])
def test_filesystem_tier_close_is_bounded_with_a_stuck_read(tmp_path, monkeypatch, path):
    monkeypatch.setattr(_common, "CLOSE_TIMEOUT_S", 0.5)
    tier = FilesystemTier(tmp_path, C, REG.fingerprint)
    tier.put(["k"], [torch.ones(C, dtype=torch.uint8)])
    release, started = threading.Event(), threading.Event()
    if path == "native":
        if not tier.batched:
            tier.close()
            pytest.skip("no native reader here (openat2 or the CPU library missing)")
        tier._reader.hold(True)  # its thread takes the object and does not read it until released
        began = lambda timeout: tier._reader.wait_held(1, timeout)  # noqa: E731
        release_read = lambda: tier._reader.hold(False)  # noqa: E731
    else:
        tier._native = False

        def stuck_read(key, dst):  # a read the kernel does not return from (a hung network filesystem)
            started.set()
            release.wait(60)
            raise OSError("released")

        monkeypatch.setattr(tier, "_read_into", stuck_read)
        began, release_read = started.wait, release.set
    handle = tier.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], time.monotonic() + 60)
    try:
        assert began(10)
        assert _closes_within(tier.close, 20), "close() waited for the stuck read"
        assert not handle.done()  # the stuck read's fetch is not completed under it (its bytes may still land)
    finally:
        release_read()
    assert handle.quiesce(10)


def test_filesystem_tier_fifo_and_symlink_objects_never_block(tmp_path):
    (tmp_path / "root").mkdir()
    tier = FilesystemTier(tmp_path / "root", C, REG.fingerprint)
    try:
        data = [torch.full((C,), i, dtype=torch.uint8) for i in range(2)]
        tier.put(["a", "b"], data)
        os.unlink(tier.path_of("a"))
        os.mkfifo(tier.path_of("a"))
        with _released_fifo(tier.path_of("a")):
            os.replace(tier.path_of("b"), tmp_path / "b.bsr")
            os.symlink(tmp_path / "b.bsr", tier.path_of("b"))
            for k in ("a", "b"):
                with pytest.raises(Exception) as ei:
                    tier.fetch([k], [torch.zeros(C, dtype=torch.uint8)], time.monotonic() + 5).wait()
                assert "deadline" not in str(ei.value)
            assert tier.probe(["a", "b"]) == [False, False]
    finally:
        assert _closes_within(tier.close, 20)


# -- Mooncake: the tier and the LMCache plugin -----------------------------------------------------
@pytest.mark.mooncake
def test_mooncake_tier_close_is_bounded_with_a_stuck_fetch(mooncake_tier_factory, monkeypatch):
    monkeypatch.setattr(_common, "CLOSE_TIMEOUT_S", 0.5)
    tier = mooncake_tier_factory(C, REG.fingerprint, rpc_timeout_s=0.2)
    release, started = threading.Event(), threading.Event()

    def stuck_fetch(*_a, **_k):
        started.set()
        release.wait(60)
        return 0

    monkeypatch.setattr(tier, "_fetch_now", stuck_fetch)
    tier.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], time.monotonic() + 60)
    try:
        assert started.wait(10)
        assert _closes_within(tier.close, 20), "close() waited for the stuck fetch"
    finally:
        release.set()


@pytest.mark.mooncake
def test_mooncake_plugin_close_is_bounded_with_a_stuck_job(mooncake_master, monkeypatch):
    from bsr_runtime.integrations.lmcache.mooncake_l2 import BSRMooncakeL2Adapter, BSRMooncakeL2AdapterConfig

    monkeypatch.setattr(_common, "CLOSE_TIMEOUT_S", 0.5)
    ad = BSRMooncakeL2Adapter(BSRMooncakeL2AdapterConfig(mooncake_master.master_address,
                                                         mooncake_master.metadata_server, global_segment_size=0))
    release = threading.Event()
    try:
        ad._pool.submit(release.wait, 60)
        assert _closes_within(ad.close, 20), "close() waited for the stuck job"
    finally:
        release.set()
