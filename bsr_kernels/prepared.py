"""Destinations validated and prepared once per layout, for install_window, gather_window and WindowInstaller.

Checking a set of destinations (dtype, shape, device and strides of each tensor, no byte shared)
and building a backend's state for them (the descriptor table; the torch backend's views) costs
Python work per tensor: milliseconds for a model of a hundred tensors. Both depend only on the
registration, the backend and the destinations' layout: each tensor's address, shape, strides,
dtype and device. `prepare` keeps the last MAX_ENTRIES preparations keyed by exactly those, so a
call on destinations of an already prepared layout reads each tensor's metadata once and reuses
the rest, whatever tensor objects carry the layout. A re-allocated or resized destination (a new
address), another shape, stride, dtype or device, another registration or backend is another key.
Block tables are not part of it: each call checks the entries of its own chunks
(validate.check_block_tables).

The torch backend's state holds views of the destinations; its cache entry is emptied when a
tensor it was prepared from is freed, so the cache never keeps an engine's cache memory alive.
The other backends' state is addresses only, valid for any tensors of that layout.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from operator import attrgetter

import torch

from .backends import RunOptions, get_backend
from .registration import Registration
from .validate import DestinationLayout, WindowArgs, check_destination_tensors

MAX_ENTRIES = 8

_data_ptr, _stride = torch.Tensor.data_ptr, torch.Tensor.stride
_shape, _dtype, _device = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")


class PreparedDestinations:
    """Destinations of `reg` validated, and the state `backend` (backends.py) runs their windows with."""

    def __init__(self, reg: Registration, kv: tuple[torch.Tensor, ...], layout: DestinationLayout,
                 backend: str) -> None:
        self.reg, self.layout, self.backend = reg, layout, backend
        self.device = kv[0].device
        self._backend = get_backend(backend)
        self.state = self._backend.prepare(reg, kv, self.device)  # torch: views of the destinations; others: a table
        if self.device.type == "cuda" and not self._backend.holds_destinations:
            # a table uploaded on the current stream; windows launch on any stream later
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def holds_destinations(self) -> bool:
        """Whether the state keeps the destinations' memory alive (views, not addresses)."""
        return self._backend.holds_destinations

    def run(self, kind: str, a: WindowArgs, *, stream: torch.cuda.Stream | None, zero_copy: bool,
            cpu_threads: int) -> None:
        """One validated window (`a.kv` has this layout)."""
        if a.num_chunks:
            self._backend.run(kind, self.reg, self.state, a, RunOptions(stream, zero_copy, cpu_threads))


def layout_key(kv: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], tuple] | None:
    """(each tensor's address, then their shapes, strides, dtypes and devices); None if one is not a
    tensor. The addresses come apart so that a lookup hashes ints only and compares the rest."""
    try:
        return tuple(map(_data_ptr, kv)), (tuple(map(_shape, kv)), tuple(map(_stride, kv)),
                                           tuple(map(_dtype, kv)), tuple(map(_device, kv)))
    except (TypeError, AttributeError, RuntimeError):  # not a tensor, or one without storage
        return None


class _Slot:
    """One cache entry's preparation; emptied when a destination its state holds is freed."""

    __slots__ = ("prepared",)

    def __init__(self, prepared: PreparedDestinations) -> None:
        self.prepared: PreparedDestinations | None = prepared


def _empty(slot: _Slot, _ref: weakref.ref) -> None:  # a weakref callback: no lock, one attribute store
    slot.prepared = None


_LOCK = threading.Lock()
# (fingerprint, backend, addresses) -> (the rest of the layout, the preparation, weak refs of its tensors)
_ENTRIES: OrderedDict[tuple, tuple[tuple, _Slot, list[weakref.ref]]] = OrderedDict()


def prepare(reg: Registration, kv: tuple[torch.Tensor, ...], backend: str,
            resolve: Callable[[str, torch.device], str]) -> PreparedDestinations:
    """The destinations validated and prepared for `backend` ("auto" or a name, which
    `resolve(backend, device)` turns into the backend that runs): from the cache when this
    layout was prepared before, else checked (a ValueError naming the problem) and cached."""
    layout = layout_key(kv) if kv else None
    if layout is None:  # not tensors: the checks say which
        kv, checked = check_destination_tensors(reg, kv)
        return PreparedDestinations(reg, kv, checked, resolve(backend, kv[0].device))
    addresses, rest = layout
    key = (reg.fingerprint, resolve(backend, rest[3][0]), addresses)
    with _LOCK:
        entry = _ENTRIES.get(key)
        hit = entry[1].prepared if entry is not None and entry[0] == rest else None
        if hit is not None:
            _ENTRIES.move_to_end(key)
            return hit
    kv, checked = check_destination_tensors(reg, kv)
    prepared = PreparedDestinations(reg, kv, checked, key[1])
    slot = _Slot(prepared)
    refs = [weakref.ref(t, partial(_empty, slot)) for t in kv] if prepared.holds_destinations else []
    with _LOCK:
        _ENTRIES[key] = (rest, slot, refs)
        _ENTRIES.move_to_end(key)
        while len(_ENTRIES) > MAX_ENTRIES:
            _ENTRIES.popitem(last=False)
    return prepared


def cached_entries() -> int:
    """How many prepared layouts the cache holds (emptied ones included until replaced)."""
    with _LOCK:
        return len(_ENTRIES)


def clear_cache() -> None:
    with _LOCK:
        _ENTRIES.clear()
