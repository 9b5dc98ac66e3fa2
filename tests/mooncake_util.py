"""Helpers of the Mooncake tests: clients closed off the tests' path, payloads, where an object lies
in a holder's segment, a byte flipped in that segment memory for the length of a block, and
poisoned views between guard bytes (adjacent, or each after some header room)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import torch

from bsr_harness.testdata import POISON
from bsr_kernels.staging_pool import StagingPool


class BackgroundCloser:
    """Closes Mooncake clients, and stops masters, on threads of their own: a client's close joins
    native threads that wake once a second (1-2 s, mostly asleep; a master unmounts one segment at
    a time), so the next test or module need not wait for it. `wait()` joins everything handed
    over so far and raises the first error one of them raised."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def close_later(self, closables) -> list[threading.Thread]:
        started = [self._start(c.close) for c in closables]
        self._threads += started
        return started

    def close_now(self, closables) -> None:
        """Closes them all at once and returns when every one is closed."""
        self._join(self.close_later(closables))

    def stop_later(self, master) -> None:
        """Stops `master` once every close handed over so far has ended (its clients close first)."""
        pending, self._threads = self._threads, []

        def after_closes() -> None:
            for t in pending:
                t.join()
            master.stop()

        self._threads.append(self._start(after_closes))

    def wait(self) -> None:
        threads, self._threads = self._threads, []
        self._join(threads)

    def _start(self, work) -> threading.Thread:
        t = threading.Thread(target=self._run, args=(work,), name="test-mooncake-close", daemon=True)
        t.start()
        return t

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as e:  # re-raised by _join, on the test's thread
            self._errors.append(e)

    def _join(self, threads: list[threading.Thread]) -> None:
        for t in threads:
            t.join()
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first


def payloads(n: int, seed: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def segment_address(tier, key: str, size: int) -> int:
    """Where `key`'s object (header first) lies in `tier`'s own segment (fails unless it is there)."""
    (addr,) = tier._reads.local.addresses([key], [size]).values()
    return addr


@contextlib.contextmanager
def flipped(address: int, mask: int):
    """The byte at `address` (in a store segment of this process) xor-ed with mask, then restored."""
    byte = ctypes.c_uint8.from_address(address)
    byte.value ^= mask
    try:
        yield
    finally:
        byte.value ^= mask


def assert_same(got: list[torch.Tensor], data: list[torch.Tensor]) -> None:
    assert len(got) == len(data)
    for i, (g, d) in enumerate(zip(got, data, strict=True)):
        assert torch.equal(g, d), f"view {i} differs from what was stored"


def fetch(tier, keys: list[str], pool: StagingPool) -> list[torch.Tensor]:
    """tier.fetch of `keys` into poisoned views of one lease of `pool`; copies of what landed."""
    lease = pool.acquire(len(keys))
    lease.view.fill_(POISON)
    views = [lease.chunk(i) for i in range(len(keys))]
    try:
        tier.fetch(keys, views, time.monotonic() + 20).wait()
        return [v.clone() for v in views]
    finally:
        pool.release(lease)


def stored(holder, tag: str, n: int, seed: int, size: int) -> tuple[list[str], list[torch.Tensor]]:
    """n random payloads of `size` bytes put by `holder` under tag/0 .. tag/n-1."""
    keys = [f"{tag}/{i}" for i in range(n)]
    data = payloads(n, seed, size)
    holder.put(keys, data)
    return keys, data


class GuardedViews:
    """`slots` views of `size` bytes in one registered buffer, each after `room` bytes of header room
    (0: the views are adjacent), between two guards of `guard` bytes; all poisoned."""

    def __init__(self, reader, slots: int, size: int, room: int = 0, guard: int = 4096) -> None:
        self.slots, self.size, self.room_bytes, self.guard = slots, size, room, guard
        self.buf = torch.full((2 * guard + slots * (room + size),), POISON, dtype=torch.uint8)
        self.reader = reader
        reader.register_staging(self.buf)

    def slot(self, j: int) -> torch.Tensor:
        s = self.guard + j * (self.room_bytes + self.size) + self.room_bytes
        return self.buf[s : s + self.size]

    def room(self, j: int) -> torch.Tensor:
        s = self.guard + j * (self.room_bytes + self.size)
        return self.buf[s : s + self.room_bytes]

    def ptrs(self, slots: list[int]) -> list[int]:
        return [self.slot(j).data_ptr() for j in slots]

    def untouched(self, used: list[int]) -> bool:
        """The guards, and every slot not in `used` with its room, still hold only the poison."""
        rest = [self.buf[: self.guard], self.buf[-self.guard :]]
        rest += [r for j in range(self.slots) if j not in used for r in (self.room(j), self.slot(j))]
        return all(bool((r == POISON).all()) for r in rest)

    def close(self) -> None:
        self.reader.unregister_staging(self.buf)
