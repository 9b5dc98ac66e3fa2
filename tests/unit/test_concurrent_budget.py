"""Concurrent restores under one global byte budget B (issue 7, item 1).

16 requests restore at once, each on its own thread with its own BoundedRestorer (random
length, W in {1..4}, depth in {1, 2}), all leasing their windows' staging from ONE StagingArena
of B bytes. Some requests carry a fault on their own keys only (a missing object or a corrupt
one). A sampler thread reads the arena's live staging under its lock (one consistent cut).

Asserted: the aggregate never exceeds B; healthy requests commit with the stored state hash;
faulted ones fail closed (ok=False, committed_tokens == 0); every thread finishes within a
generous bound (no deadlock); the arena ends empty. The arena is FIFO: a large lease queued
first is served before a later small one that would fit.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.faulty_tier import FaultyTier
from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.keys import PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers.base import FETCH_HEADROOM

NUM_REQUESTS = 16
MAX_CHUNKS = 12
BUDGET_CHUNKS = 6  # B = 6 chunks: W <= 4, so at most ~2 requests hold staging at once
JOIN_BOUND_S = 120.0  # generous: the whole run takes a few seconds


class TimedArena(StagingArena):
    """A StagingArena that records how long each blocking lease waited, per thread."""

    def __init__(self, chunk_bytes: int, chunks: int) -> None:
        super().__init__(chunk_bytes, chunks, headroom=FETCH_HEADROOM)
        self.waits: dict[str, list[float]] = {}
        self._waits_lock = threading.Lock()

    def acquire(self, num_chunks: int, timeout: float | None = None, should_stop=None):
        t0 = time.monotonic()
        lease = super().acquire(num_chunks, timeout, should_stop)
        waited = time.monotonic() - t0
        with self._waits_lock:
            self.waits.setdefault(threading.current_thread().name, []).append(waited)
        return lease


def _reg():
    return presets.dsv4_flash(scale=1 / 64)


def _plan(seed: int):
    """Per request: (chunks, W, depth, fault); faults on a fixed, seeded subset of requests."""
    rng = random.Random(seed)
    faulted = set(rng.sample(range(NUM_REQUESTS), 6))
    plans = []
    for i in range(NUM_REQUESTS):
        fault = rng.choice(["missing", "corrupt"]) if i in faulted else None
        plans.append((rng.randint(1, MAX_CHUNKS), rng.choice([1, 2, 3, 4]), rng.choice([1, 2]), fault))
    return plans


def run_concurrent(inner, seed: int):
    tier = FaultyTier(inner, close_inner=False)
    reg = _reg()
    c = reg.chunk_bytes
    plans = _plan(seed)
    rng = random.Random(seed + 1)
    budget = TimedArena(c, BUDGET_CHUNKS)
    tier.register_staging(budget.buffer)  # a shared arena is its owner's to register
    jobs = []
    corrupt: set[str] = set()
    for i, (n, w, depth, fault) in enumerate(plans):
        src = make_source(reg, n, seed=seed * 100 + i)
        expected = store_source(src, tier, window_chunks=4)
        keys = PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens)
        if fault is not None:  # a key of this request's own prefix only
            victim = keys.window(rng.randrange(n), 1)[0]
            if fault == "missing":
                tier.delete([victim])
            else:
                corrupt.add(victim)
        dst = Destinations(reg, n, seed=seed * 100 + i + 50)
        dst.poison()
        req = RestoreRequest(f"req-{i}", src.tokens, src.keyspace, dst.kv, dst.tables)
        restorer = BoundedRestorer(reg, RestoreConfig(window_chunks=w, pipeline_depth=depth,
                                                      fetch_timeout_s=60.0), arena=budget)
        jobs.append(dict(i=i, n=n, w=w, depth=depth, fault=fault, expected=expected, dst=dst, req=req,
                         restorer=restorer, report=None, error=None))
    tier.plan.corrupt_keys = corrupt

    samples: list[int] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append(budget.live_bytes)  # under the arena's lock: one consistent cut
            time.sleep(0.0005)

    start = threading.Barrier(NUM_REQUESTS)

    def worker(job) -> None:
        try:
            start.wait(timeout=30)
            job["report"] = job["restorer"].restore(job["req"], tier, job["n"])
        except BaseException as e:  # recorded and asserted below
            job["error"] = e

    samp = threading.Thread(target=sampler, name="budget-sampler")
    threads = [threading.Thread(target=worker, args=(j,), name=f"req-{j['i']}") for j in jobs]
    t0 = time.monotonic()
    samp.start()
    for t in threads:
        t.start()
    end = time.monotonic() + JOIN_BOUND_S
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    elapsed = time.monotonic() - t0
    stop.set()
    samp.join(10)
    stuck = [t.name for t in threads if t.is_alive()]
    try:
        assert not stuck, f"deadlock or starvation: {stuck} still running after {JOIN_BOUND_S}s"
        assert not samp.is_alive()
        for j in jobs:
            assert j["error"] is None, f"req-{j['i']}: {j['error']!r}"
            rep = j["report"]
            if j["fault"] is None:
                assert rep.ok, f"req-{j['i']} (healthy): {rep.error}"
                assert rep.committed_tokens == j["n"] * reg.chunk_tokens
                assert state_hash(reg, j["dst"].kv, j["dst"].tables, j["n"]) == j["expected"]
            else:
                assert not rep.ok, f"req-{j['i']} ({j['fault']}) committed"
                assert rep.committed_tokens == 0
                expect = "MissingObjectError" if j["fault"] == "missing" else "CorruptObjectError"
                assert expect in (rep.error or ""), rep.error
            assert j["restorer"].staging is None  # nothing of its own: every window leased from the arena
        assert samples, "the sampler took no sample"
        max_live = max(samples)
        assert 0 < max_live <= budget.capacity_bytes
        assert budget.peak_bytes <= budget.capacity_bytes
        assert budget.live_bytes == 0
        waits = [w for ws in budget.waits.values() for w in ws]
        assert len(budget.waits) == NUM_REQUESTS  # every request waited for a lease at least once
        print(f"\n[{tier.name}] B = {budget.capacity_bytes:,} B ({BUDGET_CHUNKS} chunks of {c:,} B); "
              f"{len(samples)} samples: max aggregate live staging {max_live:,} B, "
              f"arena peak {budget.peak_bytes:,} B; max admission wait {max(waits):.3f} s over {len(waits)} "
              f"blocking leases; {sum(j['fault'] is None for j in jobs)} healthy committed, "
              f"{sum(j['fault'] is not None for j in jobs)} faulted failed closed; {elapsed:.2f} s")
        return dict(max_live=max_live, budget=budget.capacity_bytes, max_wait=max(waits))
    finally:
        tier.clear()
        for j in jobs:
            j["restorer"].close()
        tier.unregister_staging(budget.buffer)
        tier.close()


@pytest.mark.parametrize("seed", [7, 8])
def test_concurrent_restores_filesystem(tmp_path, seed):
    reg = _reg()
    with FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint, load_concurrency=4) as tier:
        run_concurrent(tier, seed)


@pytest.mark.mooncake
def test_concurrent_restores_mooncake(mooncake_master):
    from bsr_runtime.tiers.mooncake import MooncakeTier

    reg = _reg()
    tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, mooncake_master.master_address,
                        mooncake_master.metadata_server, global_segment_size=128 << 20)
    try:
        run_concurrent(tier, seed=9)
    finally:
        tier.close()


def test_the_arena_is_fifo():
    """A large lease queued first is served before a later small one that would fit; try_acquire does
    not jump the queue either."""
    arena = StagingArena(16, 4)
    first = arena.acquire(3)
    order: list[str] = []
    granted = {"big": threading.Event(), "small": threading.Event()}
    leases = {}

    def take(name: str, n: int) -> None:
        leases[name] = arena.acquire(n, timeout=60)
        order.append(name)
        granted[name].set()

    def queued(k: int) -> None:
        end = time.monotonic() + 30
        while arena.waiters < k:
            assert time.monotonic() < end, "lease never queued"
            time.sleep(0.001)

    big = threading.Thread(target=take, args=("big", 4))
    small = threading.Thread(target=take, args=("small", 1))
    try:
        big.start()
        queued(1)
        small.start()  # 3 + 1 <= 4 would fit, but "big" is ahead of it
        queued(2)
        assert arena.try_acquire(1) is None  # no queue jumping
        assert not granted["big"].is_set() and not granted["small"].is_set()
        first.release()
        assert granted["big"].wait(30)
        assert not granted["small"].is_set()  # 4 + 1 > 4: still waiting behind the arena
        assert arena.live_bytes == 4 * 16
        leases["big"].release()
        assert granted["small"].wait(30)
        assert order == ["big", "small"]
        leases["small"].release()
        assert arena.live_bytes == 0 and arena.peak_bytes == 4 * 16
    finally:
        for t in (big, small):
            t.join(30)
        assert not big.is_alive() and not small.is_alive()
