"""Install backends by name, and which one runs: "torch" | "triton" | "cuda" | "cpu", or "auto".

A backend is registered once (`register_backend`): its name, whether it can run on a device here, its
state for a set of destinations (prepared once per layout, prepared.py) and its window call. Every
other part (install.py, prepared.py, the restore's config check, the kernel benchmarks) reads this
registry. "auto" takes the first available backend in AUTO_ORDER for the destinations' device type:
CUDA destinations get cuda, else triton, else torch; CPU destinations get the native cpu library, else
torch (with a one-line notice once per process saying why). Triton on CPU is an interpreter (a test
tool): available with TRITON_INTERPRET=1, never chosen by "auto".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu_backend
from .registration import Registration
from .validate import RunOptions, WindowArgs


@dataclass(frozen=True)
class InstallBackend:
    """One install backend: `available(device)`, `prepare(reg, kv, device)` -> its state for those
    destinations, `run(kind, reg, state, args, options)` one window ("install" or "gather")."""

    name: str
    available: Callable[[torch.device], bool]
    prepare: Callable[[Registration, tuple[torch.Tensor, ...], torch.device], object]
    run: Callable[[str, Registration, object, WindowArgs, RunOptions], None]
    holds_destinations: bool = False  # its state keeps views of the destinations (not only addresses)
    tables_on_device: bool = False  # its windows read the block tables on the destinations' device


_REGISTRY: dict[str, InstallBackend] = {}
AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}
_NOTICED: set[str] = set()


def register_backend(backend: InstallBackend) -> InstallBackend:
    if backend.name in _REGISTRY or backend.name == "auto":
        raise ValueError(f"install backend {backend.name!r} is registered already")
    _REGISTRY[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Forget a backend registered in code (tests). A name registered again with another backend is
    prepared afresh only after prepared.clear_cache() (the cache keys preparations by backend name)."""
    _REGISTRY.pop(name, None)


def get_backend(name: str) -> InstallBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join((*_REGISTRY, 'auto'))}") from None


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run on `device` on this machine (Triton on CPU needs TRITON_INTERPRET=1)."""
    device = torch.device(device)
    return [name for name, b in _REGISTRY.items() if b.available(device)]


def backend_available(backend: str, device: torch.device) -> bool:
    return get_backend(backend).available(torch.device(device))


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for `backend` (a name or "auto") on destinations on `device`."""
    if backend != "auto":
        if not backend_available(backend, device):  # an unknown name: get_backend's error
            raise ValueError(f"backend {backend!r} is not available for {device} on this machine")
        return backend
    order = AUTO_ORDER.get(device.type, ("torch",))
    chosen = next(b for b in order if backend_available(b, device))
    if device.type == "cpu" and chosen != "cpu" and "cpu" not in _NOTICED:
        _NOTICED.add("cpu")
        print(f"bsr: native cpu backend unavailable ({cpu_backend.load_error()}); using torch", file=sys.stderr)
    return chosen


# -- the four backends (each module imported on first use) -------------------------------------
def _descriptors(reg: Registration, kv: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    from .descriptors import descriptor_table

    return descriptor_table(reg, kv, device)


def _torch_prepare(reg: Registration, kv: tuple[torch.Tensor, ...], device: torch.device):
    from .torch_backend import DestinationRows

    return DestinationRows(reg, kv)


def _torch_run(kind: str, reg: Registration, state, a: WindowArgs, o: RunOptions) -> None:
    from contextlib import nullcontext

    from .torch_backend import gather_torch, install_torch

    with torch.cuda.stream(o.stream) if o.stream is not None else nullcontext():
        (install_torch if kind == "install" else gather_torch)(reg, a, state)


def _triton_available(device: torch.device) -> bool:
    from . import triton_backend

    return triton_backend.available(device)


def _triton_run(kind: str, reg: Registration, state, a: WindowArgs, o: RunOptions) -> None:
    from . import triton_backend

    (triton_backend.install if kind == "install" else triton_backend.gather)(reg, a, o.stream, state)


def _cuda_available(device: torch.device) -> bool:
    from . import cuda_backend

    return device.type == "cuda" and cuda_backend.available()


def _cuda_run(kind: str, reg: Registration, state, a: WindowArgs, o: RunOptions) -> None:
    from . import cuda_backend

    (cuda_backend.install if kind == "install" else cuda_backend.gather)(reg, a, o.stream, o.zero_copy, state)


def _cpu_available(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_backend.available()


register_backend(InstallBackend("torch", lambda device: True, _torch_prepare, _torch_run, holds_destinations=True))
register_backend(InstallBackend("triton", _triton_available, _descriptors, _triton_run, tables_on_device=True))
register_backend(InstallBackend("cuda", _cuda_available, _descriptors, _cuda_run, tables_on_device=True))
register_backend(InstallBackend("cpu", _cpu_available, _descriptors, cpu_backend.run))  # no adapter frame
BACKENDS = backend_names()  # the built-in four, for messages and choices
