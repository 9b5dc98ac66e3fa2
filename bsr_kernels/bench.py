"""Install microbenchmark: one window of W chunks per backend against a contiguous copy.

Block tables are shuffled and fully resident so every byte of the window moves. Each case is
timed over `rounds` rounds and the fastest counts (on a shared machine the median mostly
measures other processes). The contiguous copy `dst.copy_(src)` of the same W*c bytes on the
same device is measured in the same run, so the ratio is side by side.
"""

from __future__ import annotations

import time

import torch

from .install import _run, available_backends
from .registration import Registration
from .validate import WindowArgs, check_window


def make_window(reg: Registration, w: int, device: str, seed: int = 0) -> WindowArgs:
    gen = torch.Generator().manual_seed(seed)
    tables, blocks = [], []
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, w * reg.chunk_tokens)
        tables.append(torch.randperm(need, generator=gen).to(device))
        blocks.append(need)
    kv = reg.allocate(blocks, device)
    staging = torch.randint(0, 256, (w * reg.chunk_bytes,), dtype=torch.uint8, generator=gen)
    pin = device != "cpu"
    staging = staging.pin_memory() if pin else staging
    return check_window(staging, reg, kv, tables, 0, w)


def _time(fn, device: str, rounds: int) -> float:
    fn()  # warm-up (allocations, Triton compile, CUDA context)
    best = float("inf")
    for _ in range(rounds):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_install(reg: Registration, windows: list[int], device: str = "cpu", rounds: int = 5,
                  backends: list[str] | None = None) -> list[dict]:
    """Rows: window_chunks, bytes, backend, gbps, contiguous_gbps, ratio (backend / contiguous)."""
    backends = backends or available_backends(device)
    if device == "cpu":
        backends = [b for b in backends if b != "triton"]  # the CPU interpreter is a test tool, not a backend to time
    rows = []
    for w in windows:
        a = make_window(reg, w, device)
        nbytes = w * reg.chunk_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).copy_(a.staging)
        dst = torch.empty_like(src)
        contiguous = nbytes / _time(lambda s=src, d=dst: d.copy_(s), device, rounds) / 1e9
        for b in backends:
            gbps = nbytes / _time(lambda b=b, a=a: _run("install", b, reg, a, None, True), device, rounds) / 1e9
            rows.append({"window_chunks": w, "bytes": nbytes, "backend": b, "device": device, "gbps": gbps,
                         "contiguous_gbps": contiguous, "ratio": gbps / contiguous})
    return rows
