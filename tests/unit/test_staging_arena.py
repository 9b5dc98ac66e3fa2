"""StagingArena, the one staging: meters, waits, synchronize-then-release, header room, and a restorer's
own arena of W chunks holding its depth-2 windows (ceil(W/2) and floor(W/2) chunks) as two runs.
(Sharing, FIFO, quarantine and retirement: tests/unit/test_loader.py and test_concurrent_budget.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bsr_kernels import StagingArena
from bsr_runtime.plan import plan_windows

C = 4096


def test_meters_track_live_and_peak():
    arena = StagingArena(C, 4)
    assert arena.capacity_bytes == 4 * C == arena.buffer.numel()
    a = arena.acquire(2)
    assert arena.live_bytes == 2 * C and arena.peak_bytes == 2 * C
    b = arena.acquire(1)
    assert arena.live_bytes == 3 * C and arena.peak_bytes == 3 * C
    assert a.view.numel() == 2 * C and b.view.numel() == C
    assert a.view.data_ptr() + 2 * C <= b.view.data_ptr() or b.view.data_ptr() + C <= a.view.data_ptr()
    a.record()
    a.synchronize()
    a.release()
    b.release()
    b.release()  # idempotent: every path out of the loop may release
    assert arena.live_bytes == 0 and arena.peak_bytes == 3 * C
    arena.reset_peak()
    assert arena.peak_bytes == 0


def test_acquire_waits_for_release_within_its_bound():
    arena = StagingArena(C, 2)
    lease = arena.acquire(2)
    with pytest.raises(TimeoutError):
        arena.acquire(1, timeout=0.05)
    got = []
    t = threading.Thread(target=lambda: got.append(arena.acquire(1, timeout=5)))
    t.start()
    time.sleep(0.1)
    assert not got
    lease.release()
    t.join(5)
    assert got and arena.live_bytes == C
    got[0].release()


class _DelayedHostStream:
    """A host stream whose work completes only when synchronize() is called."""

    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True


def test_release_before_synchronize_is_an_error():
    arena = StagingArena(C, 2)
    lease = arena.acquire(1)
    stream = _DelayedHostStream()
    lease.record(stream)
    with pytest.raises(RuntimeError, match="before the work recorded on it was synchronized"):
        lease.release()
    assert not stream.done and arena.live_bytes == C
    lease.synchronize()
    assert stream.done
    lease.release()
    assert arena.live_bytes == 0


@pytest.mark.parametrize("bad,match", [
    (dict(chunk_bytes=10, capacity_chunks=1), "multiple of 16"),
    (dict(chunk_bytes=C, capacity_chunks=0), "at least one chunk"),
    (dict(chunk_bytes=C, capacity_chunks=2, headroom=8), "headroom"),
])
def test_bad_arena_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        StagingArena(**bad)


def test_headroom_leaves_scratch_before_every_chunk():
    """headroom h: chunk i of a run at h + i * (h + C) from the run's start; a lease's view is (n, C)
    with rows h + C apart; views and rooms of all leases tile the buffer without overlap; the meters
    count chunk bytes, the room is room_bytes."""
    h = 128
    arena = StagingArena(C, 5, headroom=h)
    assert arena.chunk_stride == C + h and arena.buffer.numel() == 5 * (C + h)
    assert arena.capacity_bytes == 5 * C and arena.room_bytes == 5 * h
    leases = [arena.acquire(n) for n in (3, 2)]
    owner = torch.zeros(arena.buffer.numel(), dtype=torch.int32)
    base = arena.buffer.data_ptr()
    for k, lease in enumerate(leases):
        assert lease.view.shape == (lease.num_chunks, C) and lease.view.stride() == (C + h, 1)
        for i, chunk in enumerate(lease.chunks()):
            start = chunk.data_ptr() - base
            assert chunk.is_contiguous() and chunk.numel() == C and torch.equal(chunk, lease.view[i])
            assert (owner[start - h : start + C] == 0).all()  # room and chunk belong to no one else
            owner[start - h : start] = -1
            owner[start : start + C] = k + 1
    assert (owner != 0).all() and (owner == -1).sum() == 5 * h  # nothing left over
    assert arena.live_bytes == 5 * C
    for lease in leases:
        lease.release()


@pytest.mark.parametrize("h", [0, 128])
def test_a_run_leased_again_gets_views_of_its_own_chunks(h):
    """An arena makes its chunks' views once and hands them to every lease: every lease, the first of its run or a
    repeat, has a view, chunk views and chunk(i) at the run's own addresses (first chunk at h + first * (h + C))."""
    cap = 24
    arena = StagingArena(C, cap, headroom=h)
    base, stride = arena.buffer.data_ptr(), C + h
    runs = [(first, n) for n in (1, 2, 5) for first in range(0, cap - n + 1, 1)]
    for first, n in runs + runs[::-1]:
        blocker = arena.acquire(first) if first else None  # first fit: the lease starts after it
        lease = arena.acquire(n)
        assert lease.first == first
        at = [base + h + (first + i) * stride for i in range(n)]
        assert [c.data_ptr() for c in lease.chunks()] == at == [lease.chunk(i).data_ptr() for i in range(n)]
        assert all(c.numel() == C and c.is_contiguous() for c in lease.chunks())
        rows = lease.view if h else lease.view.view(n, C)
        assert [rows[i].data_ptr() for i in range(n)] == at and rows.shape == (n, C)
        lease.release()
        if blocker is not None:
            blocker.release()
    assert arena.live_bytes == 0


@pytest.mark.parametrize("w", [2, 3, 5, 8])  # W = 1 has one window of one chunk: depth 1
def test_a_w_chunk_arena_holds_every_pair_of_depth_two_windows_at_once(w):
    """A restorer's own staging at depth 2: W chunks, windows of ceil(W/2) and floor(W/2) chunks, the
    next one leased while the one before it is held (released in order): never a wait, never above W."""
    arena = StagingArena(16, w)
    held = []
    for window in plan_windows(3 * w + 1, w, 2):
        lease = arena.try_acquire(window.num_chunks)
        assert lease is not None, f"W = {w}: window {window.index} of {window.num_chunks} chunks did not fit"
        held.append(lease)
        if len(held) == 2:
            held.pop(0).release()
        assert arena.live_bytes <= w * 16
    for lease in held:
        lease.release()
    assert arena.live_bytes == 0 and arena.peak_bytes == w * 16
