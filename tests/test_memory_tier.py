"""MemoryTier: the unit-test tier honours the Tier contract and every FaultPlan fault."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bsr_kernels import StagingPool
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MemoryTier,
    MissingObjectError,
    TierError,
    TierUnavailableError,
    memory,
)

FP = "0123456789abcdef0123456789abcdef"
C = 4096 + 16 * 5


def payloads(n: int, chunk_bytes: int = C, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (chunk_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def deadline(s: float = 10.0) -> float:
    return time.monotonic() + s


@pytest.fixture
def tier():
    t = MemoryTier(C, FP)
    yield t
    t.close()


def test_documented_as_test_only():
    assert "unit tests only" in memory.__doc__.lower()
    assert "unit tests only" in MemoryTier.__doc__.lower()


@pytest.mark.parametrize("chunk_bytes", [4096, C, 1 << 20])
def test_roundtrip_into_staging_pool(chunk_bytes):
    n = 5
    data = payloads(n, chunk_bytes, seed=chunk_bytes)
    keys = [f"k{i}" for i in range(n)]
    pool = StagingPool(chunk_bytes, capacity_chunks=n, num_slots=1)
    lease = pool.acquire(n)
    lease.view.zero_()
    views = [lease.chunk(i) for i in range(n)]
    with MemoryTier(chunk_bytes, FP) as t:
        t.put(keys, data)
        h = t.fetch(keys, views, deadline())
        assert isinstance(h, FetchHandle) and h.done()  # synchronous
        assert h.wait() == n * chunk_bytes
    assert all(torch.equal(v, d) for v, d in zip(views, data, strict=True))
    pool.release(lease)


def test_put_copies(tier):
    [d] = payloads(1)
    tier.put(["k"], [d])
    expect = d.clone()
    d.zero_()
    out = torch.zeros(C, dtype=torch.uint8)
    tier.fetch(["k"], [out], deadline()).wait()
    assert torch.equal(out, expect)


def test_probe_delete_missing(tier):
    keys = ["a", "b", "c"]
    tier.put(["a", "c"], payloads(2))
    assert tier.probe(keys) == [True, False, True]
    with pytest.raises(MissingObjectError):
        tier.fetch(keys, [torch.zeros(C, dtype=torch.uint8) for _ in keys], deadline()).wait()
    tier.delete(["a"])
    assert tier.probe(keys) == [False, False, True]
    assert len(tier) == 1


def test_bad_views(tier):
    with pytest.raises(ValueError):
        tier.put(["a"], [torch.zeros(C + 1, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        tier.fetch(["a"], [torch.zeros(C, dtype=torch.float32)], deadline())


def test_shared_store_registration_mismatch():
    store: dict = {}
    with MemoryTier(C, FP, store=store) as a, MemoryTier(C, "f" * 32, store=store) as b:
        a.put(["k"], payloads(1))
        assert b.probe(["k"]) == [True]
        with pytest.raises(CorruptObjectError, match="registration mismatch"):
            b.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], deadline()).wait()


def test_tenants_do_not_see_each_other(tier):
    tokens = list(range(512))
    ka = PrefixKeys(KeySpace(FP, salt="a"), tokens, 256).window(0, 2)
    kb = PrefixKeys(KeySpace(FP, salt="b"), tokens, 256).window(0, 2)
    tier.put(ka, payloads(2))
    assert tier.probe(kb) == [False, False]


def test_fault_unavailable(tier):
    tier.put(["k"], payloads(1))
    tier.faults.unavailable = True
    out = torch.zeros(C, dtype=torch.uint8)
    for op in (
        lambda: tier.probe(["k"]),
        lambda: tier.fetch(["k"], [out], deadline()),
        lambda: tier.put(["k"], [out]),
        lambda: tier.delete(["k"]),
    ):
        with pytest.raises(TierUnavailableError):
            op()
    tier.faults.clear()
    assert tier.probe(["k"]) == [True]


def test_fault_drop_after_probe(tier):
    tier.put(["a", "b"], payloads(2))
    tier.faults.drop_after_probe = {"a"}
    assert tier.probe(["a", "b"]) == [True, True]
    with pytest.raises(MissingObjectError):
        tier.fetch(["a"], [torch.zeros(C, dtype=torch.uint8)], deadline()).wait()
    assert tier.probe(["a", "b"]) == [False, True]


def test_fault_delay(tier):
    [d] = payloads(1)
    tier.put(["k"], [d])
    tier.faults.delay_s = 0.2
    out = torch.zeros(C, dtype=torch.uint8)
    h = tier.fetch(["k"], [out], time.monotonic() + 0.02)
    assert not h.done() and h.quiesce(0)  # late completion, but nothing lands any more
    with pytest.raises(FetchTimeoutError):
        h.wait()
    t0 = time.monotonic()
    assert tier.fetch(["k"], [out], deadline()).wait() == C
    assert time.monotonic() - t0 >= 0.15
    assert torch.equal(out, d)


def test_fault_corrupt_keys(tier):
    tier.put(["a", "b"], payloads(2))
    tier.faults.corrupt_keys = {"b"}
    out = [torch.zeros(C, dtype=torch.uint8) for _ in range(2)]
    tier.fetch(["a"], out[:1], deadline()).wait()
    with pytest.raises(CorruptObjectError, match="checksum"):
        tier.fetch(["a", "b"], out, deadline()).wait()
    tier.faults.clear()
    tier.fetch(["a", "b"], out, deadline()).wait()


def test_fault_fail_fetch(tier):
    tier.put(["k"], payloads(1))
    seen = []

    def boom(keys):
        seen.append(tuple(keys))
        raise KeyError("injected")

    tier.faults.fail_fetch = boom
    with pytest.raises(TierError) as ei:
        tier.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], deadline()).wait()
    assert seen == [("k",)] and isinstance(ei.value.__cause__, KeyError)


def test_no_threads_after_close():
    t = MemoryTier(C, FP)
    t.put(["k"], payloads(1))
    t.faults.delay_s = 5.0
    h = t.fetch(["k"], [torch.zeros(C, dtype=torch.uint8)], deadline(30))
    assert any(isinstance(x, threading.Timer) for x in threading.enumerate())
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 2.0
    assert not any(isinstance(x, threading.Timer) for x in threading.enumerate())
    with pytest.raises(TierUnavailableError):
        h.wait()
    with pytest.raises(TierUnavailableError):
        t.probe(["k"])
    t.close()
