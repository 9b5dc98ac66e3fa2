"""A filesystem-tier fetch read by the tier's native reader (fs_native.Reader): its handle, and the check of
what an ended read job left (each header against its key, the registration and the body's CRC), done by the
thread that waits for the fetch. FilesystemTier.fetch makes one per window."""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from . import fs_native
from ._common import CRC32C, crc_at
from .base import CorruptObjectError, FetchHandle, FetchTimeoutError, TierError, TierUnavailableError
from .fs_format import check_header

Dst = tuple[torch.Tensor, int]  # an object's staging view and its address


class FilesystemTier(Protocol):
    """What a check reads of the tier (filesystem.FilesystemTier; not imported: it imports this module)."""

    fingerprint: str
    chunk_bytes: int
    _fp: bytes

    def _read_into(self, key: str, dst: Dst) -> int: ...


def as_tier_error(err: BaseException) -> TierError:
    """A fetch's error as the tier reports it: a TierError as it is, anything else wrapped in one."""
    if isinstance(err, TierError):
        return err
    wrapped = TierError(f"filesystem tier: fetch failed: {err!r}")
    wrapped.__cause__ = err
    return wrapped


def check_read(tier: FilesystemTier, keys: tuple[str, ...], digests: list[bytes], dsts: list[Dst],
               job: fs_native.ReadJob) -> TierError | None:
    """The first error of an ended read job (None: every object landed whole, as its key's); a failed read
    again object by object (`tier._read_into`), which says exactly what is wrong (or finds it whole now)."""
    for i, st in enumerate(job.status.tolist()):
        try:
            if st == 0:
                algo, crc = check_header(keys[i], job.heads[i].tobytes(), digests[i], tier._fp, tier.fingerprint,
                                         tier.chunk_bytes)
                got = int(job.crcs[i]) if algo == CRC32C else crc_at(algo, dsts[i][1], tier.chunk_bytes)
                if got != crc:
                    raise CorruptObjectError(f"filesystem tier: checksum mismatch for {keys[i]}")
            elif st == fs_native.LATE:
                raise FetchTimeoutError(f"filesystem tier: deadline passed before {keys[i]} was read")
            elif st == fs_native.CANCELLED:
                raise TierUnavailableError("filesystem tier closed before the fetch completed")
            elif st != fs_native.SKIPPED:  # skipped: after an object that failed, reported before it
                tier._read_into(keys[i], dsts[i])
        except BaseException as e:  # noqa: BLE001 - the fetch's error, as the pool path reports it
            return as_tier_error(e)
    return None


class NativeFetch(FetchHandle):
    """A fetch read by the tier's native reader: complete (and settled) once its job has ended, checked
    by the thread that waits for it. Nothing completes it from outside (no set_result / set_error), so it
    holds no events of its own: its job is what it waits on."""

    def __init__(self, tier: FilesystemTier, keys: tuple[str, ...], deadline: float, job: fs_native.ReadJob,
                 digests: list[bytes], dsts: list[Dst]) -> None:
        self.keys, self.deadline, self.bytes_read, self._error = keys, deadline, 0, None
        self._tier, self._job, self._digests, self._dsts = tier, job, digests, dsts
        self._checked = False

    def set_result(self, nbytes: int) -> None:
        raise TypeError("a native fetch is completed by its read job")

    set_error = set_result

    def done(self) -> bool:
        return self._job.wait(0)

    def wait_done(self, timeout: float) -> bool:
        return self._job.wait(timeout)

    def settled(self) -> bool:
        return self._job.wait(0)

    def quiesce(self, timeout: float | None = None) -> bool:
        return self._job.wait(threading.TIMEOUT_MAX if timeout is None else timeout)

    def wait(self) -> int:
        if not self._job.wait(self.deadline - time.monotonic()):
            raise FetchTimeoutError(f"fetch of {len(self.keys)} objects missed its deadline")
        if not self._checked:
            self._error = check_read(self._tier, self.keys, self._digests, self._dsts, self._job)
            self.bytes_read = 0 if self._error else len(self.keys) * self._tier.chunk_bytes
            self._checked = True
        if self._error is not None:
            raise self._error
        return self.bytes_read
