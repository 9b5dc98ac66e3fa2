"""The tier interface: probe keys, fetch keys into staging views (async, with a deadline), put.

A tier stores opaque objects of exactly `chunk_bytes` bytes under string keys (see keys.py).
Fetches land directly in the caller's staging views; the tier never allocates a second copy
of a window. Every failure surfaces as a `TierError` subclass so the runtime can fail closed.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..keys import PrefixKeys
    from ..window_loop import InPlaceSource

# Scratch a restore's staging leaves before each chunk (StagingArena headroom): a tier whose objects
# carry a header of up to this size (Mooncake's is 128 B) lands each object whole, by one transfer.
FETCH_HEADROOM = 128


class TierError(RuntimeError):
    """Any failure of a tier operation (the restore fails closed on it)."""


class MissingObjectError(TierError):
    """A key that was expected is not present (evicted after the probe, never written)."""


class HostLostError(MissingObjectError):
    """The store host holding an object does not answer (killed, or gone from the network): the object
    cannot be had from there. A miss of that object, not of the whole store: the tier stays in use."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class CorruptObjectError(TierError):
    """An object failed its integrity check (length, registration, checksum)."""


class FetchTimeoutError(TierError):
    """A fetch did not complete before its deadline."""


class TierUnavailableError(TierError):
    """The store cannot be reached."""


@dataclass
class FetchHandle:
    """An in-flight fetch. `wait()` returns when every key is present in its view, or raises."""

    keys: tuple[str, ...]
    deadline: float  # time.monotonic() seconds
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    bytes_read: int = 0

    def set_result(self, nbytes: int) -> None:
        self.bytes_read = nbytes
        self._done.set()

    def set_error(self, err: BaseException) -> None:
        self._error = err
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        """True once the fetch is complete (`wait()` then returns or raises at once), within `timeout`."""
        return self._done.wait(timeout)

    def quiesce(self, timeout: float | None = None) -> bool:
        """Wait (ignoring the deadline) until the tier stopped writing into the views.
        Tiers complete a handle only when none of its reads can still land."""
        return self._done.wait(timeout)

    def wait(self) -> int:
        import time

        remaining = self.deadline - time.monotonic()
        if not self._done.wait(max(0.0, remaining)):
            raise FetchTimeoutError(f"fetch of {len(self.keys)} objects missed its deadline")
        if self._error is not None:
            if isinstance(self._error, TierError):
                raise self._error
            raise TierError(f"fetch failed: {self._error}") from self._error
        return self.bytes_read


def put_replacing(tier: Tier, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
    """`tier.put`, such that whatever was stored under the keys is replaced: a tier that cannot overwrite
    (`overwrites` False) deletes the keys first. The store path writes through this."""
    if not tier.overwrites:
        tier.delete(keys)
    tier.put(keys, views, headroom=headroom)


# A tier whose fetch keeps the host's cores busy (Mooncake over tcp: socket copies, the transfer engine's threads,
# a store host on the same machine; LMCache: its per-request work) competes with an install overlapped with the
# next fetch, and depth 2 halves each window (twice the windows, each with its fixed cost): it pays only where a
# half window is large enough for its fixed costs to vanish. Measured on 2 vCPUs, dsv4-flash, one run of 5 each:
# `bsr wlaw --tier mooncake --depth {1,2}`: depth 2 slower with half windows of 4 MB (1/16 at W = 8: 1.40 s
# against 1.06 s; 1/64 at W = 32) and 8 MB (1/16, W = 16: 1.14 against 1.01 s); from 16 MB mostly as fast or
# faster (1/16, W = 32: 0.93 against 0.97 s; 1/4, W = 8 and 16: 0.75 / 0.70 against 0.89 / 0.88 s; 1/16, W = 64:
# 0.98 both; but 1/4, W = 32: 0.87 against 0.84 s). `bsr wlaw --tier lmcache-mooncake --scale 0.0625 --depth
# {1,2}`: W = 8 and 16 1.60 / 1.21 s against 1.18 / 1.10 s, W = 32 and 64 0.91 / 0.93 s against 1.09 / 1.05 s.
# Runs of the same command differ by up to a fifth here.
DEPTH2_HALF_WINDOW_BYTES = 16 << 20


def depth_by_window(window_bytes: int) -> int:
    """Depth 2 from half windows of DEPTH2_HALF_WINDOW_BYTES up (any W >= 3 of DeepSeek-V4's real 16 MB chunks),
    else 1: for tiers whose fetch competes with the install for the cores."""
    return 2 if window_bytes // 2 >= DEPTH2_HALF_WINDOW_BYTES else 1


class Tier(ABC):
    """One storage tier. Implementations: FilesystemTier, MooncakeTier, the LMCache tiers (the harness: MemoryTier)."""

    name: str = "tier"

    def __init__(self, chunk_bytes: int, fingerprint: str) -> None:
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fingerprint

    @abstractmethod
    def probe(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are present. Holds nothing: no staging, no locks after return."""

    @abstractmethod
    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> FetchHandle:
        """Start reading each key's object into the matching view (uint8, chunk_bytes each).
        `headroom`: the bytes before each view are scratch the tier may overwrite until the handle
        completes (a StagingArena with headroom; FETCH_HEADROOM fits a Mooncake object's header)."""

    # Whether put() replaces an object already present under a key (intact, damaged, another
    # writer's): the repair of a damaged object (the overwrite-save after a failed load) relies on it.
    # A tier whose store keeps what is there sets this False, and `put_replacing` deletes first.
    overwrites: bool = True

    @abstractmethod
    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        """Store each view (uint8, chunk_bytes) under its key, atomically, replacing an object already
        there (unless `overwrites` is False: see put_replacing). A put that did not store every key
        raises TierError, never returns. `headroom`: the bytes before each view are scratch the tier may
        overwrite (never the views)."""

    def preferred_pipeline_depth(self, window_bytes: int) -> int:
        """The pipeline depth a caller that does not choose one restores windows of `window_bytes` (W * c)
        from this tier at. 2 overlaps window j+1's fetch with window j's install, which pays where the fetch
        leaves the host's cores to the install (DMA, one page-cache reader thread); 1 where the fetch itself
        keeps the cores busy (MooncakeTier over tcp, LMCache: below windows of 32 MiB, depth_by_window)."""
        return 2

    def window_source(self, keys: PrefixKeys, timeout_s: float) -> InPlaceSource | None:
        """A WindowSource whose windows the restore installs from where this tier holds the bytes
        (LMCache's L1), measuring what it pins (window_loop.InPlaceSource); or None (the default):
        the restore fetches each window into its staging (tier_source.TierSource). `timeout_s`: per
        window, from its fetch. Called once per restore."""
        return None

    def delete(self, keys: Sequence[str]) -> None:  # pragma: no cover - optional
        raise NotImplementedError

    def register_staging(self, buffer: torch.Tensor) -> None:
        """Called once with a staging arena's buffer (Mooncake registers it for zero copy)."""

    def unregister_staging(self, buffer: torch.Tensor) -> None:
        """Undo register_staging (the whole-plan path registers a fresh buffer per restore)."""

    def close(self) -> None:
        """Release connections, threads and registrations."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

