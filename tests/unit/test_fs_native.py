"""The filesystem tier's native reads and probes (csrc/bsr_fs_read.c via tiers/fs_native.py): a
window's objects one job of the tier's reader, the bytes as stored (destinations poisoned first,
neighbours untouched), each hostile file reported with its own status, nothing read after a failed
object or past the deadline, a read that does not return neither completing its fetch nor blocking
close(), the CRC-32C of what landed equal to an independent CRC, and the batched probe answering what
the per-object probe does."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import torch

from bsr_runtime.tiers import CorruptObjectError, FilesystemTier, MissingObjectError, _common, fs_native
from bsr_runtime.tiers import filesystem as fsmod
from bsr_runtime.tiers.base import FetchTimeoutError, TierUnavailableError
from bsr_runtime.tiers.fs_format import FILE_FLAGS, HEADER_SIZE, key_digest

FP = "0123456789abcdef0123456789abcdef"
SMALL = 4096 + 16 * 3

pytestmark = pytest.mark.skipif(not fs_native.available(), reason="the CPU library is not built")


def _data(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (SMALL,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _native_tier(tmp_path) -> FilesystemTier:
    root = tmp_path / "store"
    root.mkdir()
    t = FilesystemTier(root, SMALL, FP, load_concurrency=1)
    if not t.batched:
        t.close()
        pytest.skip("openat2 is not available here")
    return t


@pytest.fixture
def tier(tmp_path):
    t = _native_tier(tmp_path)
    yield t
    t.close()


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = fs_native.Reader.submit

    def counted(self, digests, *a, **k):
        calls.append(len(digests))
        return real(self, digests, *a, **k)

    monkeypatch.setattr(fs_native.Reader, "submit", counted)
    return calls


@pytest.mark.parametrize("conc", [1, 2])
def test_a_window_is_one_job_of_the_reader(tmp_path, monkeypatch, conc):
    root = tmp_path / "store"
    root.mkdir()
    keys = [f"k{i}" for i in range(32)]
    data = _data(len(keys))
    with FilesystemTier(root, SMALL, FP, load_concurrency=conc) as t:
        t.put(keys, data)
        calls = _counting(monkeypatch)
        staging = torch.full((len(keys) + 2, SMALL), 0xA5, dtype=torch.uint8)  # poisoned, a spare row each side
        assert t.fetch(keys, [staging[1 + i] for i in range(len(keys))], time.monotonic() + 10).wait() == \
            len(keys) * SMALL
    assert calls == [len(keys)]  # one job for the window, never a call per object
    for i, d in enumerate(data):
        assert torch.equal(staging[1 + i], d)
    assert bool((staging[0] == 0xA5).all()) and bool((staging[-1] == 0xA5).all())


def _job(t, keys, deadline_s: float = 10.0):
    bodies = [torch.full((SMALL,), 7, dtype=torch.uint8) for _ in keys]
    job = t._reader.submit([key_digest(k) for k in keys], FILE_FLAGS, t.object_size, HEADER_SIZE,
                           [b.data_ptr() for b in bodies], time.monotonic_ns() + int(deadline_s * 1e9))
    return job, bodies


def _raw_read(t, keys):
    """Each key read as a job of its own (a failed object ends its job's later ones unread)."""
    heads, crcs, status, bodies = [], [], [], []
    for k in keys:
        job, (body,) = _job(t, [k])
        assert job.wait(10)
        heads.append(job.heads[0])
        crcs.append(job.crcs[0])
        status.append(int(job.status[0]))
        bodies.append(body)
    return heads, crcs, status, bodies


def test_each_hostile_file_gets_its_own_status(tier, tmp_path):
    keys = ["ok", "absent", "symlink", "fifo", "short", "long", "dir"]
    stored = ["ok", "symlink", "fifo", "short", "long", "dir"]
    data = _data(len(stored))
    tier.put(stored, data)
    outside = tmp_path / "outside.bsr"
    outside.write_bytes(open(tier.path_of("symlink"), "rb").read())
    os.replace(tier.path_of("symlink"), str(tmp_path / "moved"))
    os.symlink(outside, tier.path_of("symlink"))
    os.unlink(tier.path_of("fifo"))
    os.mkfifo(tier.path_of("fifo"))
    with open(tier.path_of("short"), "r+b") as f:
        f.truncate(HEADER_SIZE + SMALL - 1)
    with open(tier.path_of("long"), "ab") as f:
        f.write(b"x")
    os.unlink(tier.path_of("dir"))
    os.mkdir(tier.path_of("dir"))
    t0 = time.monotonic()
    heads, crcs, status, bodies = _raw_read(tier, keys)
    assert time.monotonic() - t0 < 5  # the FIFO did not block
    assert status == [0, errno.ENOENT, errno.ELOOP, fs_native.NOT_REGULAR, fs_native.WRONG_SIZE,
                      fs_native.WRONG_SIZE, fs_native.NOT_REGULAR]
    assert torch.equal(bodies[0], data[0])
    assert bytes(heads[0][:4]) == b"BSR1"
    assert all(bool((b == 7).all()) for b in bodies[1:])  # nothing read from a refused object
    google_crc32c = pytest.importorskip("google_crc32c")
    assert int(crcs[0]) == google_crc32c.value(data[0].numpy().tobytes())


def test_symlinked_fanout_directory_is_refused(tier, tmp_path):
    tier.put(["k"], _data(1))
    leaf = os.path.dirname(tier.path_of("k"))
    moved = tmp_path / "moved-leaf"
    os.replace(leaf, moved)
    os.symlink(moved, leaf)
    _, _, status, bodies = _raw_read(tier, ["k"])
    assert status == [errno.ELOOP]
    assert bool((bodies[0] == 7).all())


def test_batched_fetch_fails_closed_like_the_per_object_path(tier):
    keys = [f"k{i}" for i in range(6)]
    tier.put(keys[:5], _data(5))
    with open(tier.path_of("k2"), "r+b") as f:  # one payload byte flipped
        f.seek(HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([b[0] ^ 0x10]))
    for batched in (True, False):
        tier._native = batched
        with pytest.raises(CorruptObjectError, match="checksum mismatch for k2"):
            tier.fetch(keys[:5], [torch.zeros(SMALL, dtype=torch.uint8) for _ in range(5)],
                       time.monotonic() + 10).wait()
        with pytest.raises(MissingObjectError, match="k5"):
            tier.fetch(keys[4:], [torch.zeros(SMALL, dtype=torch.uint8) for _ in range(2)],
                       time.monotonic() + 10).wait()


def test_batched_probe_answers_what_the_per_object_probe_does(tier, tmp_path):
    keys = ["ok", "absent", "symlink", "fifo", "short", "dir"]
    tier.put(["ok", "symlink", "fifo", "short", "dir"], _data(5))
    outside = tmp_path / "o.bsr"
    outside.write_bytes(b"x" * (HEADER_SIZE + SMALL))
    os.unlink(tier.path_of("symlink"))
    os.symlink(outside, tier.path_of("symlink"))
    os.unlink(tier.path_of("fifo"))
    os.mkfifo(tier.path_of("fifo"))
    with open(tier.path_of("short"), "r+b") as f:
        f.truncate(10)
    os.unlink(tier.path_of("dir"))
    os.mkdir(tier.path_of("dir"))
    batched = tier.probe(keys)
    tier._native = False
    assert batched == tier.probe(keys) == [True, False, False, False, False, False]


def test_probe_error_other_than_absence_is_a_tier_error(tier, monkeypatch):
    monkeypatch.setattr(fs_native, "probe_objects", lambda *a: fsmod.np.array([errno.EIO], dtype="int64"))
    with pytest.raises(fsmod.TierError, match="probe failed"):
        tier.probe(["k"])


def test_nothing_is_read_after_a_failed_object_of_the_job(tier):
    data = _data(2)
    tier.put(["a", "c"], data)
    job, bodies = _job(tier, ["a", "absent", "c"])
    assert job.wait(10)
    assert job.status.tolist() == [0, errno.ENOENT, fs_native.SKIPPED]
    assert torch.equal(bodies[0], data[0])
    assert bool((bodies[1] == 7).all()) and bool((bodies[2] == 7).all())


def test_a_read_that_does_not_return_holds_its_fetch_past_the_deadline(tier):
    """A read the kernel does not return from (the reader held): wait() times out at the deadline, the
    handle stays unsettled (its bytes may still land) until the read ends; objects not started by then
    are never read."""
    data = _data(3)
    keys = ["a", "b", "c"]
    tier.put(keys, data)
    out = [torch.full((SMALL,), 7, dtype=torch.uint8) for _ in keys]
    tier._reader.hold(True)
    try:
        h = tier.fetch(keys, out, time.monotonic() + 2)
        assert tier._reader.wait_held(1, 2)  # "a" taken before the deadline, its read not returning
        with pytest.raises(FetchTimeoutError):
            h.wait()
        assert not h.quiesce(0) and not h.done()
    finally:
        tier._reader.hold(False)
    assert h.quiesce(5)
    assert torch.equal(out[0], data[0])  # taken before the deadline: read once released
    assert bool((out[1] == 7).all()) and bool((out[2] == 7).all())  # not started by the deadline: never read
    with pytest.raises(FetchTimeoutError, match="deadline passed before b was read"):
        h.wait()


def test_close_is_bounded_by_a_stuck_read_and_cancels_what_did_not_start(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_common, "CLOSE_TIMEOUT_S", 0.3)
    t = _native_tier(tmp_path)  # closed by the test itself
    data = _data(3)
    t.put(["a", "b", "c"], data)
    out = [torch.full((SMALL,), 7, dtype=torch.uint8) for _ in range(3)]
    t._reader.hold(True)
    h = t.fetch(["a", "b", "c"], out, time.monotonic() + 60)
    try:
        assert t._reader.wait_held(1, 10)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            t.close()
        assert time.monotonic() - t0 < 5
        assert any("abandoned" in r.getMessage() for r in caplog.records)
        assert not h.done()
    finally:
        t._reader.hold(False)
    assert h.quiesce(5)
    with pytest.raises(TierUnavailableError, match="closed before the fetch completed"):
        h.wait()
    assert torch.equal(out[0], data[0]) and bool((out[1] == 7).all()) and bool((out[2] == 7).all())
    with pytest.raises(TierUnavailableError):
        t.fetch(["a"], [out[0]], time.monotonic() + 1)


def test_a_job_dropped_by_its_caller_is_kept_until_it_ends(tier):
    """The reader's threads write a job's arrays until it ended: dropping the handle must not free them."""
    import gc

    data = _data(2)
    tier.put(["a", "b"], data)
    out = [torch.zeros(SMALL, dtype=torch.uint8) for _ in range(2)]
    tier._reader.hold(True)
    try:
        tier.fetch(["a", "b"], out, time.monotonic() + 10)
        assert tier._reader.wait_held(1, 10)
        gc.collect()
        assert len(tier._reader._jobs) == 1
    finally:
        tier._reader.hold(False)
    for _ in range(2):  # one thread: the dropped job ends before the first of these, let go at the second's submit
        assert tier.fetch(["b"], [torch.zeros(SMALL, dtype=torch.uint8)], time.monotonic() + 10).wait() == SMALL
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))  # the dropped job landed whole
    assert len(tier._reader._jobs) == 0


def test_quiesce_without_a_timeout_waits_for_the_read(tier):
    """quiesce(None) is "until the read ended", not a timeout that wraps around to none."""
    import threading

    tier.put(["a"], _data(1))
    tier._reader.hold(True)
    h = tier.fetch(["a"], [torch.zeros(SMALL, dtype=torch.uint8)], time.monotonic() + 10)
    try:
        assert tier._reader.wait_held(1, 10)
        waiter = threading.Thread(target=h.quiesce, daemon=True)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
    finally:
        tier._reader.hold(False)
    waiter.join(10)
    assert not waiter.is_alive() and h.wait() == SMALL


def test_a_deadline_past_what_int64_nanoseconds_hold_reads(tier):
    import threading

    data = _data(1)
    tier.put(["a"], data)
    out = torch.zeros(SMALL, dtype=torch.uint8)
    assert tier.fetch(["a"], [out], time.monotonic() + threading.TIMEOUT_MAX).wait() == SMALL
    assert torch.equal(out, data[0])


def test_a_fork_child_reads_through_a_reader_of_its_own(tier):
    """A tier made before a fork: the child has none of the reader's threads, so it makes its own."""
    import multiprocessing

    data = _data(2)
    tier.put(["a", "b"], data)
    out = torch.zeros(SMALL, dtype=torch.uint8)
    assert tier.fetch(["a"], [out], time.monotonic() + 10).wait() == SMALL  # the parent's reader in use
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            got = torch.zeros(SMALL, dtype=torch.uint8)
            tier.fetch(["b"], [got], time.monotonic() + 10).wait()
            q.put(bool(torch.equal(got, data[1])))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            q.put(repr(e))

    p = ctx.Process(target=child)
    p.start()
    p.join(30)
    assert q.get(timeout=5) is True
    assert tier.fetch(["b"], [out], time.monotonic() + 10).wait() == SMALL and torch.equal(out, data[1])


def test_jobs_waited_on_by_several_threads_at_once_end_for_each(tmp_path):
    """Concurrent restores share one reader: a job one thread waits on may be seen ended and forgotten by
    another (each submit lets ended jobs go). The reader frees a job only once no caller waits on it (a waiter
    woken after a free read freed memory: restores hung until their fetch deadline, or read garbage)."""
    import threading

    t = _native_tier(tmp_path)
    keys = [f"k{i}" for i in range(8)]
    data = _data(len(keys))
    t.put(keys, data)
    errors: list[str] = []

    def restore_like(worker: int) -> None:
        out = torch.zeros(SMALL, dtype=torch.uint8)
        for i in range(600):
            k = (worker + i) % len(keys)
            t0 = time.monotonic()
            try:
                t.fetch([keys[k]], [out], time.monotonic() + 20).wait()
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                errors.append(f"{worker}/{i}: {e!r}")
                return
            same = torch.equal(out, data[k])
            if time.monotonic() - t0 > 5 or not same:
                errors.append(f"{worker}/{i}: {time.monotonic() - t0:.1f} s, bytes {'ok' if same else 'wrong'}")
                return

    try:
        threads = [threading.Thread(target=restore_like, args=(w,), daemon=True) for w in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "a fetch never ended"
        assert not errors, errors[:3]
    finally:
        t.close()
