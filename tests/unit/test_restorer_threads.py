"""One BoundedRestorer is one restore at a time: a concurrent restore() on the same restorer is
refused at once with a clear RuntimeError (it used to compete for the first restore's staging
slots and fail with slot timeouts). Concurrent restores use one restorer per thread, sharing a
staging arena of B bytes (tests/unit/test_concurrent_budget.py)."""

from __future__ import annotations

import threading
import time

import pytest
from restore_util import fresh_request, store_random_prefix

from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import presets
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.state_hash import state_hash

REG = presets.llama_like(layers=2, kv_heads=1, head_dim=16, block_size=16)
N = 4
MESSAGE = "not thread-safe: one restore at a time per restorer"


@pytest.fixture
def stored():
    tier = FaultyTier(MemoryTier(REG.chunk_bytes, REG.fingerprint))
    return tier, store_random_prefix(REG, tier, N, seed=61)


def test_second_concurrent_restore_is_refused(stored):
    tier, sp = stored
    entered, release = threading.Event(), threading.Event()

    def hold(keys) -> None:  # the first restore waits inside its first fetch
        entered.set()
        release.wait(30)

    result = {}
    with BoundedRestorer(REG, RestoreConfig(window_chunks=2, pipeline_depth=2)) as r:
        first_req = fresh_request(sp, seed=62, request_id="first")
        tier.plan.fail_fetch = hold
        t = threading.Thread(target=lambda: result.setdefault("rep", r.restore(first_req, tier, N)))
        t.start()
        try:
            assert entered.wait(30)
            second_req = fresh_request(sp, seed=63, request_id="second")
            with pytest.raises(RuntimeError, match=MESSAGE):
                r.restore(second_req, tier, N)
        finally:
            tier.plan.fail_fetch = None
            release.set()
            t.join(30)
        assert not t.is_alive()
        rep = result["rep"]
        assert rep.ok and state_hash(REG, first_req.kv, first_req.block_tables, N) == sp.state_hash
        assert r.staging.live_bytes == 0
        # the restorer is usable again once the first restore returned
        again = fresh_request(sp, seed=64, request_id="again")
        assert r.restore(again, tier, N).ok
        assert state_hash(REG, again.kv, again.block_tables, N) == sp.state_hash


def test_four_threads_on_one_restorer_never_time_out(stored):
    """The reported scenario: 4 threads share one restorer with its own staging. Each restore
    either completes with the right state or is refused with the clear error (no slot timeout)."""
    tier, sp = stored
    reqs = [fresh_request(sp, seed=70 + i, request_id=f"t{i}") for i in range(4)]
    results: list[list] = [[] for _ in range(4)]
    start = threading.Barrier(4)
    tier.plan.fail_fetch = lambda keys: time.sleep(0.01)  # slow fetches: the restores overlap
    with BoundedRestorer(REG, RestoreConfig(window_chunks=2, pipeline_depth=2, fetch_timeout_s=2)) as r:
        def work(i: int) -> None:
            start.wait(30)
            for _ in range(10):
                try:
                    results[i].append(r.restore(reqs[i], tier, N))
                except RuntimeError as e:
                    results[i].append(e)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert r.staging.live_bytes == 0
    for i, runs in enumerate(results):
        assert len(runs) == 10
        for res in runs:
            if isinstance(res, Exception):
                assert MESSAGE in str(res)
            else:
                assert res.ok, res.error  # never a slot timeout
        if any(not isinstance(res, Exception) for res in runs):
            assert state_hash(REG, reqs[i].kv, reqs[i].block_tables, N) == sp.state_hash
    assert any(not isinstance(res, Exception) for runs in results for res in runs)
