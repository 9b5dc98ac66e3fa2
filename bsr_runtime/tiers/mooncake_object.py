"""The Mooncake object format (shared by MooncakeTier and the LMCache Mooncake L2 plugin) and the
registered host buffers the Mooncake clients read headers into and stage puts from.

One chunk is one store object: a 128-byte header, then the payload (little endian):

    off  size  field
      0     4  magic b"BSRO"
      4     2  format version (1)
      6     2  payload checksum algorithm: 1 = CRC-32 (zlib), 2 = CRC-32C (Castagnoli)
      8     4  header size (128)
     12     4  reserved (0)
     16     8  payload length
     24    32  registration fingerprint (32-byte form, as in the filesystem tier)
     56    32  sha256 of the object's key (the store name it was written under)
     88    32  tenant (32-byte form of the Mooncake tenant id)
    120     4  reserved (0)
    124     4  payload checksum

There is no header checksum: a reader compares every header byte except the algorithm and the
payload checksum with what it expects for that key, tenant, registration and length, so any
damaged, misplaced (another key's), foreign (another tenant's or registration's) or stale header
is a mismatch. A fetch reads header and payload by one transfer per object, the payload exactly
in the caller's view (tiers/mooncake_reads.py).

The old two-key format (payload-only objects of exactly chunk_bytes plus a `key + ".meta"`
record, magic b"BSRM") carried no key and is refused with a CorruptObjectError naming it; it is
never read or migrated.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from bsr_kernels import host_crc

from ._common import CRC32, CRC32C, DEFAULT_CHECKSUM, crc_at
from .base import CorruptObjectError
from .fs_format import fingerprint_bytes as _fingerprint_bytes

MAGIC = b"BSRO"
VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<4sHHII Q 32s32s32s II".replace(" ", ""))
assert _HEADER.size == HEADER_SIZE
_CRC_OFF = 124
_ALGO = slice(6, 8)
_LENGTH = slice(16, 24)
_FP = slice(24, 56)
_DIGEST = slice(56, 88)
_TENANT = slice(88, 120)
LEGACY_META_SUFFIX = ".meta"
LEGACY_FORMAT = "the old two-key format (payload object + '.meta' record, BSRM v1/v2)"


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def fixed32(text: str) -> bytes:
    """The 32-byte form of a fingerprint or tenant id (NUL padded, or a sha256 prefix)."""
    return _fingerprint_bytes(text)


class ObjectCodec:
    """Packs headers for puts and checks landed headers + payloads for one (registration, tenant)."""

    def __init__(self, fingerprint: str, tenant: str, algo: int = DEFAULT_CHECKSUM) -> None:
        self.fingerprint = fingerprint
        self.tenant = tenant
        self.algo = algo
        self._fp = fixed32(fingerprint)
        self._tenant = fixed32(tenant)
        tmpl = _HEADER.pack(MAGIC, VERSION, algo, HEADER_SIZE, 0, 0, self._fp, bytes(32), self._tenant, 0, 0)
        self._template = np.frombuffer(tmpl[:_CRC_OFF], dtype=np.uint8)

    def pack(self, key: str, length: int, crc: int) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.algo, HEADER_SIZE, 0, length, self._fp, key_digest(key),
                            self._tenant, 0, crc)

    def write_header(self, row: torch.Tensor, key: str, length: int) -> None:
        """Fill `row` (HEADER_SIZE + length contiguous bytes, payload already in place) with the header."""
        crc = crc_at(self.algo, row.data_ptr() + HEADER_SIZE, length)
        row[:HEADER_SIZE].numpy()[:] = np.frombuffer(self.pack(key, length, crc), dtype=np.uint8)

    def expected(self, keys: Sequence[str], lengths: Sequence[int]) -> np.ndarray:
        n = len(keys)
        exp = np.empty((n, _CRC_OFF), dtype=np.uint8)
        exp[:] = self._template
        exp[:, _DIGEST] = np.frombuffer(b"".join(key_digest(k) for k in keys), dtype=np.uint8).reshape(n, 32)
        exp[:, _LENGTH] = np.asarray(lengths, dtype="<u8").view(np.uint8).reshape(n, 8)
        return exp

    def problems(self, keys: Sequence[str], headers: np.ndarray, ptrs: Sequence[int], lengths: Sequence[int],
                 verify: bool = True, first_only: bool = True, landed_crcs: np.ndarray | None = None) -> dict[int, str]:
        """{row: reason} for every object that must not be used (headers: (n, HEADER_SIZE) uint8;
        ptrs/lengths: where each payload landed). Empty when all are good. Headers are checked in
        one vectorized compare; payload checksums are computed in place (no copy, GIL released),
        or taken from `landed_crcs` (CRC-32C of each payload as a checksumming copy landed it)."""
        n = len(keys)
        mism = headers[:, :_CRC_OFF] != self.expected(keys, lengths)
        mism[:, _ALGO] = False
        bad_header = mism.any(axis=1)
        algos = np.ascontiguousarray(headers[:, _ALGO]).view("<u2").reshape(n)
        stored = np.ascontiguousarray(headers[:, _CRC_OFF:]).view("<u4").reshape(n)
        bad_algo = (algos != CRC32) & (algos != CRC32C)  # two compares: np.isin costs tens of us on a few rows
        bad_crc = np.zeros(n, dtype=bool)
        if verify:
            usable = ~(bad_header | bad_algo)
            bad_crc = usable & (payload_crcs(algos, ptrs, lengths, usable, landed_crcs) != stored)
        out: dict[int, str] = {}
        for i in np.flatnonzero(bad_header | bad_algo | bad_crc).tolist():
            if bad_header[i]:
                out[i] = self.diagnose(keys[i], headers[i], lengths[i])
            elif bad_algo[i]:
                out[i] = f"{keys[i]}: unknown checksum algorithm {int(algos[i])}"
            else:
                out[i] = f"{keys[i]}: payload checksum (crc32c/crc32) mismatch"
            if first_only:
                break
        return out

    def check(self, keys: Sequence[str], headers: np.ndarray, ptrs: Sequence[int], lengths: Sequence[int],
              verify: bool = True, landed_crcs: np.ndarray | None = None) -> None:
        """Raise CorruptObjectError for the first object that must not be used."""
        bad = self.problems(keys, headers, ptrs, lengths, verify, landed_crcs=landed_crcs)
        if bad:
            raise CorruptObjectError(next(iter(bad.values())))

    def diagnose(self, key: str, header: np.ndarray, length: int) -> str:
        h = header.tobytes()
        magic, version, _algo, hsize, _r0, plen, fp, digest, tenant, _r1, _crc = _HEADER.unpack(h)
        if magic != MAGIC:
            return f"{key}: not a BSR Mooncake object (magic {magic!r}); {LEGACY_FORMAT} is not read"
        if version != VERSION or hsize != HEADER_SIZE:
            return f"{key}: object format version {version} header {hsize} B, expected {VERSION}/{HEADER_SIZE}"
        if fp != self._fp:
            return (f"{key}: written under registration fingerprint {_text(fp)}, "
                    f"this reader is {_text(self._fp)}")
        if tenant != self._tenant:
            return f"{key}: written by tenant {_text(tenant)}, this reader is tenant {_text(self._tenant)}"
        if digest != key_digest(key):
            return f"{key}: the object under this name holds another key's data (key digest {digest.hex()[:16]})"
        if plen != length:
            return f"{key}: header declares {plen:,} B of payload, expected {length:,}"
        return f"{key}: damaged header"


def payload_crcs(algos: np.ndarray, ptrs: Sequence[int], lengths: Sequence[int], rows: np.ndarray,
                 landed: np.ndarray | None = None) -> np.ndarray:
    """The checksum of each payload in `rows` (a bool mask; others are 0), by its header's algorithm.
    CRC-32C rows come from `landed` when given, else from one native call over all of them (split
    over the CPU library's threads) when the payloads have one length, else one call each."""
    out = np.zeros(len(algos), dtype=np.uint32)
    c32c = rows & (algos == CRC32C)
    idx = np.flatnonzero(c32c)
    if landed is not None:
        out[idx] = landed[idx]
    elif len(idx) > 1 and host_crc.available() and len({lengths[i] for i in idx.tolist()}) == 1:
        out[idx] = host_crc.crc32c_many([ptrs[i] for i in idx.tolist()], lengths[int(idx[0])])
    else:
        for i in idx.tolist():
            out[i] = crc_at(CRC32C, ptrs[i], lengths[i])
    for i in np.flatnonzero(rows & (algos == CRC32)).tolist():
        out[i] = crc_at(CRC32, ptrs[i], lengths[i])
    return out


def _text(b: bytes) -> str:
    return b.rstrip(b"\0").decode("ascii", "replace")


def size_problem(key: str, size: int, payload_bytes: int, has_legacy_record: bool) -> CorruptObjectError:
    """The error for an object whose stored size is not HEADER_SIZE + payload_bytes."""
    if size == payload_bytes:
        record = "with" if has_legacy_record else "without"
        return CorruptObjectError(
            f"{key}: a payload-only object of {size:,} B {record} a '.meta' record: {LEGACY_FORMAT}; "
            f"this tier reads only the in-object header format BSRO v{VERSION} (re-store the prefix)"
        )
    return CorruptObjectError(f"{key}: object of {size:,} B, expected {HEADER_SIZE + payload_bytes:,} B "
                              f"({HEADER_SIZE} B header + {payload_bytes:,} B payload)")


class RegisteredBuffers:
    """Host buffers registered with one Mooncake client and reused (header areas, put staging).

    acquire(nbytes) hands out a free buffer of at least nbytes, allocating and registering one
    (rounded up to a power of two, >= 64 KiB) only when none fits; it then drops the free ones
    (all smaller). At most (concurrent users) buffers exist at a time.
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None]) -> None:
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._busy: dict[int, torch.Tensor] = {}

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:  # (tensors compare elementwise: lists are filtered by identity, never .remove)
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not buf]
            else:
                for small in self._free:
                    self._unregister(small.data_ptr())
                self._free = []
                size = max(64 << 10, 1 << max(0, nbytes - 1).bit_length())
                buf = torch.empty(size, dtype=torch.uint8)
                self._register(buf.data_ptr(), size)
            self._busy[buf.data_ptr()] = buf
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._busy.pop(buf.data_ptr(), None) is not None:
                self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            bufs = self._free + list(self._busy.values())
            self._free, self._busy = [], {}
        for b in bufs:
            try:
                self._unregister(b.data_ptr())
            except Exception:  # noqa: BLE001 - best effort at close
                pass

