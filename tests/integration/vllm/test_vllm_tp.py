"""(g) Tensor parallelism 2 in a real vLLM CPU engine (two worker processes, one core each): each
rank saves and restores its own objects (its KV heads), the ranks agree on q[r][g] over the TP
group's gloo group, and a damaged object of one rank fails the restore on both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402


@pytest.mark.slow
def test_tp2_ranks_agree(tmp_path, monkeypatch):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on the CPU needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM cannot bind 2 workers to 1 NUMA node itself
    model = U.build_tiny_llama(tmp_path / "model", seed=6)
    tokens = U.prompt(12 * U.CHUNK + 40, seed=41)
    report = tmp_path / "report.jsonl"
    root = tmp_path / "fs"
    kv = U.kv_transfer([{"type": "filesystem", "root": str(root)}], window_chunks=2, report_path=str(report))
    llm = U.make_llm(model, kv, multiprocess=True, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        cold = U.generate(llm, tokens)
        llm.reset_prefix_cache()
        warm = U.generate(llm, tokens)
        loads = [r for r in U.read_report(report) if r["event"] == "load"]
        assert sorted(r["rank"] for r in loads) == [0, 1]
        assert all(r["committed"] and r["agreed"] and r["num_chunks"] == 12 for r in loads)
        assert loads[0]["chunk_bytes"] == loads[1]["chunk_bytes"]  # each rank: its own KV heads
        assert warm[2] == 12 * U.CHUNK and warm[0] == cold[0] and warm[1] == cold[1]
        # damage one object of rank 1 only
        from bsr_runtime.keys import KeySpace, PrefixKeys
        from bsr_runtime.tiers.filesystem import object_relpath

        r1 = next(r for r in loads if r["rank"] == 1)
        space = KeySpace(r1["fingerprint"], 1, 2, "", r1["model"])
        path = root / object_relpath(PrefixKeys(space, tokens, U.CHUNK).window(5, 1)[0])
        with open(path, "r+b") as f:
            f.seek(-50, 2)
            f.write(b"\x00\xff\x00")
        llm.reset_prefix_cache()
        again = U.generate(llm, tokens)
        failed = [r for r in U.read_report(report) if r["event"] == "load"][2:]
    finally:
        U.shutdown(llm)
    assert sorted(r["rank"] for r in failed) == [0, 1]
    by_rank = {r["rank"]: r for r in failed}
    assert by_rank[1]["valid_per_group"] == [False] and by_rank[0]["valid_per_group"] == [True]
    assert not by_rank[0]["committed"] and not by_rank[1]["committed"]  # the commit rule: both fail
    assert all(r["invalid_blocks"] == r["total_blocks"] for r in failed)
    assert again[0] == cold[0] and again[1] == cold[1]  # recomputed
    assert Path(path).exists()
