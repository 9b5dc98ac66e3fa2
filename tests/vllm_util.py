"""Real-engine test helpers: a random-weight tiny Llama built locally, engines with and without
the BSR connector, greedy generation with logprobs.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by `engine`) unless asked otherwise;
prompts are token ids (skip_tokenizer_init=True), so no tokenizer is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from bsr_harness import vllm_engines
from bsr_harness.tiny_model import VOCAB, build_tiny_llama  # noqa: F401 - re-exported

CHUNK = 256
BLOCK_SIZE = 64


def kv_transfer(tiers: list[dict], *, policy: str = "recompute", **extra) -> dict:
    return vllm_engines.kv_transfer_config(tiers, policy=policy, **extra)


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
    return vllm_engines.make_llm(model, kv, block_size=BLOCK_SIZE, **kw)


shutdown = vllm_engines.shutdown
generate = vllm_engines.generate


def cold_output(model: str, tokens, **kw):
    """(tokens, logprobs, cached tokens) of a cold prefill in an engine without the connector."""
    llm = make_llm(model, **kw)
    try:
        return generate(llm, tokens)
    finally:
        shutdown(llm)


def forget_local_kv(llm) -> None:
    """Make an engine that saved a prompt restore it as a fresh engine would: vLLM's prefix cache reset
    (no local hit) and every KV block poisoned, so a block the restore did not write holds garbage
    instead of the saving request's state (vLLM reuses freed blocks without clearing them). What the
    next request of that prompt gets, it can only get from the tiers."""
    from bsr_harness.testdata import poison

    assert llm.reset_prefix_cache(), "vLLM kept its prefix cache (a request still running?)"
    poison(worker_connector().worker.kv)


def lmcache_l1_holds_no_object() -> bool:
    """No LMCache tier of the worker holds a whole object in its L1 (a save flushes its objects from L1
    once an L2 adapter holds them, a fetch evicts what it loaded): a restore must read the L2 store."""
    return all(t.l1_usage()[0] < t.l1_object_bytes for t in worker_connector().worker.tiers
               if hasattr(t, "l1_usage"))


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

    space = sched.keyspace if salt is None else dataclasses.replace(sched.keyspace, salt=salt)
    return PrefixKeys(space, tokens, CHUNK).window(0, n)


def read_report(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class Engines:
    """One in-process engine at a time (vLLM keeps one KV connector per process): consecutive tests
    asking for the same model and settings share it; asking for other ones shuts it down first."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.llm = None

    def get(self, model: str, kv: dict | None = None, **kw):
        key = repr((model, json.dumps(kv, sort_keys=True), sorted(kw.items())))
        if key != self.key:
            self.close()
            self.llm = make_llm(model, kv, **kw)
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            shutdown(self.llm)
        self.llm, self.key = None, None


def core_scheduler(llm):
    """vLLM's scheduler of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def add_request(llm, rid: str, tokens, *, max_tokens: int = 8, cache_salt: str | None = None,
                lora_request=None) -> None:
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": list(tokens)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    llm.llm_engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1,
                                                           ignore_eos=True), lora_request=lora_request)


def internal_id(llm, rid: str) -> str:
    """vLLM's id of the request added as `rid` (it appends a suffix)."""
    (internal,) = [r for r in core_scheduler(llm).requests if r.startswith(rid + "-") or r == rid]
    return internal


def step_until(llm, done, timeout_s: float = 120.0) -> dict:
    """Step the engine until done() holds; returns the finished outputs by request id
    ((tokens, logprobs, num_cached_tokens))."""
    import time

    finished = {}
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "the engine did not get there in time"
        for o in llm.llm_engine.step():
            if o.finished:
                c = o.outputs[0]
                finished[o.request_id] = (list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
                                          o.num_cached_tokens)
    return finished


def run_all(llm, timeout_s: float = 120.0) -> dict:
    return step_until(llm, lambda: not llm.llm_engine.has_unfinished_requests(), timeout_s)


def flip_byte(path: str, from_end: int = 500, mask: int = 0x10) -> None:
    """Damage an object file in place: one payload byte, `from_end` bytes before its end, flipped."""
    import os

    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - from_end)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))
