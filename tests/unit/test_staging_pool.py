"""StagingPool: fixed capacity, slots, meters, synchronize-then-release."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bsr_kernels import StagingPool

C = 4096


def test_capacity_and_slots():
    pool = StagingPool(C, 5, num_slots=2)
    assert pool.slot_chunks == [3, 2]
    assert pool.capacity_bytes == 5 * C == pool.buffer.numel()
    assert StagingPool(C, 1, num_slots=2).slot_chunks == [1]  # one chunk cannot be split


def test_meters_track_live_and_peak():
    pool = StagingPool(C, 4, num_slots=2)
    a = pool.acquire(2)
    assert pool.live_bytes == 2 * C and pool.peak_bytes == 2 * C
    b = pool.acquire(1)
    assert pool.live_bytes == 3 * C and pool.peak_bytes == 3 * C
    assert a.view.numel() == 2 * C and b.view.numel() == C
    assert a.view.data_ptr() != b.view.data_ptr()
    a.record()
    a.synchronize()
    a.release()
    pool.release(b)
    assert pool.live_bytes == 0 and pool.peak_bytes == 3 * C and pool.free_bytes == 4 * C
    pool.reset_peak()
    assert pool.peak_bytes == 0


def test_never_hands_out_more_than_capacity():
    pool = StagingPool(C, 4, num_slots=2)
    with pytest.raises(ValueError, match="exceeds the staging slot capacity"):
        pool.acquire(3)
    with pytest.raises(ValueError, match="positive"):
        pool.acquire(0)
    a, b = pool.acquire(2), pool.acquire(2)
    with pytest.raises(TimeoutError):
        pool.acquire(1, timeout=0.05)
    pool.release(a)
    pool.release(b)


def test_acquire_waits_for_release():
    pool = StagingPool(C, 2)
    lease = pool.acquire(2)
    got = []

    def waiter():
        got.append(pool.acquire(1, timeout=5))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    assert not got
    pool.release(lease)
    t.join(5)
    assert got and pool.live_bytes == C
    pool.release(got[0])


def test_double_release_is_an_error():
    pool = StagingPool(C, 2)
    lease = pool.acquire(1)
    pool.release(lease)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(lease)


def test_deferred_release_keeps_bytes_live_until_reaped():
    pool = StagingPool(C, 2, num_slots=2)
    lease = pool.acquire(1)
    lease.record()
    pool.release(lease, deferred=True)
    # on CPU the install event completed at record time, so the meter returns the bytes
    assert pool.live_bytes == 0
    pool.drain()
    assert pool.free_bytes == pool.capacity_bytes


class _DelayedHostStream:
    """A host stream whose work completes only when synchronize() is called."""

    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True


def test_release_before_synchronize_is_an_error():
    pool = StagingPool(C, 2)
    lease = pool.acquire(1)
    stream = _DelayedHostStream()
    lease.record(stream)
    with pytest.raises(RuntimeError, match="before the work recorded on it was synchronized"):
        lease.release()
    assert not stream.done and pool.live_bytes == C
    lease.synchronize()
    assert stream.done
    lease.release()
    assert pool.live_bytes == 0


def test_deferred_release_waits_for_a_host_stream_before_reuse():
    pool = StagingPool(C, 1)
    lease = pool.acquire(1)
    stream = _DelayedHostStream()
    lease.record(stream)
    pool.release(lease, deferred=True)
    assert pool.live_bytes == C  # the host stream has not completed: the bytes stay live
    again = pool.acquire(1, timeout=1)  # synchronize-then-reuse
    assert stream.done
    pool.release(again)


@pytest.mark.parametrize("bad,match", [
    (dict(chunk_bytes=10, capacity_chunks=1), "multiple of 16"),
    (dict(chunk_bytes=C, capacity_chunks=0), "at least one chunk"),
    (dict(chunk_bytes=C, capacity_chunks=2, num_slots=3), "num_slots"),
])
def test_bad_pool_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        StagingPool(**bad)


@pytest.mark.parametrize("slots", [1, 2])
def test_headroom_leaves_scratch_before_every_chunk(slots):
    """headroom h: chunk i of a slot at h + i * (h + C) from the slot's start; a lease's view is
    (n, C) with rows h + C apart; views and rooms of all leases tile the buffer without overlap;
    the meters count chunk bytes, the room is room_bytes."""
    h = 128
    pool = StagingPool(C, 5, num_slots=slots, headroom=h)
    assert pool.chunk_stride == C + h and pool.buffer.numel() == 5 * (C + h)
    assert pool.capacity_bytes == 5 * C and pool.room_bytes == 5 * h
    leases = [pool.acquire(n) for n in pool.slot_chunks]
    owner = torch.zeros(pool.buffer.numel(), dtype=torch.int32)
    base = pool.buffer.data_ptr()
    for k, lease in enumerate(leases):
        assert lease.view.shape == (lease.num_chunks, C) and lease.view.stride() == (C + h, 1)
        for i, chunk in enumerate(lease.chunks()):
            start = chunk.data_ptr() - base
            assert chunk.is_contiguous() and chunk.numel() == C and torch.equal(chunk, lease.view[i])
            assert (owner[start - h : start + C] == 0).all()  # room and chunk belong to no one else
            owner[start - h : start] = -1
            owner[start : start + C] = k + 1
    assert (owner != 0).all() and (owner == -1).sum() == 5 * h  # nothing left over
    assert pool.live_bytes == 5 * C
    for lease in leases:
        pool.release(lease)


@pytest.mark.parametrize("bad", [-16, 8, 100, True, 1.5])
def test_headroom_must_be_a_multiple_of_16(bad):
    with pytest.raises(ValueError, match="headroom"):
        StagingPool(C, 2, headroom=bad)
