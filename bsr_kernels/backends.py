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
    return [b for b in ("torch", "triton", "cuda", "cpu") if backend_available(b, device)]


def backend_available(backend: str, device: torch.device) -> bool:
    if backend == "torch":
        return True
    if backend == "triton":
        from . import triton_backend

        return triton_backend.available(device)
    if backend == "cuda":
        from . import cuda_backend

        return device.type == "cuda" and cuda_backend.available()
    from . import cpu_backend

    return backend == "cpu" and device.type == "cpu" and cpu_backend.available()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for `backend` (a name or "auto") on destinations on `device`."""
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join((*BACKENDS, 'auto'))}")
    if backend != "auto":
        if not backend_available(backend, device):
            raise ValueError(f"backend {backend!r} is not available for {device} on this machine")
        return backend
    if device.type == "cuda":
        return next(b for b in ("cuda", "triton", "torch") if backend_available(b, device))
    if backend_available("cpu", device):  # Triton on CPU is an interpreter: correct, but far slower
        return "cpu"
    if device.type == "cpu" and "cpu" not in _NOTICED:
        from . import cpu_backend

        _NOTICED.add("cpu")
        print(f"bsr: native cpu backend unavailable ({cpu_backend.load_error()}); using torch", file=sys.stderr)
    return "torch"
