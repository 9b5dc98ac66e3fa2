"""install_window / gather_window: one contract, backends "torch" | "triton" | "cuda" | "auto"."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .install_torch import DestinationRows, gather_torch, install_torch
from .registration import Registration
from .validate import WindowArgs, check_destinations, check_fingerprint, check_staging, check_window

BACKENDS = ("torch", "triton", "cuda")


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
    return out


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join((*BACKENDS, 'auto'))}")
    if backend != "auto":
        if backend != "torch" and backend not in available_backends(device):
            raise ValueError(f"backend {backend!r} is not available for {device} on this machine")
        return backend
    if device.type != "cuda":
        return "torch"  # Triton on CPU is an interpreter: correct, but far slower than torch
    avail = available_backends(device)
    return "cuda" if "cuda" in avail else ("triton" if "triton" in avail else "torch")


def _run(kind: str, backend: str, reg: Registration, a: WindowArgs, stream, zero_copy: bool,
         dest: DestinationRows | None = None) -> None:
    if a.num_chunks == 0:
        return
    if backend == "torch":
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
) -> str:
    """Scatter `num_chunks` staged chunks (chunk-major, starting at request chunk `first_chunk`)
    into the destination blocks. Returns the backend that ran.

    Entry e of tensor t lands in block `block_tables[group][e // block_size]`, slot
    `e % block_size`; block id -1 is skipped (legal only in groups with a sliding window). Each
    destination may be any strided view of shape (num_blocks, block_size, *entry_shape) whose
    innermost dim has stride 1 (vLLM CPU, FlashAttention, FlashInfer HND, MLA row slices); no two
    destinations may share a byte. The staged layout stays canonical whatever the destination
    layout. `fingerprint`, when given, is the registration
    fingerprint the staged objects were written under. Everything is validated before any byte
    moves. With the CUDA backend and pinned host staging, `zero_copy` reads host memory
    directly; otherwise the staging must be (or is copied) on the destination device.
    """
    a = check_window(staging, reg, kv, block_tables, first_chunk, num_chunks, fingerprint=fingerprint)
    chosen = resolve_backend(backend, a.kv[0].device)
    _run("install", chosen, reg, a, stream, zero_copy)
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
) -> str:
    """Exact inverse of install_window: copy the window's entries from the destination blocks
    into `out` (chunk-major staging layout). Padding and entries of -1 blocks read as zero."""
    a = check_window(out, reg, kv, block_tables, first_chunk, num_chunks, staging_name="out")
    chosen = resolve_backend(backend, a.kv[0].device)
    _run("gather", chosen, reg, a, stream, zero_copy)
    return chosen


class WindowInstaller:
    """install_window for the windows of one request, validated once.

    The destinations and block tables are checked for chunks 0..num_chunks-1 when the installer
    is made (block tables are copied, so the request cannot change them underneath); each
    window then checks only its staging and its chunk range. Same results as install_window.
    """

    def __init__(self, reg: Registration, kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor],
                 num_chunks: int, *, backend: str = "auto", stream: torch.cuda.Stream | None = None,
                 fingerprint: str | None = None, zero_copy: bool = True) -> None:
        check_fingerprint(reg, fingerprint)
        kv, tables = check_destinations(reg, kv, block_tables, 0, num_chunks)
        self.reg = reg
        self.kv = kv
        self.block_tables = tuple(t.clone() for t in tables)
        self.num_chunks = num_chunks
        self.backend = resolve_backend(backend, kv[0].device)
        self.stream = stream
        self.zero_copy = zero_copy
        self._dest = DestinationRows(reg, kv) if self.backend == "torch" else None

    def install(self, staging: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        if first_chunk < 0 or num_chunks < 0 or first_chunk + num_chunks > self.num_chunks:
            raise ValueError(f"chunks {first_chunk}..{first_chunk + num_chunks - 1} are outside the "
                             f"{self.num_chunks} chunks this installer was validated for")
        check_staging(staging, self.reg, num_chunks, "staging")
        a = WindowArgs(staging, self.kv, self.block_tables, first_chunk, num_chunks)
        _run("install", self.backend, self.reg, a, self.stream, self.zero_copy, self._dest)
        return self.backend
