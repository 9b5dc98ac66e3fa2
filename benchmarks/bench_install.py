"""Install throughput of one window against a contiguous copy of the same bytes.

Registration: presets.dsv4_flash(scale=1/16) (167 tensors, c = 1,063,488 B per chunk), windows of
W chunks, block tables shuffled and fully resident so every byte of the window moves. GB/s counts
W * c staged bytes over the fastest round (the minimum: on a shared machine the median mostly
measures other processes). The backend is timed on validated arguments (what install_window
runs after its checks); `contiguous` is `dst.copy_(src)` of the same W * c bytes on the same
device, measured in the same run.

    .venv/bin/python -m pytest benchmarks/bench_install.py --benchmark-only   # pytest-benchmark
    .venv/bin/python benchmarks/bench_install.py                              # table only

Each install result carries GB/s and ratio (install GB/s / contiguous GB/s) in extra_info; the
table is printed at the end of the module in both modes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for the plain-script run

import pytest
import torch

from bsr_kernels import bench, presets
from bsr_kernels.install import _run, available_backends

REG = presets.dsv4_flash(scale=1 / 16)
WINDOWS = (1, 8, 16, 32, 64)


def _devices_and_backends() -> list[tuple[str, str]]:
    out = [("cpu", "torch")]
    if torch.cuda.is_available():
        out += [("cuda", b) for b in available_backends("cuda")]
    return out


DEVICES = {dev: [b for d, b in _devices_and_backends() if d == dev] for dev, _ in _devices_and_backends()}
# per (device, W): the contiguous copy first, then that device's backends
CASES = [(w, dev, b) for dev, backends in DEVICES.items() for w in WINDOWS for b in ("contiguous", *backends)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_window(w: int, device: str, seed: int = 0):
    """A validated W-chunk window with staging on the destination device."""
    a = bench.make_window(REG, w, device, seed)
    return dataclasses.replace(a, staging=a.staging.to(device))


def step(w: int, device: str, backend: str):
    """A zero-argument callable doing one install (or one contiguous copy) of a W-chunk window."""
    a = make_window(w, device)
    if backend == "contiguous":
        dst = torch.empty_like(a.staging)

        def fn():
            dst.copy_(a.staging)
            _sync(device)
    else:
        def fn():
            _run("install", backend, REG, a, None, True)
            _sync(device)
    return fn


RESULTS: dict[tuple[int, str, str], float] = {}  # (W, device, backend) -> GB/s


def record(w: int, device: str, backend: str, seconds: float) -> dict:
    gbps = w * REG.chunk_bytes / seconds / 1e9
    RESULTS[(w, device, backend)] = gbps
    info = {"W": w, "bytes": w * REG.chunk_bytes, "GB/s": round(gbps, 3)}
    base = RESULTS.get((w, device, "contiguous"))
    if backend != "contiguous" and base:
        info["ratio"] = round(gbps / base, 3)
    return info


def table() -> str:
    lines = [f"{REG.describe()}; torch {torch.__version__}, {torch.get_num_threads()} CPU threads",
             f"{'device':6} {'backend':8} {'W':>3} {'MB':>7} {'GB/s':>7} {'contig GB/s':>11} {'ratio':>6}"]
    for (w, device, backend), gbps in RESULTS.items():
        if backend == "contiguous":
            continue
        base = RESULTS.get((w, device, "contiguous"), float("nan"))
        lines.append(f"{device:6} {backend:8} {w:3d} {w * REG.chunk_bytes / 1e6:7.1f} {gbps:7.2f} "
                     f"{base:11.2f} {gbps / base:6.3f}")
    return "\n".join(lines)


# -- pytest-benchmark -------------------------------------------------------------------------

class _PrintTable:
    @pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
    def pytest_terminal_summary(self, terminalreporter):
        if RESULTS:
            terminalreporter.write_sep("-", "install vs contiguous copy (fastest rounds)")
            terminalreporter.write_line(table())


@pytest.fixture(scope="module", autouse=True)
def _print_table_at_end(request):
    request.config.pluginmanager.register(_PrintTable(), "bench_install_table")
    yield


@pytest.mark.parametrize("w,device,backend", CASES, ids=[f"{d}-{b}-W{w}" for w, d, b in CASES])
def test_install(benchmark, w, device, backend):
    fn = step(w, device, backend)
    fn()  # warm-up (Triton compiles here)
    benchmark.group = f"{device} W={w}"
    benchmark(fn)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info.update(record(w, device, backend, benchmark.stats.stats.min))


# -- plain main -------------------------------------------------------------------------------

def _best_seconds(fns: list, min_time: float = 2.0, min_rounds: int = 5) -> list[float]:
    """Fastest round of each callable, rounds interleaved so that load from other processes
    hits all of them alike."""
    for fn in fns:
        fn()
    best, rounds, start = [float("inf")] * len(fns), 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < min_time:
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
        rounds += 1
    return best


def main() -> None:
    for device, backends in DEVICES.items():
        for w in WINDOWS:
            names = ["contiguous", *backends]
            for name, seconds in zip(names, _best_seconds([step(w, device, b) for b in names])):
                record(w, device, name, seconds)
            print(f"{device} W={w} done", file=sys.stderr)
    print(table())


if __name__ == "__main__":
    main()
