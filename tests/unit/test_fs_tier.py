"""FilesystemTier: real files under tmp_path, fetched into real StagingArena slots. The Tier contract
and every FaultyTier fault run against it in tests/unit/test_tier_contract.py."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bsr_kernels import StagingArena
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers import (
    CorruptObjectError,
    FetchTimeoutError,
    FilesystemTier,
    MissingObjectError,
    TierError,
    TierUnavailableError,
)
from bsr_runtime.tiers import filesystem as fsmod
from bsr_runtime.tiers._common import CRC32
from bsr_runtime.tiers.fs_format import ENV_LOAD_CONCURRENCY

FP = "0123456789abcdef0123456789abcdef"
FP_OTHER = "fedcba9876543210fedcba9876543210"
SMALL = 4096 + 16 * 3
MIB = 1 << 20


def payloads(n: int, chunk_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (chunk_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def lease_views(pool: StagingArena, n: int, fill: int = 0):
    lease = pool.acquire(n)
    lease.view.fill_(fill)
    return lease, [lease.chunk(i) for i in range(n)]


def deadline(s: float = 10.0) -> float:
    return time.monotonic() + s


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "store"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path_factory):
    return tmp_path_factory.mktemp("outside")


@pytest.fixture(params=["batched", "per-object"])
def tier(request, root):
    """The tier reading a window's objects as one job of its native reader, and one object at a time."""
    t = FilesystemTier(root, SMALL, FP, load_concurrency=2)
    if request.param == "batched" and not t.batched:
        t.close()
        pytest.skip("the CPU library (or openat2) is not available here")
    t._native = request.param == "batched"
    yield t
    t.close()


def files_under(path) -> list[str]:
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names]
    return out


# -- round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [4096, 4096 + 16 * 1, 4096 + 16 * 7, MIB])
@pytest.mark.parametrize("conc", [1, 4])
def test_roundtrip_into_staging_pool(root, chunk_bytes, conc):
    n = 6 if chunk_bytes == MIB else 9
    data = payloads(n, chunk_bytes, seed=chunk_bytes + conc)
    keys = [f"chunk-{i}" for i in range(n)]
    pool = StagingArena(chunk_bytes, n + 1)
    with FilesystemTier(root, chunk_bytes, FP, load_concurrency=conc) as t:
        t.put(keys, data)
        assert t.probe(keys) == [True] * n
        lease, views = lease_views(pool, n)
        h = t.fetch(keys, views, deadline())
        assert h.wait() == n * chunk_bytes
        assert h.settled()
        for v, d in zip(views, data, strict=True):
            assert torch.equal(v, d)
        pool.release(lease)
        for p in files_under(root):
            assert os.path.getsize(p) == fsmod.HEADER_SIZE + chunk_bytes


def test_file_format(tier, root):
    [d] = payloads(1, SMALL)
    tier.put(["k"], [d])
    path = tier.path_of("k")
    rel = os.path.relpath(path, tier.root)
    h = fsmod.key_digest("k").hex()
    assert rel == f"{h[:2]}/{h[2:4]}/{h}.bsr"
    raw = open(path, "rb").read()
    assert raw[:4] == b"BSR1"
    magic, ver, algo, hsize, _, length, crc, _, fp, kd = fsmod.HEADER_STRUCT.unpack(raw[:96])
    assert (ver, hsize, length) == (1, 96, SMALL)
    assert fp == FP.encode() and kd == fsmod.key_digest("k")
    assert crc == fsmod.payload_crc(algo, raw[96:])
    assert raw[96:] == d.numpy().tobytes()


def test_crc32_files_readable(root):
    [d] = payloads(1, SMALL)
    with FilesystemTier(root, SMALL, FP, checksum="crc32") as w:
        w.put(["k"], [d])
    with FilesystemTier(root, SMALL, FP) as r:
        out = torch.zeros(SMALL, dtype=torch.uint8)
        r.fetch(["k"], [out], deadline()).wait()
        assert torch.equal(out, d)


# -- integrity -----------------------------------------------------------------------------


def _put_one(t, key="k", seed=0):
    [d] = payloads(1, t.chunk_bytes, seed)
    t.put([key], [d])
    return d


def _fetch_err(t, key="k"):
    out = torch.full((t.chunk_bytes,), 7, dtype=torch.uint8)
    with pytest.raises(TierError) as ei:
        t.fetch([key], [out], deadline()).wait()
    return ei.value, out


def test_truncated_file(tier):
    _put_one(tier)
    p = tier.path_of("k")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 1)
    assert tier.probe(["k"]) == [False]
    err, _ = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError) and "truncated" in str(err)
    with open(p, "r+b") as f:
        f.truncate(10)  # shorter than the header
    assert isinstance(_fetch_err(tier)[0], CorruptObjectError)


@pytest.mark.parametrize("offset", [96, 96 + SMALL // 2, 96 + SMALL - 1])
def test_flipped_payload_byte(tier, offset):
    _put_one(tier)
    p = tier.path_of("k")
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    assert tier.probe(["k"]) == [True]  # probe does not read payloads
    err, _ = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError) and "checksum" in str(err)


@pytest.mark.parametrize("offset", [0, 5, 17, 40, 70])
def test_flipped_header_byte(tier, offset):
    _put_one(tier)
    p = tier.path_of("k")
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    assert isinstance(_fetch_err(tier)[0], CorruptObjectError)


def test_other_fingerprint(root, tier):
    with FilesystemTier(root, SMALL, FP_OTHER) as other:
        _put_one(other)
    err, _ = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError) and "registration mismatch" in str(err)
    # another registration usually also has another chunk size: still named a mismatch
    with FilesystemTier(root, SMALL + 16, FP_OTHER) as other:
        _put_one(other, "k2")
    err, _ = _fetch_err(tier, "k2")
    assert isinstance(err, CorruptObjectError) and "registration mismatch" in str(err)


def test_misplaced_file(tier):
    _put_one(tier, "a")
    os.makedirs(os.path.dirname(tier.path_of("b")), exist_ok=True)
    shutil.copyfile(tier.path_of("a"), tier.path_of("b"))
    assert tier.probe(["b"]) == [True]
    err, _ = _fetch_err(tier, "b")
    assert isinstance(err, CorruptObjectError) and "another key" in str(err)


def test_directory_in_place_of_object(tier):
    _put_one(tier)
    p = tier.path_of("k")
    os.unlink(p)
    os.mkdir(p)
    assert tier.probe(["k"]) == [False]
    err, out = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError)
    assert bool((out == 7).all())
    with pytest.raises(TierError):
        tier.put(["k"], payloads(1, SMALL))  # never replaces a directory


def _old_atime(path):
    st_ = os.stat(path)
    os.utime(path, (st_.st_mtime - 1000, st_.st_mtime))  # relatime would bump it on a read
    return os.stat(path).st_atime


def test_symlinked_object_outside_root(tier, outside):
    d = _put_one(tier)
    p = tier.path_of("k")
    target = outside / "looks-valid.bsr"
    shutil.copyfile(p, target)  # a perfectly valid object for this key, outside the root
    os.unlink(p)
    os.symlink(target, p)
    atime = _old_atime(target)
    assert tier.probe(["k"]) == [False]
    err, out = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError) and "symlink" in str(err)
    assert bool((out == 7).all()), "nothing may land from outside the root"
    assert not torch.equal(out, d)
    assert os.stat(target).st_atime == atime
    tier.drop_page_cache(["k"])  # also refuses; does not touch the target
    assert os.stat(target).st_atime == atime


def test_symlinked_fanout_directory(tier, outside):
    _put_one(tier)
    p = tier.path_of("k")
    top = os.path.join(tier.root, os.path.relpath(p, tier.root).split("/")[0])
    moved = outside / "fanout"
    shutil.move(top, moved)
    os.symlink(moved, top)
    target = os.path.join(moved, *os.path.relpath(p, tier.root).split("/")[1:])
    atime = _old_atime(target)
    assert tier.probe(["k"]) == [False]
    err, out = _fetch_err(tier)
    assert isinstance(err, CorruptObjectError)
    assert bool((out == 7).all())
    assert os.stat(target).st_atime == atime
    with pytest.raises(CorruptObjectError):
        tier.put(["k"], payloads(1, SMALL))  # writes do not follow it either
    assert os.listdir(os.path.dirname(target)) == [os.path.basename(target)]


def test_fifo_in_place_of_object(tier):
    _put_one(tier)
    p = tier.path_of("k")
    os.unlink(p)
    os.mkfifo(p)
    assert tier.probe(["k"]) == [False]
    assert isinstance(_fetch_err(tier)[0], CorruptObjectError)  # and it did not hang


# -- keys and tenants ----------------------------------------------------------------------

NASTY = [
    "../../etc/passwd",
    "/etc/passwd",
    "a/b/c",
    "..",
    "",
    "nul\0byte",
    "\0",
    "x" * 100_000,
    "é✓\U0001f600",
    "lone\ud800surrogate",
    ".hidden.tmp",
]


def test_nasty_keys_stay_under_root(tier, root, tmp_path):
    before = sorted(os.listdir(tmp_path))
    data = payloads(len(NASTY), SMALL, seed=3)
    tier.put(NASTY, data)
    assert tier.probe(NASTY) == [True] * len(NASTY)
    views = [torch.zeros(SMALL, dtype=torch.uint8) for _ in NASTY]
    tier.fetch(NASTY, views, deadline()).wait()
    for v, d in zip(views, data, strict=True):
        assert torch.equal(v, d)
    real_root = os.path.realpath(root)
    paths = files_under(root)
    assert len(paths) == len(NASTY)
    for p in paths:
        rel = os.path.relpath(os.path.realpath(p), real_root)
        parts = rel.split(os.sep)
        assert len(parts) == 3 and len(parts[2]) == 64 + 4 and parts[2].endswith(".bsr")
    assert sorted(os.listdir(tmp_path)) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300))
def test_any_key_maps_to_hex_name(key):
    rel = fsmod.object_relpath(key)
    a, b, name = rel.split("/")
    assert name[:2] == a and name[2:4] == b and name.endswith(".bsr")
    assert all(c in "0123456789abcdef" for c in name[:-4]) and len(name) == 68


def test_the_batched_reads_lay_out_every_path_at_its_fixed_stride():
    """The library reads path i at i * _RELPATH_BYTES: each path there, NUL-ended; a digest of another size
    (whose path would shift every later one) is refused before the library is called."""
    import numpy as np

    from bsr_runtime.tiers import fs_native
    from bsr_runtime.tiers.fs_format import key_digest

    keys = ["a", "b", "c"]
    buf, addrs = fs_native._relpaths([key_digest(k) for k in keys])
    for i, k in enumerate(keys):
        start = int(addrs[i]) - buf.ctypes.data
        raw = bytes(buf[start:start + fs_native._RELPATH_BYTES])
        assert raw == fsmod.object_relpath(k).encode() + b"\0"
    assert fs_native._relpaths([])[0].size == 0
    with pytest.raises(ValueError, match="32 bytes"):
        fs_native._relpaths([key_digest("a"), b"short"])
    assert np.all(np.diff(addrs) == fs_native._RELPATH_BYTES)


def test_tenant_salts_never_share_a_file():
    tokens = list(range(256 * 4))
    ka = PrefixKeys(KeySpace(FP, salt="tenant-a"), tokens, 256).window(0, 4)
    kb = PrefixKeys(KeySpace(FP, salt="tenant-b"), tokens, 256).window(0, 4)
    assert not {fsmod.object_relpath(k) for k in ka} & {fsmod.object_relpath(k) for k in kb}


# -- atomic writes -------------------------------------------------------------------------


def test_put_leaves_no_temp_files_and_overwrites(tier, root):
    keys = [f"k{i}" for i in range(8)]
    tier.put(keys, payloads(8, SMALL, seed=1))
    new = payloads(8, SMALL, seed=2)
    tier.put(keys, new)
    names = [os.path.basename(p) for p in files_under(root)]
    assert len(names) == 8 and not any(n.endswith(".tmp") for n in names)
    views = [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys]
    tier.fetch(keys, views, deadline()).wait()
    assert all(torch.equal(v, d) for v, d in zip(views, new, strict=True))


def test_crash_mid_write_is_not_an_object(tier):
    d = payloads(1, SMALL)[0]
    h = fsmod.key_digest("k").hex()
    leaf = os.path.join(tier.root, h[:2], h[2:4])
    os.makedirs(leaf)
    tmp = os.path.join(leaf, f".{h}.1234.5678.deadbeef.tmp")
    header = fsmod.pack_header(FP.encode(), fsmod.key_digest("k"), SMALL, CRC32, 0)
    with open(tmp, "wb") as f:  # the writer died after half the payload
        f.write(header + d.numpy().tobytes()[: SMALL // 2])
    assert tier.probe(["k"]) == [False]
    assert isinstance(_fetch_err(tier)[0], MissingObjectError)
    assert tier.sweep_temp_files(older_than_s=3600) == 0
    assert tier.sweep_temp_files(older_than_s=-1) == 1
    assert not os.path.exists(tmp)



def _long_root(base) -> str:
    """A root whose path is 4040 characters: the tier's objects and temp files lie past PATH_MAX (4096)
    as absolute paths, within it relative to the root's descriptor."""
    path = str(base)
    while len(path) < 4040:
        path = os.path.join(path, "d" * min(200, 4040 - len(path) - 1))
        os.mkdir(path)
    return path


def test_sweep_under_a_root_near_path_max(tmp_path):
    """Issue 35 item 10: the sweep joined absolute paths ("File name too long") where the tier's I/O is
    relative to the root's descriptor."""
    root = _long_root(tmp_path)
    with FilesystemTier(root, SMALL, FP) as tier:
        keys = [f"k{i}" for i in range(3)]
        tier.put(keys, payloads(3, SMALL))  # the tier works there
        h = fsmod.key_digest("k0").hex()
        leaf = os.open(os.path.join(root, h[:2], h[2:4]), os.O_RDONLY | os.O_DIRECTORY)
        try:
            stale = f".{h}.1234.5678.deadbeef.tmp"
            os.close(os.open(stale, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=leaf))
            assert len(os.path.join(root, h[:2], h[2:4], stale)) > 4096
            assert tier.sweep_temp_files(older_than_s=3600) == 0
            assert tier.sweep_temp_files(older_than_s=-1) == 1
            assert stale not in os.listdir(leaf)
        finally:
            os.close(leaf)
        assert tier.probe(keys) == [True] * 3  # objects untouched

def test_fsync_mode(root):
    with FilesystemTier(root, SMALL, FP, fsync=True) as t:
        d = _put_one(t)
        out = torch.zeros(SMALL, dtype=torch.uint8)
        t.fetch(["k"], [out], deadline()).wait()
        assert torch.equal(out, d)


# -- construction --------------------------------------------------------------------------


def test_root_must_be_a_writable_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        FilesystemTier(tmp_path / "nope", SMALL, FP)
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        FilesystemTier(f, SMALL, FP)
    assert f.read_bytes() == b"x"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root may write anywhere, so only a non-root run can see this
            with pytest.raises(ValueError, match="not writable"):
                FilesystemTier(ro, SMALL, FP)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_root_not_writable_by_os_access(tmp_path, monkeypatch):
    monkeypatch.setattr(fsmod.os, "access", lambda *a, **k: False)
    with pytest.raises(ValueError, match="not writable"):
        FilesystemTier(tmp_path, SMALL, FP)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_load_concurrency_validated(root, bad):
    with pytest.raises(ValueError):
        FilesystemTier(root, SMALL, FP, load_concurrency=bad)


def test_load_concurrency_env(root, monkeypatch):
    monkeypatch.delenv(ENV_LOAD_CONCURRENCY, raising=False)
    with FilesystemTier(root, SMALL, FP) as t:
        assert t.load_concurrency == 1
    monkeypatch.setenv(ENV_LOAD_CONCURRENCY, "3")
    with FilesystemTier(root, SMALL, FP) as t:
        assert t.load_concurrency == 3 and t._pool._max_workers == 3
    with FilesystemTier(root, SMALL, FP, load_concurrency=2) as t:
        assert t.load_concurrency == 2
    for bad in ("0", "-2", "four"):
        monkeypatch.setenv(ENV_LOAD_CONCURRENCY, bad)
        with pytest.raises(ValueError):
            FilesystemTier(root, SMALL, FP)


def test_bad_chunk_bytes_and_checksum(root):
    with pytest.raises(ValueError):
        FilesystemTier(root, 0, FP)
    with pytest.raises(ValueError):
        FilesystemTier(root, SMALL, FP, checksum="md5")


# -- concurrency ---------------------------------------------------------------------------


@pytest.mark.parametrize("conc", [1, 4])
def test_reads_overlap_with_load_concurrency(root, conc):
    n = 8
    with FilesystemTier(root, SMALL, FP, load_concurrency=conc) as t:
        t._native = False  # object-at-a-time scheduling (batched reads: test_fs_native.py)
        data = payloads(n, SMALL)
        keys = [f"k{i}" for i in range(n)]
        t.put(keys, data)
        lock = threading.Lock()
        active, peak = [0], [0]
        real = t._read_into

        def counting(key, arr):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                time.sleep(0.03)
                return real(key, arr)
            finally:
                with lock:
                    active[0] -= 1

        t._read_into = counting
        views = [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys]
        t0 = time.monotonic()
        t.fetch(keys, views, deadline()).wait()
        dt = time.monotonic() - t0
        assert all(torch.equal(v, d) for v, d in zip(views, data, strict=True))
        assert peak[0] == conc
        if conc == 4:
            assert dt < n * 0.03 * 0.75


def test_first_error_stops_unstarted_reads(root):
    with FilesystemTier(root, SMALL, FP, load_concurrency=1) as t:
        t._native = False  # object-at-a-time scheduling (batched reads: test_fs_native.py)
        keys = [f"k{i}" for i in range(10)]
        t.put(keys[1:], payloads(9, SMALL))
        reads = []
        real = t._read_into
        t._read_into = lambda key, arr: (reads.append(key), real(key, arr))[1]
        with pytest.raises(MissingObjectError):
            t.fetch(keys, [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys], deadline()).wait()
        assert reads == ["k0"]


# -- deadlines -----------------------------------------------------------------------------


def test_quiesce_after_timeout_waits_for_inflight_read(root):
    with FilesystemTier(root, SMALL, FP, load_concurrency=1) as t:
        t._native = False  # object-at-a-time scheduling (batched reads: test_fs_native.py)
        keys = ["a", "b", "c"]
        t.put(keys, payloads(3, SMALL))
        real = t._read_into
        t._read_into = lambda key, arr: (time.sleep(0.2), real(key, arr))[1]
        out = [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys]
        h = t.fetch(keys, out, time.monotonic() + 0.05)
        with pytest.raises(FetchTimeoutError):
            h.wait()
        assert not h.quiesce(0)  # "a" is still being read into out[0]
        assert h.quiesce(2.0)
        assert bool((out[2] == 0).all())  # "c" never started: its deadline had passed
        with pytest.raises(FetchTimeoutError):
            h.wait()


def test_deadline_passed_before_reads_start(tier):
    _put_one(tier)
    out = torch.full((SMALL,), 7, dtype=torch.uint8)
    h = tier.fetch(["k"], [out], time.monotonic() - 1)
    with pytest.raises(FetchTimeoutError):
        h.wait()
    assert h.quiesce(1.0)
    assert bool((out == 7).all())


# -- lifecycle -----------------------------------------------------------------------------


def _tier_threads():
    return [t for t in threading.enumerate() if t.name.startswith("bsr-fs") or isinstance(t, threading.Timer)]


def test_close_fails_queued_fetches(root):
    t = FilesystemTier(root, SMALL, FP, load_concurrency=1)
    t._native = False  # object-at-a-time scheduling (batched reads: test_fs_native.py)
    keys = [f"k{i}" for i in range(8)]
    t.put(keys, payloads(8, SMALL))
    real = t._read_into
    t._read_into = lambda key, arr: (time.sleep(0.05), real(key, arr))[1]
    h = t.fetch(keys, [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys], deadline())
    time.sleep(0.01)
    t.close()
    assert h.done() and h.settled()
    with pytest.raises(TierUnavailableError):
        h.wait()
    assert _tier_threads() == []


def test_drop_page_cache(tier):
    keys = ["a", "b"]
    tier.put(keys, payloads(2, SMALL))
    assert tier.drop_page_cache(keys + ["missing"]) == 2
    out = [torch.zeros(SMALL, dtype=torch.uint8) for _ in keys]
    tier.fetch(keys, out, deadline()).wait()


def test_file_mode_regular(tier):
    _put_one(tier)
    assert stat.S_ISREG(os.lstat(tier.path_of("k")).st_mode)
