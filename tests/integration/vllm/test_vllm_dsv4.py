"""The tiny DeepSeek-V4 (every layer kind of DeepSeek-V4-Flash: sliding-window-only, C4 with the
lightning indexer, C128; bsr_harness.dsv4_model) in a real vLLM CPU engine with the connector configured
as the README says (filesystem tier): 10 KV-cache tensors in 7 groups, one allocation laid out block by
block. A cold prefill saves; vLLM's prefix cache is reset and every KV byte poisoned; the restore (W=1,
two windows) gives tokens and logprobs bit-identical to the cold prefill, installing exactly the blocks
vLLM allocated (a sliding-window group's: only its window) with staging W*c. Then a flipped byte, a
deleted and a truncated object (each between the probe and the fetch) fail closed: every block of every
group invalid, the prefix recomputed with the same output.

The engine runs in a process of its own (bsr_harness.dsv4_engine: vLLM CPU needs Triton's interpreter
and a patch for a vLLM 0.32 bug before and after vLLM's import). On a machine whose vLLM CPU kernels
lack the AVX-512 ops of the DeepSeek-V4 path the test skips, naming them; the no-forward-pass tests
(tests/unit/test_dsv4_registration.py) run there."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from bsr_harness import dsv4_engine  # noqa: E402
from bsr_harness.dsv4_model import build_tiny_dsv4  # noqa: E402

W = 1
CHUNKS = 2
# blocks a restore of 2 chunks writes, per group as vLLM allocates them: 4 sliding-window KV groups of
# 64-token blocks (their last 128 tokens: 2 blocks each), the compressed-KV group (one 256-token block per
# chunk), the C4 compressor states (4-token blocks, window 8: 2), the C128 states (8-token blocks, window 128: 16)
BLOCKS = 4 * 2 + CHUNKS + 2 + 16


def test_tiny_dsv4_restores_bit_identical_and_fails_closed(tmp_path):
    model = build_tiny_dsv4(tmp_path / "model")
    rec = dsv4_engine.run_scenario("restore", {"model": model, "root": str(tmp_path / "fs"),
                                               "prompt_tokens": CHUNKS * 256 + 1, "window_chunks": W,
                                               "max_tokens": 2})
    if rec.get("skipped"):
        pytest.skip(rec["skipped"])
    reg = rec["registration"]
    assert (reg["num_tensors"], reg["num_groups"]) == (10, 7)
    assert rec["swa_indices_torch_matches_triton"]  # the test support's stand-in for an interpreted vLLM kernel
    assert reg["scheduler_fingerprint"] == reg["fingerprint"] and reg["scheduler_chunk_bytes"] == reg["chunk_bytes"]
    c = reg["chunk_bytes"]
    assert c == 952_208 and reg["every_entry_bytes"] == 4_315_024  # window tails, not every entry
    assert rec["saves"] and all(s["ok"] for s in rec["saves"]) and sum(s["stored"] for s in rec["saves"]) == CHUNKS
    (size,) = rec["object_sizes"]
    assert rec["objects"] == CHUNKS and c < size < c + 4096  # c plus the object header

    load, out = rec["load"], rec["restored"]
    assert load["committed"] and load["num_chunks"] == CHUNKS and out["cached_tokens"] == CHUNKS * 256
    assert load["windows"] == CHUNKS // W and load["peak_staging_bytes"] == W * c
    assert load["total_blocks"] == BLOCKS and load["invalid_blocks"] == 0
    assert out["tokens_identical"] and out["logprobs_identical"], out

    assert set(rec["damage"]) == {"flip", "delete", "truncate"}
    for kind, d in rec["damage"].items():
        dl = d["load"]
        assert d["fetched_damaged"], kind
        assert not dl["committed"] and dl["exposed_tokens"] == 0, (kind, dl)
        assert dl["invalid_blocks"] == dl["total_blocks"] == BLOCKS, (kind, dl)  # every group collapses
        assert dl["valid_per_group"] == [False] * reg["num_groups"], (kind, dl)
        assert d["tokens_identical"] and d["logprobs_identical"], kind  # recomputed
