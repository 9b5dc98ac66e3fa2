"""Real-engine test helpers: a random-weight tiny Llama built locally, engines with and without
the BSR connector, greedy generation with logprobs.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by `engine`) unless asked otherwise;
prompts are token ids (skip_tokenizer_init=True), so no tokenizer is needed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

CHUNK = 256
BLOCK_SIZE = 64
VOCAB = 2048


def build_tiny_llama(path: str | Path, seed: int = 0, *, hidden: int = 128, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 32, vocab: int = VOCAB, max_pos: int = 32768,
                     sliding_window: int | None = None, layer_types: list[str] | None = None) -> str:
    """A random-weight Llama (float32, safetensors) in `path`; returns the path. Same seed, same weights.
    With `sliding_window` and `layer_types` a Mistral-style hybrid (sliding + full attention) is built."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=vocab, max_position_embeddings=max_pos, torch_dtype="float32",
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits that actually depend on the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    if sliding_window is not None:
        c = json.loads((path / "config.json").read_text())
        c["sliding_window"] = sliding_window
        if layer_types:
            c["layer_types"] = layer_types
        (path / "config.json").write_text(json.dumps(c))
    return str(path)


def kv_transfer(tiers: list[dict], *, policy: str = "recompute", **extra) -> dict:
    """The kv_transfer_config of an engine with the BSR connector."""
    return {"kv_connector": "BSRConnector", "kv_connector_module_path": "bsr_runtime.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"tiers": tiers, **extra}}


def _tolerate_llvmlite_in_kernel_scan() -> None:
    """vLLM 0.32 rescans every module attribute when a worker starts (triton_utils.dispatcher:
    `vars(value).get("kernel")`); `llvmlite.binding.ffi.lib`, imported by LMCache (through numba),
    answers `__dict__` with a function wrapper, so once LMCache was imported the next engine started
    in the same process fails. Tests start many engines per process: give the scan a `vars` that
    reads such objects as empty. (A deployment starts one engine per process and is not affected.)"""
    import builtins

    from vllm.triton_utils import dispatcher

    def safe_vars(obj):
        d = builtins.vars(obj)
        return d if isinstance(d, dict) else {}

    dispatcher.vars = safe_vars


def make_llm(model: str, kv: dict | None = None, *, max_num_batched_tokens: int = 256, max_model_len: int = 8192,
             multiprocess: bool = False, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM

    _tolerate_llvmlite_in_kernel_scan()

    args = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK_SIZE,
                kv_cache_memory_bytes=1 << 30, max_model_len=max_model_len, max_num_seqs=4,
                max_num_batched_tokens=max_num_batched_tokens, dtype="float32", seed=0)
    if kv is not None:
        args["kv_transfer_config"] = kv
    args.update(kw)
    return LLM(**args)


def shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def prompt(n_tokens: int, seed: int = 1) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n_tokens)]


def generate(llm, tokens: list[int], *, max_tokens: int = 8, cache_salt: str | None = None):
    """Greedy tokens and logprobs of one prompt, plus num_cached_tokens."""
    from vllm import SamplingParams

    p = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    out = llm.generate([p], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
    return list(c.token_ids), lps, out.num_cached_tokens


def scheduler_connector(llm):
    """The scheduler-side connector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector():
    """The worker-side connector of an in-process engine (this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def read_report(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
