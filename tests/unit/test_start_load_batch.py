"""start_load runs a batch of loads; each completes or fails closed on its own.

A load that raises (a block id of 2**70 that no int64 tensor holds, a bad chunk count, a plan
tier that does not exist, a wrong number of groups) used to abort the whole batch: the loads
after it never ran and were never reported, and the failing one got no force-local marker.
Now the failing load is reported like any failed load (failed_recving, every block of every
group in get_block_ids_with_load_errors, marker set), and every other load still commits.
"""

from __future__ import annotations

import pytest

from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.memory_tier import MemoryTier
from bsr_harness.standalone_connector import ConnectorRequest, LoadSpec, StandaloneConnector
from bsr_harness.testdata import prefix_block_ids
from bsr_kernels import presets
from bsr_runtime.restore import RestoreConfig
from bsr_runtime.state_hash import state_hash

REG = presets.dsv4_flash(scale=1 / 64)  # 5 HMA groups
N = 3


def _huge_block(blocks):
    blocks[1][0] = 2**70
    return blocks


def _short_groups(blocks):
    return blocks[:1]


BREAKERS = {
    "block_id_2**70": (lambda spec: LoadSpec(spec.request_id, spec.tokens, spec.num_chunks, spec.plan_tier,
                                             _huge_block(spec.block_ids))),
    "float_num_chunks": (lambda spec: LoadSpec(spec.request_id, spec.tokens, 2.5, spec.plan_tier, spec.block_ids)),
    "plan_tier_7": (lambda spec: LoadSpec(spec.request_id, spec.tokens, spec.num_chunks, 7, spec.block_ids)),
    "one_group": (lambda spec: LoadSpec(spec.request_id, spec.tokens, spec.num_chunks, spec.plan_tier,
                                        _short_groups(spec.block_ids))),
    "float_tokens": (lambda spec: LoadSpec(spec.request_id, [t + 0.5 for t in spec.tokens], spec.num_chunks,
                                           spec.plan_tier, spec.block_ids)),
}


@pytest.fixture
def setup():
    tier = MemoryTier(REG.chunk_bytes, REG.fingerprint)
    srcs, dsts, hashes = [], [], []
    for i in range(3):
        src = make_source(REG, N, seed=300 + i)
        hashes.append(store_source(src, tier, window_chunks=2))
        srcs.append(src)
        dsts.append(Destinations(REG, N, seed=400 + i))
    # one engine: every request's blocks live in one set of kv caches (per-request block ranges)
    kv = REG.allocate([sum(d.blocks[g] for d in dsts) for g in range(REG.num_groups)])
    conn = StandaloneConnector(REG, [tier], kv, config=RestoreConfig(window_chunks=2, backend="torch"))
    yield conn, srcs, dsts, hashes, kv
    conn.close()


def _specs(conn, srcs, dsts):
    offsets = [0] * REG.num_groups
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        req = ConnectorRequest(f"r{i}", src.tokens + [1])
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        assert tokens == N * REG.chunk_tokens
        blocks = []
        for g, t in enumerate(dst.tables):
            blocks.append([b + offsets[g] if b >= 0 else -1 for b in t.tolist()])
            offsets[g] += dst.blocks[g]
        conn.update_state_after_alloc(req, blocks, tokens)
    return conn.take_pending_loads()


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
@pytest.mark.parametrize("bad_index", [0, 1])
def test_one_bad_load_does_not_drop_the_batch(setup, breaker, bad_index):
    conn, srcs, dsts, hashes, kv = setup
    specs = _specs(conn, srcs, dsts)
    specs[bad_index] = BREAKERS[breaker](specs[bad_index])
    bad = specs[bad_index]
    outcomes = conn.start_load(specs)
    assert len(outcomes) == 3
    fin = conn.get_finished(set())
    assert fin.finished_recving == {"r0", "r1", "r2"}
    assert fin.failed_recving == {bad.request_id}
    errors = conn.get_block_ids_with_load_errors()
    if breaker in ("float_num_chunks", "one_group"):  # no prefix to size: every block the spec names
        expect = {b for ids in bad.block_ids for b in ids if b >= 0}
    else:  # the oracle, not request_block_ids (the code under test)
        expect = set().union(*prefix_block_ids(REG, bad.block_ids, bad.num_chunks))
    assert expect and errors == expect
    assert conn.markers.is_set(bad.request_id)
    for i, out in enumerate(outcomes):
        if out.request_id == bad.request_id:
            assert not out.committed and out.exposed_tokens == 0 and out.error
            continue
        assert out.committed, out.error
        assert not conn.markers.is_set(out.request_id)
        tables = [__import__("torch").tensor(b) for b in specs[i].block_ids]
        assert state_hash(REG, kv, tables, N) == hashes[i]
    assert conn.retriever.restorer.staging.live_bytes == 0
    assert conn.stats.loads == 3 and conn.stats.failed == 1 and conn.stats.committed == 2
    # the marker suppresses the next lookup of the failed request, as for any failed load
    assert conn.get_num_new_matched_tokens(ConnectorRequest(bad.request_id, srcs[bad_index].tokens + [1]), 0) == \
        (0, False)


def test_start_load_before_register_keeps_pending_loads():
    tier = MemoryTier(REG.chunk_bytes, REG.fingerprint)
    src = make_source(REG, N, seed=9)
    store_source(src, tier, window_chunks=2)
    dst = Destinations(REG, N, seed=10)
    with StandaloneConnector(REG, [tier], config=RestoreConfig(window_chunks=2)) as conn:
        req = ConnectorRequest("late", src.tokens + [1])
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, [t.tolist() for t in dst.tables], tokens)
        with pytest.raises(RuntimeError, match="register_kv_caches"):
            conn.start_load()
        conn.register_kv_caches(dst.kv)
        (out,) = conn.start_load()  # the load was not dropped by the refused call
        assert out.committed and state_hash(REG, dst.kv, dst.tables, N) == src_hash(src)


def src_hash(src):
    return state_hash(REG, src.kv, src.block_tables, N)
