"""Non-temporal stores in the CPU library (csrc/bsr_stream.h), on and off, side by side in one process.

    python benchmarks/stream_stores.py [--reps 21] [--window-mib 64]

Rows: the checksumming copy of a window of 256 KiB objects (host_crc.copy_crc32c, what the Mooncake
tier's local reads and the landed path run), and the install of a window of dsv4-flash@1/16 chunks
(backend "cpu"), each on 1 and 2 threads; the install also from "hot staging": a one-thread copy
writes the staged window right before (untimed), as a fetch leaves it for the install.
"streamed": stream_bytes(0) for both kinds of destination, every call uses non-temporal stores;
"cached": normal stores. By default (bsr_kernels.cpu_backend.stream_bytes) the library streams
copies into staging (the checksumming copy, gather) from the last-level cache size up and installs
always; the header line says which column each takes at --window-mib. Medians of interleaved
repetitions, each after a 128 MiB cache flush (the data starts in DRAM); ratio = cached / streamed.
Appends a record to benchmarks/results/stream_stores.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.kernel_bench import ChecksummingCopy, cache_evictor, make_window  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_kernels import cpu_backend, install_window, presets  # noqa: E402

BODY = 256 << 10


def crc_calls(window: int) -> tuple[dict, object]:
    copy = ChecksummingCopy(window, BODY)
    return {f"checksumming copy {t}t": (lambda t=t: copy(t)) for t in (1, 2)}, copy


def install_calls(window: int) -> tuple[dict, object]:
    """The install from cold staging (after the cache flush) and, as in a restore, from staging a
    fetch has just written (a one-thread copy into it right before, untimed: "hot")."""
    reg = presets.dsv4_flash(scale=1 / 16)
    w = max(1, window // reg.chunk_bytes)
    staging, kv, tables = make_window(reg, w, "cpu")
    fetched = staging.numpy().copy()

    def install(t: int, hot: bool) -> Callable[[], None]:
        def run() -> None:
            install_window(staging, reg, kv, tables, 0, w, backend="cpu", cpu_threads=t)
        run.before = (lambda: np.copyto(staging.numpy(), fetched)) if hot else None
        return run
    calls = {f"install {t}t": install(t, False) for t in (1, 2)}
    calls.update({f"install {t}t, hot staging": install(t, True) for t in (1, 2)})
    return calls, (staging, kv, tables, fetched)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--window-mib", type=float, default=64)
    add_record_options(ap)
    args = ap.parse_args()
    if not cpu_backend.available():
        sys.exit(f"libbsr_cpu.so is not available: {cpu_backend.load_error()}")
    window = int(args.window_mib * (1 << 20))
    default = {into: cpu_backend.stream_bytes(into=into) for into in cpu_backend.STREAM_INTO}
    (crc, _crc_buffers), (inst, _install_buffers) = crc_calls(window), install_calls(window)  # kept alive
    calls = {**crc, **inst}
    evict = cache_evictor()
    ts: dict = {(k, s): [] for k in calls for s in (True, False)}
    try:
        for r in range(args.reps + 1):
            for streamed in ((True, False) if r % 2 else (False, True)):
                for into in cpu_backend.STREAM_INTO:
                    cpu_backend.stream_bytes(0 if streamed else 1 << 62, into=into)
                for k, fn in calls.items():
                    evict()
                    if getattr(fn, "before", None):
                        fn.before()
                    t = time.perf_counter()
                    fn()
                    if r:  # the first round warms up
                        ts[(k, streamed)].append(time.perf_counter() - t)
    finally:
        for into, nbytes in default.items():
            cpu_backend.stream_bytes(nbytes, into=into)
    mib, staging, dests = window / (1 << 20), default["staging"], default["destinations"]
    print(f"window {mib:.0f} MiB; by default the library streams copies into staging from "
          f"{staging / (1 << 20):.0f} MiB up (here: {'streamed' if window >= staging else 'cached'}), installs "
          f"from {dests / (1 << 20):.0f} MiB up (here: {'streamed' if window >= dests else 'cached'})")
    print(f"{'call':24} {'streamed GB/s':>14} {'cached GB/s':>12} {'cached/streamed':>16}")
    rows = []
    for k in calls:
        on, off = (statistics.median(ts[(k, s)]) for s in (True, False))
        print(f"{k:24} {window / on / 1e9:14.1f} {window / off / 1e9:12.1f} {off / on:16.2f}")
        rows.append({"call": k, "streamed_GBps": round(window / on / 1e9, 1),
                     "cached_GBps": round(window / off / 1e9, 1), "cached_vs_streamed": round(off / on, 2)})
    record_script(args, "stream_stores", {"window_bytes": window, "default_stream_bytes": default, "rows": rows})


if __name__ == "__main__":
    main()
