"""In-process vLLM engines with and without the BSR connector, for the `bsr demo` engine part, the
engine benchmarks and the real-engine tests: a vLLM `LLM` on a local model, prompts of token ids,
greedy tokens with logprobs, the in-process connector objects, and one cold / save / restore run.
The runtime's vLLM integration (bsr_runtime.integrations.vllm) is what vLLM loads; this drives it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Sequence
from typing import Any

CONNECTOR_MODULE = "bsr_runtime.integrations.vllm"


def kv_transfer_config(tiers: list[dict], *, policy: str = "recompute", restore_partial_chunk: bool = False,
                       **extra: Any) -> dict:
    """The kv_transfer_config of an engine with the BSR connector (extra: kv_connector_extra_config keys).
    Restored prefixes end on chunk boundaries unless `restore_partial_chunk`: these drivers compare a restored
    request's output with a cold prefill's bit for bit, which holds where the restored prefix ends on
    one of the cold run's 256-token prefill steps (docs/vllm.md)."""
    return {"kv_connector": "BSRConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"tiers": tiers, "restore_partial_chunk": restore_partial_chunk, **extra}}


def make_llm(model: str, kv: dict | None = None, *, block_size: int = 64, max_num_batched_tokens: int = 256,
             max_model_len: int = 8192, multiprocess: bool = False, **kw: Any):
    """An offline engine on the CPU: eager, float32, 1 GiB of KV cache, no tokenizer."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM

    if not multiprocess:
        # An in-process engine's start collects the whole heap several times, and the shutdown of the
        # one before unfroze it (vLLM's EngineCore freezes the heap at start and unfreezes it at
        # shutdown): frozen first, those collections walk only the new engine's objects. vLLM's own
        # start freezes everything moments later anyway, so this holds nothing vLLM would not.
        gc.collect()
        gc.freeze()

    args = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=block_size,
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


def greedy(max_tokens: int, *, logprobs: int | None = 1):
    """vLLM's SamplingParams of a greedy request (ignoring EOS) with the chosen tokens' logprobs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)


def generate(llm, tokens: Sequence[int], *, max_tokens: int = 8, cache_salt: str | None = None,
             lora_request: Any = None):
    """(greedy tokens, their logprobs, num_cached_tokens) of one prompt of token ids (under a LoRA
    adapter with `lora_request`)."""
    from vllm import SamplingParams

    p: dict[str, Any] = {"prompt_token_ids": list(tokens)}
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    out = llm.generate([p], sp, use_tqdm=False, lora_request=lora_request)[0]
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], out.num_cached_tokens


def timed_first_token(llm, tokens: Sequence[int]) -> float:
    """Seconds until the first token of a one-token generation (the prompt's TTFT, offline), after
    a short warm-up request (no whole chunk: nothing restored or saved) outside the timing."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": list(tokens[:16])}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(tokens)}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - t0


def scheduler_side(llm):
    """The scheduler side of an in-process engine's connector."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def worker_side():
    """The worker side of the in-process engine's connector (this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def cold_save_restore(model: str, tokens: Sequence[int], tiers: list[dict], *, window_chunks: int,
                      max_num_batched_tokens: int = 256, max_tokens: int = 8, standalone: bool = False,
                      repeat: int = 1, log=print) -> dict:
    """One engine run of the paper's acceptance check, in this process:

    1. a cold engine without the connector: TTFT of the prompt, then its greedy output;
    2. engine A with the connector: prefills the prompt and saves its complete chunks;
    3. a fresh engine B with the connector: TTFT with the prefix restored (window by window), the
       restore's own time and peak staging, then the output again (restored once more).
    With `standalone`, BoundedRestorer restores the same objects outside vLLM into a cache of the
    same layout, for the engine-overhead ratio. Timings are the best of `repeat` runs (the local
    prefix cache reset before each)."""
    n_tok = len(tokens) + max_tokens + 16
    common = dict(max_num_batched_tokens=max_num_batched_tokens, max_model_len=max(8192, n_tok))
    kv = kv_transfer_config(tiers, window_chunks=window_chunks)
    out: dict[str, Any] = {"prompt_tokens": len(tokens), "window_chunks": window_chunks,
                           "max_num_batched_tokens": max_num_batched_tokens}
    llm = make_llm(model, **common)
    try:
        out["cold_ttft_s"] = _best(repeat, lambda: timed_first_token(llm, tokens), llm)
        llm.reset_prefix_cache()
        cold = generate(llm, tokens, max_tokens=max_tokens)
    finally:
        shutdown(llm)
    log(f"cold prefill of {len(tokens)} tokens: TTFT {out['cold_ttft_s']:.3f} s")
    llm = make_llm(model, kv, **common)
    try:
        generate(llm, tokens, max_tokens=1)
        worker = worker_side()
        worker.wait_saves()
        saves = [r for r in worker.saves if r.get("ok")]  # one record per step that completed chunks
    finally:
        shutdown(llm)
    out.update(save_chunks=sum(r["stored"] for r in saves), save_s=sum(r["seconds"] for r in saves),
               save_peak_staging_bytes=max((r.get("staging_bytes", 0) for r in saves), default=0))
    log(f"engine A saved {out['save_chunks']} chunks in {out['save_s']:.3f} s")
    llm = make_llm(model, kv, **common)
    try:
        worker = worker_side()
        out["restored_ttft_s"] = _best(repeat, lambda: timed_first_token(llm, tokens), llm)
        load = dict(worker.loads[-1])
        load["seconds"] = min(r["seconds"] for r in worker.loads if r["committed"])
        llm.reset_prefix_cache()
        restored = generate(llm, tokens, max_tokens=max_tokens)
        if standalone:
            out["standalone_restore_s"] = _standalone_restore(worker, tokens, load["num_chunks"])
    finally:
        shutdown(llm)
    out.update(restored_chunks=load["num_chunks"], restore_s=load["seconds"], windows=load["windows"],
               peak_staging_bytes=load["peak_staging_bytes"], chunk_bytes=load["chunk_bytes"],
               committed=load["committed"], num_cached_tokens=restored[2],
               tokens_identical=restored[0] == cold[0], logprobs_identical=restored[1] == cold[1],
               max_logprob_diff=max((abs(a - b) for a, b in zip(restored[1], cold[1])), default=0.0))
    log(f"engine B restored {load['num_chunks']} chunks (W={window_chunks}, {load['windows']} windows) in "
        f"{load['seconds']:.3f} s; TTFT {out['restored_ttft_s']:.3f} s; peak staging "
        f"{load['peak_staging_bytes']:,} B = W*c; output identical: {out['tokens_identical']} "
        f"(logprobs bit-identical: {out['logprobs_identical']})")
    return out


def _best(repeat: int, fn, llm) -> float:
    best = float("inf")
    for _ in range(max(1, repeat)):
        llm.reset_prefix_cache()
        best = min(best, fn())
    return best


def _standalone_restore(worker, tokens: Sequence[int], num_chunks: int, repeat: int = 3, busy=None) -> float:
    """Best of `repeat` BoundedRestorer restores of the engine's objects into a fresh cache of the
    engine's layout (same registration, tier, keys, W and pipeline depth), outside vLLM. With `busy`,
    busy(stop) runs on a thread throughout each restore (from before it starts until after it returns)."""
    import threading

    import torch

    from bsr_runtime.integrations.vllm.registration import cpu_kv_views
    from bsr_runtime.restore import BoundedRestorer, RestoreRequest

    reg = worker.reg
    tier = worker.tiers[0]
    nb = num_chunks * reg.chunk_tokens // reg.specs[0].block_size + 1
    kv = []
    for i in range(0, reg.num_tensors, 2):
        s = reg.specs[i]
        h, d = s.entry_shape
        cache = torch.zeros(nb, h, s.block_size, 2 * d, dtype=s.dtype)
        kv.extend(cpu_kv_views(cache, s.block_size))
    tables = [torch.arange(1, nb, dtype=torch.int64) for _ in range(reg.num_groups)]
    req = RestoreRequest("standalone", list(tokens), worker.keyspace, kv, tables)
    best = float("inf")
    with BoundedRestorer(reg, worker.restore_config) as r:
        for _ in range(repeat):
            stop, thread = threading.Event(), None
            if busy is not None:
                thread = threading.Thread(target=busy, args=(stop,), name="bsr-standalone-busy", daemon=True)
                thread.start()
                time.sleep(0.2)  # the busy work is under way before the restore starts
            try:
                rep = r.restore(req, tier, num_chunks)
            finally:
                stop.set()
                if thread is not None:
                    thread.join()
            assert rep.ok, rep.error
            best = min(best, rep.total_s)
    return best
