"""Install microbenchmark: one window of W chunks per backend against a contiguous copy.

Block tables are shuffled and fully resident so every byte of the window moves. Each case is
timed over `rounds` rounds and the fastest counts (on a shared machine the median mostly
measures other processes). The contiguous copy `dst.copy_(src)` of the same W*c bytes on the
same device is measured in the same run, so the ratio is side by side. Backends run through the
public WindowInstaller (validated and prepared once, as a restore does), so a timed window is
what each window of a restore costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from bsr_kernels.install import WindowInstaller, available_backends, install_window
from bsr_kernels.registration import Registration

# label -> (backend, cpu_threads): the cpu library once single-threaded and once with two threads
CPU_VARIANTS = {"cpu:1t": ("cpu", 1), "cpu:2t": ("cpu", 2)}


def make_window(reg: Registration, w: int, device: str, seed: int = 0):
    """(staging, destinations, block tables) of a W-chunk window; staging pinned for GPU destinations."""
    gen = torch.Generator().manual_seed(seed)
    tables, blocks = [], []
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, w * reg.chunk_tokens)
        tables.append(torch.randperm(need, generator=gen).to(device))
        blocks.append(need)
    tables = reg.without_heads(tables)  # sliding windows hold each chunk's tail only, as an engine's do
    kv = reg.allocate(blocks, device)
    staging = torch.randint(0, 256, (w * reg.chunk_bytes,), dtype=torch.uint8, generator=gen)
    staging = staging.pin_memory() if device != "cpu" else staging
    return staging, kv, tables


def install_step(reg: Registration, w: int, device: str, label: str, staging_on_device: bool = False,
                 seed: int = 0) -> Callable[[], None]:
    """A zero-argument callable installing one W-chunk window with backend `label` (a backend name,
    or cpu:1t / cpu:2t), or doing the contiguous copy of the same bytes (label "contiguous")."""
    staging, kv, tables = make_window(reg, w, device, seed)
    if staging_on_device:
        staging = staging.to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    if label == "contiguous":
        src = staging.to(device)
        dst = torch.empty_like(src)

        def copy() -> None:
            dst.copy_(src)
            sync()
        return copy
    backend, threads = CPU_VARIANTS.get(label, (label, 0))
    inst = WindowInstaller(reg, kv, tables, w, backend=backend, cpu_threads=threads)

    def install() -> None:
        inst.install(staging, 0, w)
        sync()
    return install


def prepared_and_one_shot(reg: Registration, w: int, device: str, label: str,
                          seed: int = 0) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two callables installing the same W-chunk window into the same destinations with backend
    `label`: through a WindowInstaller made once, and through install_window on every call."""
    staging, kv, tables = make_window(reg, w, device, seed)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    backend, threads = CPU_VARIANTS.get(label, (label, 0))
    inst = WindowInstaller(reg, kv, tables, w, backend=backend, cpu_threads=threads)

    def prepared() -> None:
        inst.install(staging, 0, w)
        sync()

    def one_shot() -> None:
        install_window(staging, reg, kv, tables, 0, w, backend=backend, cpu_threads=threads)
        sync()
    return prepared, one_shot


def cache_evictor(nbytes: int = 128 << 20) -> Callable[[], None]:
    """Writes `nbytes` (several times the last-level cache) so the next call starts cache-cold.
    One numpy thread: a torch op would leave its OpenMP workers spinning on a core afterwards, and
    a two-thread call timed next would compete with them (seen in benchmarks/bench_install.py)."""
    junk = np.empty(nbytes, dtype=np.uint8)
    count = [0]

    def evict() -> None:
        count[0] += 1
        junk.fill(count[0] & 0xFF)
    return evict


class ChecksummingCopy:
    """A window of about `window` bytes of objects (a `head`-byte header + `body` bytes each) and the
    CPU library's checksumming copy of it: headers and bodies to separate buffers, the bodies 64-byte
    aligned as staging slots are. `copy(threads)` runs it; `nbytes` is what it reads."""

    def __init__(self, window: int, body: int, head: int = 128, seed: int = 0) -> None:
        n = max(1, window // body)
        self.head, self.body = head, body
        self.src = np.random.default_rng(seed).integers(0, 256, n * (head + body), dtype=np.uint8)
        self.heads, self.bodies = np.empty(max(1, n * head), np.uint8), np.empty(n * body + 64, np.uint8)
        self.sp = self.src.ctypes.data + np.arange(n, dtype=np.int64) * (head + body)
        self.hp = self.heads.ctypes.data + np.arange(n, dtype=np.int64) * head
        self.bp = self.bodies.ctypes.data + (-self.bodies.ctypes.data) % 64 + np.arange(n, dtype=np.int64) * body
        self.nbytes = self.src.size

    def __call__(self, threads: int = 0):
        from bsr_kernels import host_crc

        return host_crc.copy_crc32c(self.sp, self.hp, self.bp, self.head, self.body, threads=threads)


def best_seconds(fns: list[Callable[[], None]], min_time: float = 2.0, min_rounds: int = 5,
                 before: Callable[[], None] | None = None) -> list[float]:
    """Fastest round of each callable, rounds interleaved so that load from other processes
    hits all of them alike. `before` runs untimed before every timed call (cache_evictor)."""
    for fn in fns:
        fn()  # warm-up (allocations, Triton compile, CUDA context)
    best, rounds, start = [float("inf")] * len(fns), 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < min_time:
        for k, fn in enumerate(fns):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
        rounds += 1
    return best


def default_labels(device: str) -> list[str]:
    out = []
    for b in available_backends(device):
        if b == "triton" and device == "cpu":
            continue  # the CPU interpreter is a test tool, not a backend to time
        out += list(CPU_VARIANTS) if b == "cpu" else [b]
    return out


def bench_install(reg: Registration, windows: list[int], device: str = "cpu", rounds: int = 5,
                  backends: list[str] | None = None, min_time: float = 0.0) -> list[dict]:
    """Rows: window_chunks, bytes, backend, gbps, contiguous_gbps, ratio (backend / contiguous)."""
    labels = backends or default_labels(device)
    rows = []
    for w in windows:
        nbytes = w * reg.chunk_bytes
        fns = [install_step(reg, w, device, label, staging_on_device=False) for label in ("contiguous", *labels)]
        contiguous, *times = best_seconds(fns, min_time=min_time, min_rounds=rounds)
        for label, seconds in zip(labels, times):
            gbps = nbytes / seconds / 1e9
            rows.append({"window_chunks": w, "bytes": nbytes, "backend": label, "device": device, "gbps": gbps,
                         "contiguous_gbps": nbytes / contiguous / 1e9, "ratio": contiguous / seconds})
    return rows
