"""Helpers of the Mooncake read-path tests: payloads, where an object lies in a holder's segment,
and a byte flipped in that segment memory for the length of a block."""

from __future__ import annotations

import contextlib
import ctypes
import time

import torch

from bsr_harness.testdata import POISON
from bsr_kernels.staging_pool import StagingPool


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
