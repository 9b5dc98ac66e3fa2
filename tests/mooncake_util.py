"""Helpers of the Mooncake tests: a shared client reset for the next test, payloads, where an object
lies in a holder's segment, a byte flipped in that segment memory for the length of a block, and
poisoned views between guard bytes (adjacent, or each after some header room)."""

from __future__ import annotations

import contextlib
import ctypes
import time

import torch

from bsr_harness.testdata import POISON
from bsr_kernels.staging_arena import StagingArena


def as_new(tier) -> None:
    """A client shared by a module's tests, put back in a new client's state for the next test: no
    header, landing or put-staging buffers (each read registers its own again), counters at zero."""
    tier._reads.headers.close()
    tier._reads.landing.close()
    tier._staging.close()
    for name in tier.stats:
        tier.stats[name] = 0


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


def fetch(tier, keys: list[str], pool: StagingArena) -> list[torch.Tensor]:
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
