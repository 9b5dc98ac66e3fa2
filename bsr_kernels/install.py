"""install_window / gather_window: one contract, backends "torch" | "triton" | "cuda" | "cpu" | "auto".

"auto": CUDA destinations get cuda, else triton, else torch; CPU destinations get the native cpu
library, else torch (with a one-line notice once per process saying why).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from .install_torch import DestinationRows, gather_torch, install_torch
from .registration import Registration
from .validate import WindowArgs, check_destinations, check_fingerprint, check_staging, check_window

BACKENDS = ("torch", "triton", "cuda", "cpu")
_NOTICED: set[str] = set()


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run on `device` on this machine (Triton on CPU needs TRITON_INTERPRET=1)."""
    device = torch.device(device)
    out = ["torch"]
    from . import install_triton

    if install_triton.available(device):
        out.append("triton")
    if device.type == "cuda":
        from . import cuda_backend

        if cuda_backend.available():
            out.append("cuda")
    if device.type == "cpu":
        from . import cpu_backend

        if cpu_backend.available():
            out.append("cpu")
    return out


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join((*BACKENDS, 'auto'))}")
    if backend != "auto":
        if backend != "torch" and backend not in available_backends(device):
            raise ValueError(f"backend {backend!r} is not available for {device} on this machine")
        return backend
    avail = available_backends(device)
    if device.type == "cuda":
        return "cuda" if "cuda" in avail else ("triton" if "triton" in avail else "torch")
    if "cpu" in avail:  # Triton on CPU is an interpreter: correct, but far slower
        return "cpu"
    if device.type == "cpu" and "cpu" not in _NOTICED:
        from . import cpu_backend

        _NOTICED.add("cpu")
        print(f"bsr: native cpu backend unavailable ({cpu_backend.load_error()}); using torch", file=sys.stderr)
    return "torch"


def _run(kind: str, backend: str, reg: Registration, a: WindowArgs, stream, zero_copy: bool,
         dest: DestinationRows | None = None, cpu_threads: int = 0) -> None:
    if a.num_chunks == 0:
        return
    if backend == "cpu":
        from . import cpu_backend

        (cpu_backend.install if kind == "install" else cpu_backend.gather)(reg, a, cpu_threads)
    elif backend == "torch":
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            (install_torch if kind == "install" else gather_torch)(reg, a, dest)
    elif backend == "triton":
        from . import install_triton

        (install_triton.install if kind == "install" else install_triton.gather)(reg, a, stream)
    else:
        from . import cuda_backend

        (cuda_backend.install if kind == "install" else cuda_backend.gather)(reg, a, stream, zero_copy)


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def install_window(
    staging: torch.Tensor,
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
    fingerprint: str | None = None,
    zero_copy: bool = True,
    cpu_threads: int = 0,
) -> str:
    """Scatter `num_chunks` staged chunks (chunk-major, starting at request chunk `first_chunk`)
    into the destination blocks. Returns the backend that ran.

    `staging` is 1-D contiguous uint8 (chunk c at byte c * reg.chunk_bytes) or 2-D uint8 of shape
    (>= num_chunks, reg.chunk_bytes), one row per chunk, with stride(1) == 1 and a chunk stride
    stride(0) >= chunk_bytes that is a multiple of 16 (e.g. `buf.view(n, stride)[:, headroom:]`:
    scratch bytes before each chunk). Bytes between rows are never read into destinations.

    Entry e of tensor t lands in block `block_tables[group][e // block_size]`, slot
    `e % block_size`; block id -1 is skipped (legal only in groups with a sliding window). Each
    destination may be any strided view of shape (num_blocks, block_size, *entry_shape) whose
    innermost dim has stride 1 (vLLM CPU, FlashAttention, FlashInfer HND, MLA row slices); no two
    destinations may share a byte, except destinations of different groups that are the same memory
    block for block (vLLM's hybrid allocator) when no block id is resident in both groups' tables.
    The staged layout stays canonical whatever the destination layout. `fingerprint`, when
    given, is the registration fingerprint the staged objects were written under. Everything is
    validated before any byte moves. With the CUDA backend and pinned host staging, `zero_copy` reads host memory
    directly; otherwise the staging must be (or is copied) on the destination device. With the
    cpu backend, `cpu_threads` forces a thread count (0: one, two above the library's size threshold).
    """
    a = check_window(staging, reg, kv, block_tables, first_chunk, num_chunks, fingerprint=fingerprint)
    chosen = resolve_backend(backend, a.kv[0].device)
    _run("install", chosen, reg, a, stream, zero_copy, cpu_threads=_threads(cpu_threads))
    return chosen


def gather_window(
    out: torch.Tensor,
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
    zero_copy: bool = True,
    cpu_threads: int = 0,
) -> str:
    """Exact inverse of install_window: copy the window's entries from the destination blocks
    into `out` (chunk-major staging layout, 1-D or 2-D chunk-strided as for install_window).
    Padding and entries of -1 blocks read as zero; bytes between the rows of a 2-D `out` are
    never written."""
    a = check_window(out, reg, kv, block_tables, first_chunk, num_chunks, staging_name="out")
    chosen = resolve_backend(backend, a.kv[0].device)
    _run("gather", chosen, reg, a, stream, zero_copy, cpu_threads=_threads(cpu_threads))
    return chosen


def _threads(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"cpu_threads must be a non-negative integer (0 = auto), got {n!r}")
    return int(n)


class WindowInstaller:
    """install_window for the windows of one request, validated and prepared once.

    The destinations and block tables are checked for chunks 0..num_chunks-1 when the installer
    is made (block tables are copied, so the request cannot change them underneath), and the
    per-restore state is built then (torch: destination views; cpu: descriptor table and
    block-table pointers); each window then checks only its staging and its chunk range and
    passes just those. Same results as install_window / gather_window.
    """

    def __init__(self, reg: Registration, kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor],
                 num_chunks: int, *, backend: str = "auto", stream: torch.cuda.Stream | None = None,
                 fingerprint: str | None = None, zero_copy: bool = True, cpu_threads: int = 0) -> None:
        check_fingerprint(reg, fingerprint)
        kv, tables = check_destinations(reg, kv, block_tables, 0, num_chunks)
        self.reg = reg
        self.kv = kv
        self.num_chunks = num_chunks
        self.backend = resolve_backend(backend, kv[0].device)
        # copied (the request cannot change them underneath) and, for GPU backends, uploaded once
        # per restore: each window then reuses the device tables and their cached pointer table
        device = kv[0].device if self.backend in ("triton", "cuda") else tables[0].device
        self.block_tables = tuple(t.to(device, copy=True) for t in tables)
        self.stream = stream
        self.zero_copy = zero_copy
        self.cpu_threads = _threads(cpu_threads)
        self._dest = DestinationRows(reg, kv) if self.backend == "torch" else None
        self._cpu = None
        if self.backend == "cpu":
            from . import cpu_backend

            self._cpu = cpu_backend.Prepared(reg, kv, self.block_tables, self.cpu_threads)

    def _window(self, kind: str, staging: torch.Tensor, first_chunk: int, num_chunks: int, name: str) -> str:
        if first_chunk < 0 or num_chunks < 0 or first_chunk + num_chunks > self.num_chunks:
            raise ValueError(f"chunks {first_chunk}..{first_chunk + num_chunks - 1} are outside the "
                             f"{self.num_chunks} chunks this installer was validated for")
        stride = check_staging(staging, self.reg, num_chunks, name)
        if self._cpu is not None:
            self._cpu.run(kind, staging, first_chunk, num_chunks, stride)
        else:
            a = WindowArgs(staging, self.kv, self.block_tables, first_chunk, num_chunks, stride)
            _run(kind, self.backend, self.reg, a, self.stream, self.zero_copy, self._dest, self.cpu_threads)
        return self.backend

    def install(self, staging: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        """Scatter `num_chunks` staged chunks starting at request chunk `first_chunk`."""
        return self._window("install", staging, first_chunk, num_chunks, "staging")

    def gather(self, out: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        """The inverse: the window's entries into `out` (padding and -1 entries as zero)."""
        return self._window("gather", out, first_chunk, num_chunks, "out")
