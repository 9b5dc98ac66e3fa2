"""Property: a restore is all or nothing, across TP ranks and HMA groups.

Random registrations, prefix lengths N, windows W, pipeline depths, TP world sizes, an optional
lower tier (holding the complete prefix, a partial one, or nothing) and a random fault point
(window, phase fetch | install, rank). Ranks are simulated in one process (MemoryTier, the
commit rule over the list of per-rank validity vectors); tests/integration/tp/test_tp_ranks.py covers real
processes. The outcome is either the full prefix committed on every rank with each rank's
state hash equal to what it stored, or zero tokens exposed on every rank with every block of
the request in every group invalid — never anything in between.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kernel_util import registrations

from bsr_harness.fault_matrix import FETCH, INSTALL, FaultSpec, make_source, store
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.memory_tier import MemoryTier
from bsr_harness.testdata import block_tables, poison, prefix_block_ids
from bsr_runtime import commit
from bsr_runtime.plan import count_windows
from bsr_runtime.restore import RestoreConfig, RestoreRequest
from bsr_runtime.retrieve import LOCAL, Retriever
from bsr_runtime.state_hash import state_hash


@st.composite
def cases(draw):
    reg = draw(registrations(max_tensors=4, max_groups=3))
    n = draw(st.integers(1, 5))
    w = draw(st.integers(0, 4))
    depth = draw(st.sampled_from([1, 2]))
    world = draw(st.integers(1, 3))
    windows = count_windows(n, w, depth)
    fault = None
    if draw(st.sampled_from([False, True, True, True])):  # mostly a fault, sometimes none
        fault = FaultSpec(window=draw(st.integers(0, windows - 1)), phase=draw(st.sampled_from([FETCH, INSTALL])),
                          rank=draw(st.none() | st.integers(0, world - 1)))
    lower = draw(st.sampled_from([None, "full", "partial"]))
    seed = draw(st.integers(0, 2**16))
    return reg, n, w, depth, world, fault, lower, seed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_outcome_is_all_or_nothing(case):
    reg, n, w, depth, world, fault, lower, seed = case
    ct = reg.chunk_tokens
    blocks, tables = block_tables(reg, [n] * world, seed)  # each rank: its own blocks of one kv set
    retrievers, requests, sources = [], [], []
    try:
        for r in range(world):
            src = make_source(reg, n, seed, salt="prop", tp_rank=r, tp_world=world, kv_seed=seed + 31 * r + 1)
            top = FaultyTier(MemoryTier(reg.chunk_bytes, reg.fingerprint))
            store(src, top)
            tiers = [top]
            if lower is not None:
                low = MemoryTier(reg.chunk_bytes, reg.fingerprint)
                store(src, low)
                if lower == "partial":  # the lower tier lacks the last chunk: it cannot serve
                    low.delete(src.keys(n - 1, 1))
                tiers.append(low)
            ret = Retriever(reg, tiers, RestoreConfig(window_chunks=w, pipeline_depth=depth,
                                                      backend="torch"))
            if fault is not None:
                fault.arm(ret, top, r)
            kv = poison(reg.allocate(blocks))  # nothing restored reads as a restore
            requests.append(RestoreRequest(f"req-{seed}", src.tokens, src.keyspace, kv, tables[r]))
            retrievers.append(ret)
            sources.append(src)

        locals_ = [ret.restore_local(req, n, plan_tier=0) for ret, req in zip(retrievers, requests)]
        agreed = commit.agree_local([loc.valid_per_group for loc in locals_])
        outs = [loc.decide(agreed) for loc in locals_]

        committed = {o.committed for o in outs}
        event(f"world={world} fault={'none' if fault is None else fault.phase} lower={lower} "
              f"-> {'committed' if all(committed) else 'failed_closed'}")
        assert len(committed) == 1, "some ranks committed and others did not"
        faulty = [r for r in range(world) if fault is not None and fault.applies_to(r)]
        expect_commit = not faulty or lower == "full"
        assert committed == {expect_commit}
        for r, (o, req, src, ret) in enumerate(zip(outs, requests, sources, retrievers)):
            every = prefix_block_ids(reg, req.block_tables, n)  # the oracle, not the code under test
            assert o.block_ids == every
            if o.committed:
                assert o.exposed_tokens == n * ct
                assert all(not s for s in o.invalid_block_ids)
                assert state_hash(reg, req.kv, req.block_tables, n) == src.state_hash
                assert o.served_by == "memory"
                if r in faulty:  # served by the lower tier after the top one failed
                    assert len(o.attempts) == 2 and not o.attempts[0].ok and o.attempts[1].ok
            else:
                assert o.exposed_tokens == 0 and o.served_by == LOCAL
                assert o.invalid_block_ids == every  # all blocks of every group, whatever was installed
                if r not in faulty:  # its own restore succeeded: only the commit rule withheld it
                    assert o.attempts[0].ok and "commit rule" in o.error
                elif lower == "partial":  # probed, found short of the prefix, never restored from
                    assert [a.probed_chunks for a in o.attempts] == [None, n - 1]
                    assert o.attempts[1].windows == 0 and not o.attempts[1].ok
            pool = ret.restorer.staging
            assert pool is None or pool.live_bytes == 0
    finally:
        for ret in retrievers:
            ret.close()
