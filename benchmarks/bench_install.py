"""Install throughput of one window against a contiguous copy of the same bytes, side by side.

Registrations: presets.dsv4_flash(scale=1/16) (167 tensors, c = 1,063,488 B per chunk) and
scale=1/64; windows of W chunks, block tables shuffled and fully resident so every byte of the
window moves. Backends run through WindowInstaller (validated and prepared once, as a restore
does): torch, cpu:1t (the native library, one thread), cpu:2t (two threads), and on a GPU machine
the GPU backends. GB/s counts W * c staged bytes over the fastest round (on a shared machine the
median mostly measures other processes); rounds of all columns are interleaved. `contig` is
`dst.copy_(src)` of the same W * c bytes on the same device, measured in the same run; each
ratio is backend GB/s / contig GB/s. Two CPU tables: "warm" (rounds back to back: each column's
buffers are as warm as the other columns leave them; at W = 1 they stay in the 32 MiB L3) and
"cold" (a 128 MiB write before every timed call, so staging and destinations start in DRAM, as
after a fetch of a large window). torch's copy_ uses all torch threads (2 here) for the
contiguous copy. Appends a record to benchmarks/results/bench_install.jsonl (bsr_harness.records).

A third table puts the one-shot call beside the prepared one: `install_window(...)` on every call
(the destinations' preparation cached by layout, bsr_kernels/prepared.py; staging, chunk range and
the window's block-table entries checked per call) against a WindowInstaller made once, same
backend, the same window and destinations, rounds interleaved; `one/prep` is the one-shot call's time over the prepared
call's (1.00: no cost for calling the simple way).

    .venv/bin/python benchmarks/bench_install.py                   # the tables
    .venv/bin/python benchmarks/bench_install.py --windows 1,8,32 --min-time 2
    .venv/bin/python -m pytest benchmarks/bench_install.py --benchmark-only   # pytest-benchmark
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for the plain-script run

import pytest
import torch

from bsr_harness.kernel_bench import best_seconds, cache_evictor, default_labels, install_step, prepared_and_one_shot
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import presets

SCALES = (1 / 16, 1 / 64)
WINDOWS = (1, 8, 32)


def _devices() -> list[str]:
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def run(scales=SCALES, windows=WINDOWS, min_time: float = 2.0, min_rounds: int = 5,
        rows: list[dict] | None = None, one_shot_rows: list[dict] | None = None) -> str:
    """The tables as text; each row of the backend tables also appended to `rows` as a dict, each
    of the one-shot table to `one_shot_rows`."""
    rows = [] if rows is None else rows
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs"]
    modes = [(d, m) for d in _devices() for m in (("warm", "cold") if d == "cpu" else ("warm",))]
    for device, mode in modes:
        labels = default_labels(device)
        before = cache_evictor() if mode == "cold" else None
        head = f"{'registration':24} {'dev':4} {'W':>3} {'MB':>6} {'contig':>7}"
        head += "".join(f" {lab:>8}" for lab in labels) + "".join(f" {'r ' + lab:>9}" for lab in labels)
        lines += [f"GB/s per backend, then ratio to contig ({device}, {mode})", head]
        for scale in scales:
            reg = presets.dsv4_flash(scale=scale)
            for w in windows:
                fns = [install_step(reg, w, device, lab) for lab in ("contiguous", *labels)]
                secs = best_seconds(fns, min_time=min_time, min_rounds=min_rounds, before=before)
                nbytes = w * reg.chunk_bytes
                gbps = [nbytes / s / 1e9 for s in secs]
                row = f"{reg.name:24} {device:4} {w:3d} {nbytes / 1e6:6.1f} {gbps[0]:7.2f}"
                row += "".join(f" {g:8.2f}" for g in gbps[1:]) + "".join(f" {g / gbps[0]:9.3f}" for g in gbps[1:])
                lines.append(row)
                rows.append({"registration": reg.name, "device": device, "mode": mode, "window_chunks": w,
                             "bytes": nbytes, "contiguous_GBps": round(gbps[0], 2),
                             **{f"{lab}_GBps": round(g, 2) for lab, g in zip(labels, gbps[1:])},
                             **{f"{lab}_vs_contiguous": round(g / gbps[0], 3) for lab, g in zip(labels, gbps[1:])}})
                print(row, file=sys.stderr, flush=True)
    lines += one_shot_vs_prepared(scales, windows, min_time, min_rounds, rows=one_shot_rows)
    return "\n".join(lines)


def one_shot_vs_prepared(scales=SCALES, windows=WINDOWS, min_time: float = 2.0, min_rounds: int = 5,
                         device: str = "cpu", rows: list[dict] | None = None) -> list[str]:
    """Rows: registration, W, contig, prepared and one-shot GB/s, their ratios to contig, one/prep
    (also appended to `rows` as dicts)."""
    rows = [] if rows is None else rows
    backend = "cpu" if "cpu:1t" in default_labels(device) else "torch"
    lines = [f"one-shot install_window vs prepared WindowInstaller ({device}, backend {backend}, warm; both on "
             f"one window and its destinations)",
             f"{'registration':24} {'dev':4} {'W':>3} {'MB':>6} {'contig':>7} {'prepared':>8} {'one-shot':>8} "
             f"{'r prep':>7} {'r one':>7} {'one/prep':>8}"]
    for scale in scales:
        reg = presets.dsv4_flash(scale=scale)
        for w in windows:
            fns = [install_step(reg, w, device, "contiguous"), *prepared_and_one_shot(reg, w, device, backend)]
            contig, prep, one = best_seconds(fns, min_time=min_time, min_rounds=min_rounds)
            nbytes = w * reg.chunk_bytes
            row = (f"{reg.name:24} {device:4} {w:3d} {nbytes / 1e6:6.1f} {nbytes / contig / 1e9:7.2f} "
                   f"{nbytes / prep / 1e9:8.2f} {nbytes / one / 1e9:8.2f} {contig / prep:7.3f} {contig / one:7.3f} "
                   f"{one / prep:8.2f}")
            lines.append(row)
            rows.append({"registration": reg.name, "device": device, "backend": backend, "window_chunks": w,
                         "bytes": nbytes, "contiguous_GBps": round(nbytes / contig / 1e9, 2),
                         "prepared_GBps": round(nbytes / prep / 1e9, 2), "one_shot_GBps": round(nbytes / one / 1e9, 2),
                         "one_shot_vs_prepared_time": round(one / prep, 2)})
            print(row, file=sys.stderr, flush=True)
    return lines


def parse_scales(text: str) -> tuple[float, ...]:
    """"1/16,1/64" -> (0.0625, 0.015625): each a fraction 1/k or a number in (0, 1]."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            num, _, den = item.partition("/")
            value = float(num) / float(den) if den else float(num)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"--scales: {item!r} is not a number or a fraction like 1/16") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"--scales: {item!r} is outside (0, 1]")
        out.append(value)
    return tuple(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=parse_scales, default=SCALES,
                   help="entry-width scales of the DeepSeek-V4-Flash preset (default 1/16,1/64; 1 = real widths: "
                        "spans 64x those of 1/64)")
    p.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of interleaved rounds per row")
    add_record_options(p)
    args = p.parse_args()
    rows: list[dict] = []
    one_shot_rows: list[dict] = []
    print(run(scales=args.scales, windows=[int(w) for w in args.windows.split(",")], min_time=args.min_time, rows=rows,
              one_shot_rows=one_shot_rows))
    record_script(args, "bench_install", {"rows": rows, "one_shot_vs_prepared": one_shot_rows})


# -- pytest-benchmark: one case per (scale, W, device, backend) ----------------------------------
CASES = [(s, w, d, b) for d in _devices() for s in SCALES for w in WINDOWS for b in ("contiguous", *default_labels(d))]


@pytest.mark.parametrize("scale,w,device,label", CASES, ids=[f"{d}-{b}-1/{round(1 / s)}-W{w}" for s, w, d, b in CASES])
def test_install(benchmark, scale, w, device, label):
    reg = presets.dsv4_flash(scale=scale)
    fn = install_step(reg, w, device, label)
    fn()  # warm-up (Triton compiles here)
    benchmark.group = f"{device} 1/{round(1 / scale)} W={w}"
    benchmark(fn)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["GB/s"] = round(w * reg.chunk_bytes / benchmark.stats.stats.min / 1e9, 3)


if __name__ == "__main__":
    main()
