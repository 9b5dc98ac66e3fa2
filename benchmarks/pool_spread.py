"""The CPU library's two-thread calls with its workers kept off the caller's CPU (spread, the
default) and placed by the scheduler alone (BSR_CPU_SPREAD=0), side by side in one process.

    python benchmarks/pool_spread.py [--reps 25]

Each call is made from the main thread and from a worker thread while the main thread waits (as
MooncakeTier's fetch thread runs the checksumming copy): the two-thread checksumming copy of a
64 MiB window of 256 KiB objects, and the two-thread install of a 64 MiB window (CPU backend).
Medians of interleaved repetitions, each after a 128 MiB cache flush; ratio = off / on time.
Appends a record to benchmarks/results/pool_spread.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.kernel_bench import ChecksummingCopy, cache_evictor, make_window  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_kernels import cpu_backend, install_window, presets  # noqa: E402

BODY, WINDOW = 256 << 10, 64 << 20


def install_call():
    reg = presets.dsv4_flash(scale=1 / 16)
    w = max(1, WINDOW // reg.chunk_bytes)
    staging, kv, tables = make_window(reg, w, "cpu")
    return (lambda: install_window(staging, reg, kv, tables, 0, w, backend="cpu", cpu_threads=2)), (kv, staging)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=25)
    add_record_options(ap)
    args = ap.parse_args()
    if not cpu_backend.available():
        sys.exit(f"libbsr_cpu.so is not available: {cpu_backend.load_error()}")
    worker = ThreadPoolExecutor(1)
    evict = cache_evictor()
    copy = ChecksummingCopy(WINDOW, BODY)
    calls = {"checksumming copy": (lambda: copy(2), copy), "install": install_call()}
    runs = {}
    for name, (fn, _keep) in calls.items():
        runs[(name, "main thread")] = fn
        runs[(name, "worker thread")] = lambda fn=fn: worker.submit(fn).result()
    ts: dict = {(k, on): [] for k in runs for on in (True, False)}
    was = cpu_backend.pool_spread()
    try:
        for fn in runs.values():
            fn()
        for r in range(args.reps):
            for on in ((True, False) if r % 2 else (False, True)):
                cpu_backend.pool_spread(on)
                for k, fn in runs.items():
                    evict()
                    t = time.perf_counter()
                    fn()
                    ts[(k, on)].append(time.perf_counter() - t)
    finally:
        cpu_backend.pool_spread(was)
    print(f"{'call':20} {'from':14} {'spread ms':>10} {'off ms':>8} {'off/spread':>11}")
    rows = []
    for (name, where) in runs:
        on, off = (statistics.median(ts[((name, where), x)]) * 1e3 for x in (True, False))
        print(f"{name:20} {where:14} {on:10.2f} {off:8.2f} {off / on:11.2f}")
        rows.append({"call": name, "from": where, "spread_ms": round(on, 2), "off_ms": round(off, 2),
                     "off_vs_spread": round(off / on, 2)})
    record_script(args, "pool_spread", {"window_bytes": WINDOW, "rows": rows})


if __name__ == "__main__":
    main()
