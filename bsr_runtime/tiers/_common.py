"""Helpers shared by the tier implementations: view checks and delayed completion (faults)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .base import FetchHandle


class SettledFetchHandle(FetchHandle):
    """A FetchHandle that knows when none of its reads can touch its views any more.

    `wait()` may raise FetchTimeoutError while reads are still landing; `quiesce()` returns
    as soon as the tier has stopped writing into the views (which can be before the handle
    completes: under FaultPlan.delay_s the completion itself is late, the bytes are not).
    """

    def __init__(self, keys: tuple[str, ...], deadline: float) -> None:
        super().__init__(keys, deadline)
        self._settled = threading.Event()

    def mark_settled(self) -> None:
        self._settled.set()

    def settled(self) -> bool:
        return self._settled.is_set()

    def quiesce(self, timeout: float | None = None) -> bool:
        return self._settled.wait(timeout)


def host_views(keys: Sequence[str], views: Sequence[torch.Tensor], chunk_bytes: int, what: str) -> list[np.ndarray]:
    """Check `views` against `keys` and return writable numpy aliases (no copies) of them.

    Each view must be a contiguous CPU uint8 tensor of exactly `chunk_bytes` elements; the
    numpy array shares its memory, so reads and writes through it hit the staging bytes.
    """
    if len(keys) != len(views):
        raise ValueError(f"{what}: {len(keys)} keys but {len(views)} views")
    out = []
    for i, (k, v) in enumerate(zip(keys, views, strict=True)):
        if not isinstance(k, str):
            raise ValueError(f"{what}: key {i} is {type(k).__name__}, not str")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{what}: view {i} is {type(v).__name__}, not a torch.Tensor")
        if v.dtype != torch.uint8 or v.device.type != "cpu" or not v.is_contiguous():
            raise ValueError(
                f"{what}: view {i} must be a contiguous CPU uint8 tensor (host staging), "
                f"got {v.dtype} on {v.device}{'' if v.is_contiguous() else ', non-contiguous'}"
            )
        if v.numel() != chunk_bytes:
            raise ValueError(f"{what}: view {i} has {v.numel():,} bytes, objects are {chunk_bytes:,} B")
        out.append(v.detach().reshape(-1).numpy())
    return out


class DelayedCompletions:
    """Runs completion callbacks `delay` seconds later (the FaultPlan.delay_s fault).

    Each pending completion is one short-lived timer thread; `close()` cancels every pending
    one (running its `on_cancel` instead) and joins the timer threads, so none outlive the tier.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[threading.Timer, Callable[[], None]] = {}
        self._timers: set[threading.Timer] = set()  # started and not yet finished
        self._closed = False

    def schedule(self, delay: float, fn: Callable[[], None], on_cancel: Callable[[], None]) -> None:
        if delay <= 0:
            fn()
            return
        timer = threading.Timer(delay, lambda: self._fire(timer, fn))
        timer.daemon = True
        with self._lock:
            if self._closed:
                cancelled = True
            else:
                cancelled = False
                self._pending[timer] = on_cancel
                self._timers.add(timer)
                timer.start()
        if cancelled:
            on_cancel()

    def _fire(self, timer: threading.Timer, fn: Callable[[], None]) -> None:
        try:
            with self._lock:
                if self._pending.pop(timer, None) is None:
                    return  # cancelled by close()
            fn()
        finally:
            with self._lock:
                self._timers.discard(timer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending.items())
            self._pending.clear()
            timers = list(self._timers)
        for timer, on_cancel in pending:
            timer.cancel()
            on_cancel()
        for timer in timers:
            if timer is not threading.current_thread():
                timer.join()
        with self._lock:
            self._timers.difference_update(timers)
