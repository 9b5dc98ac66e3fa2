"""What kv_load_failure_policy="fail" does with a failed load, in a vLLM engine. (The README's JSON
in a multiprocess engine, its engine core in its own process, is test_vllm_serve.py's server.)"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402


def test_fail_policy_ends_the_request(tmp_path):
    """vLLM 0.32's default kv_load_failure_policy="fail": a failed load ends the request with an
    error (finish_reason "error"), no recompute. Hence the README's "recompute"."""
    model = U.build_tiny_llama(tmp_path / "model", seed=4)
    tokens = U.prompt(4 * U.CHUNK + 9, seed=12)
    root = tmp_path / "fs"
    llm = U.make_llm(model, U.kv_transfer([{"type": "filesystem", "root": str(root)}], policy="fail", window_chunks=2))
    try:
        U.generate(llm, tokens)  # saves 4 chunks
        tier = U.scheduler_connector(llm).scheduler.tiers[0]
        for path in root.rglob("*.bsr"):  # damage every object
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 7)
                f.write(b"\xff\x00\xff")
        llm.reset_prefix_cache()
        from vllm import SamplingParams

        out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)[0]
        assert tier is not None
    finally:
        U.shutdown(llm)
    assert out.outputs[0].finish_reason == "error", out.outputs[0]
    assert len(out.outputs[0].token_ids) <= 1
