"""Helpers shared by the tier implementations: settled handles, view checks, payload checksums."""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bsr_kernels import host_crc

from .base import CorruptObjectError, FetchHandle, TierError

log = logging.getLogger(__name__)

# How long close() waits for a worker that is running (a read, a write, a transfer) before it gives
# the worker up: a worker stuck in a system call (a hung network filesystem, a device) must not hang
# the engine's shutdown
CLOSE_TIMEOUT_S = 10.0


def shutdown_bounded(pool: ThreadPoolExecutor, what: str, timeout_s: float | None = None) -> bool:
    """Cancel `pool`'s queued work and wait at most `timeout_s` (default CLOSE_TIMEOUT_S) for its running
    work. True when every worker thread has ended; False (and one warning naming them) when some are
    still running: they are abandoned, and the caller must leave alone whatever they may still touch
    (descriptors, registered buffers, event fds)."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + (CLOSE_TIMEOUT_S if timeout_s is None else timeout_s)
    threads = list(getattr(pool, "_threads", ()))
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        log.warning("%s: %d worker(s) still running after %.1f s (%s); abandoned so that close() returns",
                    what, len(stuck), CLOSE_TIMEOUT_S if timeout_s is None else timeout_s, ", ".join(stuck))
    return not stuck


class SettledFetchHandle(FetchHandle):
    """A FetchHandle that knows when none of its reads can touch its views any more.

    `wait()` may raise FetchTimeoutError while reads are still landing; `quiesce()` returns
    as soon as the tier has stopped writing into the views (which can be before the handle
    completes, e.g. when a wrapper delays the completion but not the bytes).
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


def check_host_views(keys: Sequence[str], views: Sequence[torch.Tensor], chunk_bytes: int, what: str) -> None:
    """Each view must be a contiguous CPU uint8 tensor of exactly `chunk_bytes` elements, one per key."""
    if len(keys) != len(views):
        raise ValueError(f"{what}: {len(keys)} keys but {len(views)} views")
    for i, (k, v) in enumerate(zip(keys, views, strict=True)):
        if not isinstance(k, str):
            raise ValueError(f"{what}: key {i} is {type(k).__name__}, not str")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{what}: view {i} is {type(v).__name__}, not a torch.Tensor")
        if v.dtype != torch.uint8 or not v.is_cpu or not v.is_contiguous():
            raise ValueError(
                f"{what}: view {i} must be a contiguous CPU uint8 tensor (host staging), "
                f"got {v.dtype} on {v.device}{'' if v.is_contiguous() else ', non-contiguous'}"
            )
        if v.numel() != chunk_bytes:
            raise ValueError(f"{what}: view {i} has {v.numel():,} bytes, objects are {chunk_bytes:,} B")


def host_views(keys: Sequence[str], views: Sequence[torch.Tensor], chunk_bytes: int, what: str) -> list[np.ndarray]:
    """Check `views` against `keys` (check_host_views) and return writable numpy aliases (no copies)
    of them: reads and writes through them hit the staging bytes."""
    check_host_views(keys, views, chunk_bytes, what)
    return [v.detach().reshape(-1).numpy() for v in views]


# -- payload checksums (shared by the filesystem and Mooncake tiers) -------------------------
try:  # CRC-32C in hardware: ~6x faster than zlib.crc32 here (27 vs 4.2 GB/s), releases the GIL
    import google_crc32c as _crc32c

    HAVE_CRC32C = getattr(_crc32c, "implementation", "c") == "c"
except ImportError:  # pragma: no cover - depends on the environment
    _crc32c = None
    HAVE_CRC32C = False

CRC32 = 1
CRC32C = 2
DEFAULT_CHECKSUM = CRC32C if HAVE_CRC32C else CRC32


def _load_crc32c_lib():
    """google_crc32c's bundled libcrc32c, called through ctypes on a raw address: no copy, no
    buffer-protocol export, and ctypes releases the GIL for the call (google_crc32c.value only
    releases it for `bytes` of >= 1 MiB). None when the wheel ships no such library."""
    if _crc32c is None:
        return None
    import ctypes
    import glob

    base = os.path.dirname(os.path.dirname(_crc32c.__file__))
    for path in sorted(glob.glob(os.path.join(base, "google_crc32c.libs", "libcrc32c*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_CRC32C_AT = _load_crc32c_lib()


def crc_at(algo: int, address: int, nbytes: int) -> int:
    """Checksum of `nbytes` of host memory at `address` (a tensor's data_ptr), read in place:
    CRC-32C by the CPU library where it is built (folding with AVX-512 VPCLMULQDQ: ~2x
    google_crc32c here), else google_crc32c's own library; both release the GIL."""
    if algo == CRC32C and host_crc.available():
        return host_crc.crc32c(address, nbytes)
    if algo == CRC32C and _CRC32C_AT is not None:
        return _CRC32C_AT(0, address, nbytes)
    import ctypes

    return payload_crc(algo, memoryview((ctypes.c_char * nbytes).from_address(address)).toreadonly())


def payload_crc(algo: int, data: np.ndarray | bytes | memoryview) -> int:
    if algo == CRC32C:
        if _crc32c is None:
            raise TierError("object uses CRC-32C but google_crc32c is not installed")
        return _crc32c.value(data)
    if algo == CRC32:
        return zlib.crc32(data)
    raise CorruptObjectError(f"unknown checksum algorithm {algo}")
