"""(f) A hybrid model in a real vLLM engine: a tiny Llama whose first layer uses sliding-window
attention and second full attention, so vLLM's hybrid KV-cache manager makes two KV-cache groups
whose layers share one tensor per layer position (block ids disjoint across groups: one block pool).
The connector registers both groups, restores into every group (async loads: vLLM maps failed
block ids to requests only with one group, so failures go out as failed_recving), and a damaged
object collapses the whole prefix, every block of both groups invalid."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

W = 2
N = 12
WINDOW = 320  # tokens: not a multiple of the 256-token chunk


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("hybrid-llama"), seed=9, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def tokens():
    return U.prompt(N * U.CHUNK + 45, seed=31)


def test_hybrid_two_groups_restore_and_collapse(model, tokens, tmp_path):
    """One engine saves the prompt, forgets its own copy (U.forget_local_kv: no prefix-cache hit, every
    KV block poisoned) and restores both groups; then one object is damaged inside the sliding-window
    group's segment, and the next restore collapses as a whole and recomputes."""
    cold = U.cold_output(model, tokens)
    kv = U.kv_transfer([{"type": "filesystem", "root": str(tmp_path)}], window_chunks=W)
    llm = U.make_llm(model, kv)
    try:
        sched = U.scheduler_connector(llm).scheduler
        reg = sched.reg
        assert reg.num_groups == 2, reg.describe()
        assert sorted(s.sliding_window or 0 for s in reg.specs) == [0, 0, WINDOW, WINDOW]
        assert sched.load_async
        a = U.generate(llm, tokens)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        saves = worker.saves
        assert all(s["ok"] for s in saves), [s.get("error") for s in saves]
        assert sum(s["stored"] for s in saves) == N
        keys = U.prefix_keys(sched, tokens, N)
        assert a[0] == cold[0] and a[1] == cold[1]

        U.forget_local_kv(llm)
        assert len(worker.loads) == 0
        got = U.generate(llm, tokens)
        (load,) = worker.loads
        assert load["committed"] and load["num_chunks"] == N and got[2] == N * U.CHUNK
        full_blocks = N * U.CHUNK // U.BLOCK_SIZE
        assert load["total_blocks"] > full_blocks  # blocks of both groups were written
        assert got[0] == cold[0] and got[1] == cold[1]

        # damage one object inside the segment of the sliding-window group only: the whole prefix collapses
        from bsr_runtime.tiers.filesystem import FilesystemTier

        spec_i = next(i for i, s in enumerate(reg.specs) if s.sliding_window)
        with FilesystemTier(str(tmp_path), reg.chunk_bytes, reg.fingerprint) as tier:
            path = tier.path_of(keys[N - 1])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - reg.chunk_bytes + reg.segment_offsets[spec_i] + 100)
            f.write(b"\x01\x02\x03")
        U.forget_local_kv(llm)
        got = U.generate(llm, tokens)
        assert len(worker.loads) == 2
        load = worker.loads[1]
        rid = load["request_id"]
        events = [e for e, r in sched.events if r == rid]
    finally:
        U.shutdown(llm)
    assert not load["committed"] and load["exposed_tokens"] == 0
    assert load["invalid_blocks"] == load["total_blocks"] > full_blocks  # every block of both groups
    assert events[:4] == ["early_lookup", "probe", "load", "marker_set"]  # looked up from its arrival on
    assert "skip" in events and events.count("probe") == 1  # re-admitted: no second lookup
    assert got[0] == cold[0] and got[1] == cold[1]  # recomputed locally


def test_chunks_whose_window_heads_were_freed_are_saved_by_their_tails(tmp_path_factory, tmp_path):
    """Prefill steps of 384 tokens (not a multiple of the 256-token chunk) and a 64-token sliding
    window: by the step a chunk completes in, vLLM has freed the sliding-window blocks of its first
    tokens. The objects hold only what a prefix ending at each chunk needs of that group, its last 64
    tokens (tail_tokens), which are still resident: every chunk is saved (never that group's part as
    zeros), and a request sharing the saved prefix restores output equal to its cold prefill."""
    model = U.build_tiny_llama(tmp_path_factory.mktemp("hybrid-w64"), seed=19, sliding_window=64,
                               layer_types=["sliding_attention", "full_attention"])
    steps = {"max_num_batched_tokens": 384}
    p = U.prompt(N * U.CHUNK + 45, seed=41)
    kv = U.kv_transfer([{"type": "filesystem", "root": str(tmp_path)}], window_chunks=W)
    llm = U.make_llm(model, kv, **steps)
    try:
        reg = U.scheduler_connector(llm).scheduler.reg
        assert {s.tail_tokens for s in reg.specs if s.sliding_window} == {64}
        U.generate(llm, p)
        worker = U.worker_connector().worker
        assert worker.wait_saves(60)
        saved = sum(s["stored"] for s in worker.saves if s["ok"])
        assert saved == N, f"{saved} of {N} chunks saved"
        q = p[: saved * U.CHUNK] + U.prompt(100, seed=42)  # shares exactly the saved prefix
        cold = U.generate(llm, q, cache_salt="cold")  # another tenant: neither the local copy nor the tier's
        assert cold[2] == 0
        U.forget_local_kv(llm)  # the engine restores the saved prefix as a fresh one would
        got = U.generate(llm, q)
    finally:
        U.shutdown(llm)
    assert got[2] == saved * U.CHUNK  # the saved prefix was restored
    assert got[0] == cold[0]
    assert max(abs(a - b) for a, b in zip(got[1], cold[1], strict=True)) < 1e-3  # steps differ: last bits only
