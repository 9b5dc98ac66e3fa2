"""The connector in a multiprocess vLLM engine (engine core in its own process), configured with
the README's `--kv-transfer-config` JSON exactly as written; and what kv_load_failure_policy="fail"
does with a failed load."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_kv_transfer_config() -> dict:
    m = re.search(r"vllm serve .*--kv-transfer-config '(\{.*\})'", README.read_text())
    assert m, "README has no `vllm serve ... --kv-transfer-config '<json>'` line"
    return json.loads(m.group(1))


@pytest.mark.slow
def test_readme_config_multiprocess_save_then_restore(tmp_path):
    kv = readme_kv_transfer_config()
    assert kv["kv_connector"] == "BSRConnector" and kv["kv_load_failure_policy"] == "recompute"
    root = Path(kv["kv_connector_extra_config"]["tiers"][0]["root"])
    # weights of this run's own (the model identity is a digest of the weights): the README's root is a
    # fixed path that earlier runs' objects share, and this run must not hit them
    model = U.build_tiny_llama(tmp_path / "model", seed=random.SystemRandom().randrange(1 << 30))
    tokens = U.prompt(12 * U.CHUNK + 5, seed=11)
    llm = U.make_llm(model, kv, multiprocess=True)
    try:
        cold = U.generate(llm, tokens)  # cold prefill, saved after the prompt
        assert cold[2] == 0
        llm.reset_prefix_cache()  # forget the local copy: the next request must come from the tier
        warm = U.generate(llm, tokens)
    finally:
        U.shutdown(llm)
    assert warm[2] == 12 * U.CHUNK  # restored by the engine core's connector in its own process
    assert warm[0] == cold[0] and warm[1] == cold[1]
    assert any(root.rglob("*.bsr"))


def test_fail_policy_ends_the_request(tmp_path):
    """vLLM 0.32's default kv_load_failure_policy="fail": a failed load ends the request with an
    error (finish_reason "error"), no recompute. Hence the README's "recompute"."""
    model = U.build_tiny_llama(tmp_path / "model", seed=4)
    tokens = U.prompt(4 * U.CHUNK + 9, seed=12)
    root = tmp_path / "fs"
    llm = U.make_llm(model, U.kv_transfer([{"type": "fs", "root": str(root)}], policy="fail", window_chunks=2))
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
