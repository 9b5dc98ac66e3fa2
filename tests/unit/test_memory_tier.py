"""MemoryTier: what only the unit-test tier does. The Tier contract and every FaultyTier fault
run against it (and every other tier) in tests/unit/test_tier_contract.py."""

from __future__ import annotations

import time

import pytest
import torch

import bsr_runtime.tiers as runtime_tiers
from bsr_harness.memory_tier import MemoryTier
from bsr_runtime.tiers import CorruptObjectError, FetchHandle

FP = "0123456789abcdef0123456789abcdef"
C = 4096 + 16 * 5


def payloads(n: int, chunk_bytes: int = C, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (chunk_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def deadline(s: float = 10.0) -> float:
    return time.monotonic() + s


def test_a_test_only_tier_the_runtime_does_not_ship():
    assert "unit tests only" in MemoryTier.__doc__.lower() and MemoryTier.__module__ == "bsr_harness.memory_tier"
    assert not hasattr(runtime_tiers, "MemoryTier") and "MemoryTier" not in runtime_tiers.__all__


def test_fetch_is_synchronous():
    data = payloads(3)
    out = [torch.zeros(C, dtype=torch.uint8) for _ in data]
    with MemoryTier(C, FP) as t:
        t.put(["a", "b", "c"], data)
        h = t.fetch(["a", "b", "c"], out, deadline())
        assert isinstance(h, FetchHandle) and h.done() and h.quiesce(0)  # completed before fetch returned
        assert h.wait() == 3 * C
    assert all(torch.equal(v, d) for v, d in zip(out, data, strict=True))


def test_len_counts_objects():
    with MemoryTier(C, FP) as t:
        t.put(["a", "c"], payloads(2))
        assert len(t) == 2
        t.delete(["a", "b"])
        assert len(t) == 1


def test_shared_store_registration_mismatch():
    store: dict = {}
    with MemoryTier(C, FP, store=store) as a, MemoryTier(C, "f" * 32, store=store) as b:
        a.put(["k"], payloads(1))
        assert b.probe(["k"]) == [True]
        with pytest.raises(CorruptObjectError, match="registration mismatch"):
            b.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], deadline()).wait()
