"""MemoryTier: a dict of bytes, the harness's tier for unit tests (no files, no processes).

It is not a cache and not a product tier: it holds every object it is given in Python
memory, without bound. It exists so runtime tests can exercise the tier contract (and, wrapped in the harness's
FaultyTier, every fault) without files, daemons or a network.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bsr_runtime.tiers._common import SettledFetchHandle, host_views
from bsr_runtime.tiers.base import (
    CorruptObjectError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)


@dataclass(frozen=True)
class _Stored:
    fingerprint: str
    crc: int
    data: bytes


class MemoryTier(Tier):
    """A dict of bytes, for unit tests only (see the module docstring).

    `fetch` copies synchronously into the views before it returns, then hands back an already
    completed FetchHandle. Each object carries the
    crc32 and registration fingerprint it was stored with; both are checked on fetch.
    Pass the same `store` dict to several tiers to model one store seen by several ranks or
    registrations.
    """

    name = "memory"

    def __init__(self, chunk_bytes: int, fingerprint: str, store: dict | None = None) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        super().__init__(chunk_bytes, fingerprint)
        self._store: dict[str, _Stored] = {} if store is None else store
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._store)

    def _check(self, op: str) -> None:
        if self._closed:
            raise TierUnavailableError(f"memory tier: {op} after close()")

    def probe(self, keys: Sequence[str]) -> list[bool]:
        self._check("probe")
        with self._lock:
            return [k in self._store for k in keys]

    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> SettledFetchHandle:
        self._check("fetch")
        keys = tuple(keys)
        arrays = host_views(keys, views, self.chunk_bytes, "memory tier fetch")
        handle = SettledFetchHandle(keys, deadline)
        nbytes = 0
        try:
            for key, arr in zip(keys, arrays, strict=True):
                with self._lock:
                    obj = self._store.get(key)
                if obj is None:
                    raise MissingObjectError(f"memory tier: object {key} is not present")
                if obj.fingerprint != self.fingerprint:
                    raise CorruptObjectError(
                        f"memory tier: registration mismatch for {key}: stored under {obj.fingerprint}, "
                        f"this tier is {self.fingerprint}"
                    )
                if len(obj.data) != self.chunk_bytes:
                    raise CorruptObjectError(
                        f"memory tier: object {key} has {len(obj.data):,} B, expected {self.chunk_bytes:,}"
                    )
                arr[:] = np.frombuffer(obj.data, dtype=np.uint8)
                if zlib.crc32(arr) != obj.crc:
                    raise CorruptObjectError(f"memory tier: checksum mismatch for {key}")
                nbytes += self.chunk_bytes
        except TierError as e:
            handle.mark_settled()
            handle.set_error(e)
            return handle
        handle.mark_settled()  # every byte landed before fetch returns
        handle.set_result(nbytes)
        return handle

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        self._check("put")
        keys = list(keys)
        arrays = host_views(keys, views, self.chunk_bytes, "memory tier put")
        items = {k: _Stored(self.fingerprint, zlib.crc32(a), a.tobytes()) for k, a in zip(keys, arrays, strict=True)}
        with self._lock:
            self._store.update(items)

    def delete(self, keys: Sequence[str]) -> None:
        self._check("delete")
        with self._lock:
            for k in keys:
                self._store.pop(k, None)

    def close(self) -> None:
        self._closed = True
