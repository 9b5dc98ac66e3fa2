"""Real-engine test helpers: a random-weight tiny Llama built locally, engines with and without
the BSR connector, greedy generation with logprobs.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by `engine`) unless asked otherwise;
prompts are token ids (skip_tokenizer_init=True), so no tokenizer is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from bsr_harness.tiny_model import VOCAB, build_tiny_llama  # noqa: F401 - re-exported
from bsr_runtime.integrations.vllm import offline

CHUNK = 256
BLOCK_SIZE = 64


def kv_transfer(tiers: list[dict], *, policy: str = "recompute", **extra) -> dict:
    return offline.kv_transfer_config(tiers, policy=policy, **extra)


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


def make_llm(model: str, kv: dict | None = None, **kw):
    from vllm import LLM  # noqa: F401 - vllm.triton_utils must be importable

    _tolerate_llvmlite_in_kernel_scan()
    return offline.make_llm(model, kv, block_size=BLOCK_SIZE, **kw)


shutdown = offline.shutdown
generate = offline.generate


def prompt(n_tokens: int, seed: int = 1) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n_tokens)]


def scheduler_connector(llm):
    """The scheduler-side connector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector():
    """The worker-side connector of an in-process engine (this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def prefix_keys(sched, tokens, n: int, salt: str | None = None) -> list[str]:
    """The keys of chunks 0..n-1 of `tokens` in the engine's key space (scheduler side)."""
    import dataclasses

    from bsr_runtime.keys import PrefixKeys

    space = sched.core.keyspace if salt is None else dataclasses.replace(sched.core.keyspace, salt=salt)
    return PrefixKeys(space, tokens, CHUNK).window(0, n)


def read_report(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
