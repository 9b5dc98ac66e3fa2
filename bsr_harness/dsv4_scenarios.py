"""DeepSeek-V4 engine scenarios, each run in a process of its own (`python -m bsr_harness.dsv4_scenarios
NAME ARGS_JSON`, started by bsr_harness.dsv4_engine.run_scenario; dsv4_engine's setup() and patch_vllm()
run first): one engine with the BSR connector configured as the README says (filesystem tier), one JSON
record back, or {"skipped": one line} where vLLM CPU's kernels lack the DeepSeek-V4 ops.

`restore`: the paper's acceptance check on the tiny model, in one engine: a cold prefill (nothing
stored yet) that saves, vLLM's prefix cache reset and every KV byte poisoned, a restore whose output
must equal the cold one bit for bit; then damaged objects (a flipped byte, a deleted and a truncated
object, each between the probe and the fetch) that must fail closed: every block of every group
reported invalid, the request recomputed with the same output.
`bench`: the engine benchmark of one model (the 43-layer Flash pattern): per prompt length, cold
TTFT, restored TTFT, the restore's time, windows and peak staging, bytes per chunk.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from . import dsv4_engine, vllm_engines
from .testdata import POISON

CHUNK = 256


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def poison_all(kv) -> None:
    """Every byte of every KV-cache allocation behind `kv` (padding included) set to POISON."""
    import torch

    seen = set()
    for t in kv:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            torch.empty(0, dtype=torch.uint8).set_(st).fill_(POISON)


def _settle(llm, steps: int = 10) -> None:
    for _ in range(steps):
        llm.llm_engine.step()
        time.sleep(0.02)


def registration_record(sched_reg, worker_reg) -> dict:
    """What the engine registered: tensors, groups, bytes per chunk (stored and 'every entry')."""
    full = sum(worker_reg.chunk_tokens // s.token_ratio * s.entry_bytes for s in worker_reg.specs)
    kinds: dict[str, int] = {}
    for s in worker_reg.specs:
        kind = s.name.split(".attn", 1)[1] or "(compressed kv)"
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"num_tensors": worker_reg.num_tensors, "num_groups": worker_reg.num_groups,
            "chunk_bytes": worker_reg.chunk_bytes, "every_entry_bytes": full,
            "fingerprint": worker_reg.fingerprint, "scheduler_fingerprint": sched_reg.fingerprint,
            "scheduler_chunk_bytes": sched_reg.chunk_bytes,
            "group_tokens_per_block": [worker_reg.group_tokens_per_block(g) for g in range(worker_reg.num_groups)],
            "group_tail_tokens": [worker_reg.group_tail_tokens(g) for g in range(worker_reg.num_groups)],
            "tensor_kinds": kinds}


class _Damage:
    """Damages one object right before the worker's tier fetches it (after the scheduler's probe found it
    whole): what a store that loses or corrupts an object mid-restore does."""

    def __init__(self, tier, path: str, kind: str, offset: int) -> None:
        self.tier, self.path, self.kind, self.offset = tier, path, kind, offset
        self.fetch = tier.fetch
        self.done = False
        tier.fetch = self

    def __call__(self, keys, views, deadline, **kw):
        if not self.done:
            self.done = True
            if self.kind == "delete":
                os.unlink(self.path)
            elif self.kind == "truncate":
                os.truncate(self.path, os.path.getsize(self.path) - 1000)
            else:
                with open(self.path, "r+b") as f:
                    f.seek(self.offset)
                    b = f.read(1)
                    f.seek(self.offset)
                    f.write(bytes([b[0] ^ 0xFF]))
        return self.fetch(keys, views, deadline, **kw)

    def remove(self) -> None:
        self.tier.fetch = self.fetch


def _load_record(rec: dict) -> dict:
    keys = ("committed", "num_chunks", "exposed_tokens", "windows", "invalid_blocks", "total_blocks",
            "peak_staging_bytes", "chunk_bytes", "window_chunks", "valid_per_group", "error", "seconds")
    return {k: rec.get(k) for k in keys}


def restore(model: str, root: str, prompt_tokens: int = 1069, window_chunks: int = 2, max_tokens: int = 4,
            damages: tuple[str, ...] = ("flip", "delete", "truncate"), max_model_len: int = 2048) -> dict:
    kv = vllm_engines.kv_transfer_config([{"type": "filesystem", "root": root}], window_chunks=window_chunks)
    t0 = time.perf_counter()
    llm = dsv4_engine.make_llm(model, kv, max_model_len=max_model_len, kv_cache_memory_bytes=256 << 20)
    out: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 2), "prompt_tokens": prompt_tokens,
                           "window_chunks": window_chunks}
    try:
        sched = vllm_engines.scheduler_side(llm)
        worker = vllm_engines.worker_side()
        out["registration"] = registration_record(sched.reg, worker.reg)
        out["registration"]["specs"] = [s.to_dict() for s in worker.reg.specs]
        tokens = _prompt(prompt_tokens)
        cold = _saved_cold(llm, worker, root, tokens, max_tokens, out)
        _forget(llm, worker)
        t0 = time.perf_counter()
        restored = vllm_engines.generate(llm, tokens, max_tokens=max_tokens)
        out["restored_s"] = round(time.perf_counter() - t0, 2)
        out["load"] = _load_record(worker.loads[-1])
        out["restored"] = {"tokens_identical": restored[0] == cold[0], "logprobs_identical": restored[1] == cold[1],
                           "cached_tokens": restored[2], "tokens": restored[0], "cold_tokens": cold[0],
                           "max_logprob_diff": max((abs(a - b) for a, b in zip(restored[1], cold[1])), default=0.0)}
        paths = _object_paths(sched, worker.reg, root, tokens, out["load"]["num_chunks"] or 0)
        out["damage"] = {kind: _damaged_restore(llm, worker, tokens, cold, paths[(len(paths) - 1 - i) % len(paths)],
                                                kind, max_tokens)
                         for i, kind in enumerate(damages)}
    finally:
        vllm_engines.shutdown(llm)
    return out


def _saved_cold(llm, worker, root: str, tokens: list[int], max_tokens: int, out: dict) -> tuple:
    """The cold prefill (the reference output), its chunks saved; the objects it left under `root`."""
    t0 = time.perf_counter()
    cold = vllm_engines.generate(llm, tokens, max_tokens=max_tokens)
    out["cold_s"] = round(time.perf_counter() - t0, 2)
    out["saved"] = worker.wait_saves(120)
    _settle(llm)
    out["saves"] = [{k: s.get(k) for k in ("ok", "stored", "error", "skipped")} for s in worker.saves]
    files = sorted(str(p) for p in Path(root).rglob("*") if p.is_file())
    out["object_sizes"] = sorted({os.path.getsize(f) for f in files})
    out["objects"] = len(files)
    return cold


def _forget(llm, worker) -> None:
    """vLLM's prefix cache reset and every KV block poisoned: what comes next comes from the tier."""
    assert llm.reset_prefix_cache(), "vLLM kept its prefix cache"
    poison_all(worker.kv)


def _object_paths(sched, reg, root: str, tokens: list[int], num_chunks: int) -> list[str]:
    """The files of the prompt's first `num_chunks` objects (at least one) on the filesystem tier."""
    from bsr_runtime.keys import PrefixKeys
    from bsr_runtime.tiers.filesystem import FilesystemTier

    keys = PrefixKeys(sched.keyspace, tokens, reg.chunk_tokens).window(0, max(num_chunks, 1))
    with FilesystemTier(root, reg.chunk_bytes, reg.fingerprint) as tier:
        return [tier.path_of(k) for k in keys]


def _damaged_restore(llm, worker, tokens: list[int], cold: tuple, victim: str, kind: str, max_tokens: int) -> dict:
    """The prompt again with `victim` damaged (`kind`) as the restore reads it, inside a sliding-window
    tail: the load record, whether the damaged bytes were fetched, and the output against cold."""
    reg = worker.reg
    worker.wait_saves(120)  # the recompute after the last damage saved every chunk again
    _settle(llm)
    seg = next(i for i, s in enumerate(reg.specs) if s.tail_tokens)
    size = os.path.getsize(victim)
    hook = _Damage(worker.tiers[0], victim, kind, size - reg.chunk_bytes + reg.segment_offsets[seg] + 77)
    _forget(llm, worker)
    t0 = time.perf_counter()
    try:
        got = vllm_engines.generate(llm, tokens, max_tokens=max_tokens)
    finally:
        hook.remove()
    return {"load": _load_record(worker.loads[-1]), "fetched_damaged": hook.done,
            "seconds": round(time.perf_counter() - t0, 2),
            "tokens_identical": got[0] == cold[0], "logprobs_identical": got[1] == cold[1]}


def bench(model: str, root: str, prompt_lengths: list[int], window_chunks: int = 32, batched_tokens: int = 2048,
          max_model_len: int = 65536 + 512, kv_cache_bytes: int = 8 << 30) -> dict:
    """Per prompt length (whole chunks): cold TTFT (nothing stored: a full prefill, which saves its chunks),
    then restored TTFT (vLLM's local copy dropped, the prefix restored window by window from the filesystem
    tier, one token computed), the restore's own time, windows and peak staging; bytes per chunk. Chunked
    prefill of `batched_tokens` per step (dsv4_engine.force_chunked_prefill)."""
    dsv4_engine.force_chunked_prefill()
    kv = vllm_engines.kv_transfer_config([{"type": "filesystem", "root": root}], window_chunks=window_chunks)
    t0 = time.perf_counter()
    llm = dsv4_engine.make_llm(model, kv, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
                               max_num_batched_tokens=batched_tokens, enable_chunked_prefill=True)
    out: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 2), "window_chunks": window_chunks,
                           "batched_tokens": batched_tokens, "cpu_isa": dsv4_engine.cpu_isa(), "runs": []}
    try:
        sched = vllm_engines.scheduler_side(llm)
        worker = vllm_engines.worker_side()
        out["registration"] = registration_record(sched.reg, worker.reg)
        vllm_engines.generate(llm, _prompt(16, seed=0), max_tokens=1)  # warm-up: no whole chunk
        for n_tok in prompt_lengths:
            tokens = _prompt(n_tok + 1, seed=n_tok)  # one token past the last whole chunk
            run: dict[str, Any] = {"prompt_tokens": n_tok}
            run["cold_ttft_s"] = round(_ttft(llm, tokens), 3)
            run["saved"] = worker.wait_saves(900)
            _settle(llm, 5)
            assert llm.reset_prefix_cache()
            run["restored_ttft_s"] = round(_ttft(llm, tokens), 3)
            run["load"] = _load_record(worker.loads[-1])
            run["speedup"] = round(run["cold_ttft_s"] / run["restored_ttft_s"], 2)
            out["runs"].append(run)
            print(f"BENCH {n_tok} tokens: {run}", flush=True)
    finally:
        vllm_engines.shutdown(llm)
    return out


def _ttft(llm, tokens, salt: str | None = None) -> float:
    """Seconds of a one-token generation of `tokens` (offline TTFT)."""
    t0 = time.perf_counter()
    vllm_engines.generate(llm, tokens, max_tokens=1, cache_salt=salt)
    return time.perf_counter() - t0


SCENARIOS = {"restore": restore, "bench": bench}


def _main(argv: list[str]) -> int:
    import json
    import sys

    missing = dsv4_engine.prepare_process()
    if missing:  # one line naming the missing ISA: the caller skips
        print(json.dumps({"skipped": f"vLLM CPU's DeepSeek-V4 path needs AVX-512: torch.ops._C lacks "
                                     f"{', '.join(missing)}"}))
        return 0
    t0 = time.time()
    swa_ok = dsv4_engine.check_swa_indices()
    rec = SCENARIOS[argv[0]](**json.loads(argv[1]))
    rec["swa_indices_torch_matches_triton"] = swa_ok
    rec["scenario_seconds"] = round(time.time() - t0, 2)
    sys.stdout.write(json.dumps(rec, default=str) + "\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
