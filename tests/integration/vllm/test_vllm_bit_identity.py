"""When a restored request's output is bit-identical to a cold prefill's (README "Output identical to a
cold prefill"), both sides in real engines with the same max_num_batched_tokens M = 512:

- aligned: the restored prefix (12 chunks, 3072 tokens) ends where a cold prefill step ends (a
  multiple of M): tokens and logprobs identical;
- unaligned: the restored prefix (11 chunks, 2816 tokens) ends inside a cold step: tokens identical,
  logprobs within the difference vLLM's own prefix cache makes (a repeat of the prompt in the cold
  engine, measured here; its hit ends at the same token). That difference is not zero on most CPUs; where
  vLLM's kernels give the same bits whatever the split (seen on an Intel Xeon with AVX-512 and AMX), the
  restored logprobs must then be identical too.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

M = 512
PROMPTS = {"aligned": (12 * U.CHUNK + 40, 71), "unaligned": (11 * U.CHUNK + 40, 72)}  # tokens, seed


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a[1], b[1]))


def test_bit_identity_needs_the_prefix_to_end_on_a_prefill_step(tmp_path):
    model = U.build_tiny_llama(tmp_path / "model", seed=5)
    prompts = {k: U.prompt(n, seed) for k, (n, seed) in PROMPTS.items()}
    kv = U.kv_transfer([{"type": "filesystem", "root": str(tmp_path / "fs")}], window_chunks=4)
    cold, local = {}, {}
    llm = U.make_llm(model, kv, max_num_batched_tokens=M)
    try:
        worker = U.worker_connector().worker
        for k, tokens in prompts.items():  # a cold prefill (saved), then a local hit
            cold[k] = U.generate(llm, tokens)
            local[k] = U.generate(llm, tokens)  # vLLM's own prefix cache, no load
        assert len(worker.loads) == 0
        assert worker.wait_saves(60)
        U.forget_local_kv(llm)  # the engine restores both prefixes as a fresh one would
        restored = {k: U.generate(llm, tokens) for k, tokens in prompts.items()}
        assert len(worker.loads) == len(prompts) and all(r["committed"] for r in worker.loads)
    finally:
        U.shutdown(llm)
    for k, (n, _) in PROMPTS.items():
        prefix = n // U.CHUNK * U.CHUNK
        assert cold[k][2] == 0 and local[k][2] == prefix and restored[k][2] == prefix
        assert restored[k][0] == cold[k][0], f"{k}: greedy tokens differ"

    assert (12 * U.CHUNK) % M == 0
    assert restored["aligned"][1] == cold["aligned"][1]  # bit for bit
    assert local["aligned"][1] == cold["aligned"][1]

    assert (11 * U.CHUNK) % M != 0
    vllm_diff = _max_diff(local["unaligned"], cold["unaligned"])  # 0 where the split does not change vLLM's bits
    assert _max_diff(restored["unaligned"], cold["unaligned"]) <= vllm_diff
