"""CRC-32C and the checksumming copy of the CPU library (bsr_kernels.host_crc), side by side.

    python benchmarks/bench_crc.py [--reps 15]

1. CRC-32C GB/s of one buffer, from DRAM (64 MiB) and from L2 (512 KiB): the library's default
   (folding with AVX-512 VPCLMULQDQ where the CPU has it), the same library with
   BSR_CRC_NO_FOLD=1 (the SSE4.2 instruction in three streams; measured in a child process,
   since the choice is made once per process) and google_crc32c.value on the same bytes.
2. The checksumming copy (header + payload apart, CRC of each 16 KiB piece as it lands) of a
   64 MiB window of objects, 1 and 2 threads, against one numpy copy of the same bytes, with
   each CRC implementation.
Medians of interleaved repetitions; the ratio columns divide by the row's reference. Appends a
record to benchmarks/results/bench_crc.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import google_crc32c
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.kernel_bench import ChecksummingCopy  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_kernels import host_crc  # noqa: E402

H = 128


def median_seconds(fns: dict, reps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def crc_rates(reps: int) -> dict[str, float]:
    """GB/s of this process's library and of google_crc32c, from DRAM and from L2."""
    rng = np.random.default_rng(0)
    out = {}
    for where, size in (("dram", 64 << 20), ("l2", 512 << 10)):
        a = rng.integers(0, 256, size, dtype=np.uint8)
        t = median_seconds({"bsr": lambda a=a: host_crc.crc32c(a.ctypes.data, a.size),
                            "google": lambda a=a: google_crc32c.value(a)}, reps)
        out.update({f"{k}_{where}": size / v / 1e9 for k, v in t.items()})
    out["implementation"] = host_crc.implementation()
    return out


def copy_row(body: int, reps: int, seed: int) -> dict:
    copy = ChecksummingCopy(64 << 20, body, H, seed)
    plain = np.empty_like(copy.src)
    t = median_seconds({
        "copy": lambda: np.copyto(plain, copy.src),
        "copy_crc_1t": lambda: copy(1),
        "copy_crc_2t": lambda: copy(2),
    }, reps)
    row = {"object_KiB": body >> 10, **{f"{k}_GBps": round(copy.nbytes / v / 1e9, 1) for k, v in t.items()}}
    row.update({f"{k}_vs_copy": round(t["copy"] / t[k], 2) for k in ("copy_crc_1t", "copy_crc_2t")})
    return row


def copy_rates(reps: int) -> list[dict]:
    return [copy_row(body, reps, seed) for seed, body in enumerate((1 << 20, 256 << 10, 64 << 10), 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_record_options(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({**crc_rates(args.reps), "copy": copy_rates(args.reps)}))
        return
    if not host_crc.available():
        sys.exit("libbsr_cpu.so is not built (no C compiler at install?)")
    default = crc_rates(args.reps)
    child = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)], check=True,
                           capture_output=True, text=True, env={**os.environ, "BSR_CRC_NO_FOLD": "1"})
    no_fold = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"CRC-32C GB/s (default implementation: {default['implementation']}; "
          f"with BSR_CRC_NO_FOLD=1: {no_fold['implementation']})")
    print(f"{'':8} {'bsr default':>12} {'bsr no-fold':>12} {'google':>8} {'default/google':>15}")
    crc = []
    for where in ("dram", "l2"):
        d, f, g = default[f"bsr_{where}"], no_fold[f"bsr_{where}"], default[f"google_{where}"]
        print(f"{where:8} {d:12.1f} {f:12.1f} {g:8.1f} {d / g:15.2f}")
        crc.append({"buffer": where, "bsr_default_GBps": round(d, 1), "bsr_no_fold_GBps": round(f, 1),
                    "google_GBps": round(g, 1), "default_vs_google": round(d / g, 2)})
    print("\nchecksumming copy of a 64 MiB window (header + payload apart) vs one numpy copy of the same bytes")
    copies = {"default": copy_rates(args.reps), "BSR_CRC_NO_FOLD=1": no_fold["copy"]}
    for name, rows in copies.items():
        cols = list(rows[0])
        print(f"[{name}]")
        print(" ".join(f"{c:>20}" for c in cols))
        for r in rows:
            print(" ".join(f"{r[c]!s:>20}" for c in cols))
    record_script(args, "bench_crc", {
        "implementation": default["implementation"], "no_fold_implementation": no_fold["implementation"],
        "crc32c": crc, "checksumming_copy": copies["default"],
        "checksumming_copy_no_fold": copies["BSR_CRC_NO_FOLD=1"]}, omit=("child",))


if __name__ == "__main__":
    main()
