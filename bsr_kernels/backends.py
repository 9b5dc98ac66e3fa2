"""Which install backend runs: "torch" | "triton" | "cuda" | "cpu", or "auto".

"auto": CUDA destinations get cuda, else triton, else torch; CPU destinations get the native cpu
library, else torch (with a one-line notice once per process saying why).
"""

from __future__ import annotations

import sys

import torch

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
    """The backend that runs for `backend` (a name or "auto") on destinations on `device`."""
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
