"""CRC-32C of host memory, and a copy that checksums what it lands (csrc/bsr_crc32c.c, in libbsr_cpu.so).

The tiers verify every object's payload against the CRC-32C in its header. These calls take raw
addresses (a tensor's data_ptr, a numpy array's ctypes.data), so nothing is copied or exported,
and ctypes releases the GIL for the call:
- crc32c(address, nbytes): one buffer (AVX-512 VPCLMULQDQ folding where the CPU has it, else
  the SSE4.2 instruction in three streams);
- crc32c_many(ptrs, nbytes): many equal-size buffers in one call, split over the library's pool;
- crc32c_extend_many(crcs, ptrs, nbytes): continue many CRCs over nbytes more each, in one call
  (a CRC's continuation is linear in the CRC it continues: a 32x32 bit matrix per length), so
  no thread makes one GIL-releasing call per object (each can wait a switch interval, 5 ms, to
  get the GIL back while another thread runs Python);
- copy_crc32c(src, head_dst, body_dst, head_bytes, body_bytes): per object, copy a header and a
  body to separate places and checksum the body piece by piece as it lands (while it is in cache),
  one pass over memory instead of a copy pass plus a checksum pass.
`available()` is False when the CPU library is not built; callers then use google_crc32c.
BSR_CRC_NO_FOLD=1 (read when the library first computes a CRC) keeps it on the crc32 loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from . import cpu_backend


def available() -> bool:
    return cpu_backend.library() is not None


def implementation() -> str:
    """"fold" (AVX-512 carry-less multiply folding, from 1 KiB up), "crc32" (the SSE4.2
    instruction in three streams), "table" (~10x slower) or "none" (no library)."""
    lib = cpu_backend.library()
    if lib is None:
        return "none"
    return {0: "table", 1: "crc32", 2: "fold"}[int(lib.bsr_crc32c_hardware())]


def hardware() -> bool:
    """True when the library uses the CPU's CRC-32C instructions (not the table)."""
    return implementation() in ("crc32", "fold")


def _lib():
    lib = cpu_backend.library()
    if lib is None:
        raise RuntimeError(f"CRC-32C library unavailable: {cpu_backend.load_error()}")
    return lib


def crc32c(address: int, nbytes: int, crc: int = 0) -> int:
    """CRC-32C of `nbytes` at `address`, continuing `crc` (0 to start)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return int(_lib().bsr_crc32c(crc, address, nbytes))


def _addresses(ptrs: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ptrs, dtype=np.int64))


def crc32c_many(ptrs: Sequence[int] | np.ndarray, nbytes: int, threads: int = 0) -> np.ndarray:
    """uint32 CRC-32C of `nbytes` at each address (threads: 0 = the library's choice)."""
    p = _addresses(ptrs)
    out = np.empty(len(p), dtype=np.uint32)
    if _lib().bsr_crc32c_many(len(p), p.ctypes.data, nbytes, out.ctypes.data, threads) != 0:
        raise ValueError(f"bsr_crc32c_many: invalid arguments (n={len(p)}, nbytes={nbytes})")
    return out


@lru_cache(maxsize=8)
def _shift_columns(nbytes: int) -> np.ndarray:
    """Column k: what continuing over nbytes does to bit k of a CRC (the linear part; the rest is
    the CRC of the nbytes themselves, from 0)."""
    zeros = np.zeros(max(1, nbytes), dtype=np.uint8)
    p = zeros.ctypes.data
    base = crc32c(p, nbytes, 0)
    return np.array([crc32c(p, nbytes, 1 << k) ^ base for k in range(32)], dtype=np.uint32)


def crc32c_extend_many(crcs: np.ndarray, ptrs: Sequence[int] | np.ndarray, nbytes: int) -> np.ndarray:
    """For each i, crc32c(ptrs[i], nbytes, crcs[i]): the CRCs of buffers A_i continued over the
    nbytes at ptrs[i], with one native call (the CRCs of the nbytes from 0) and numpy."""
    crcs = np.asarray(crcs, dtype=np.uint32)
    if len(crcs) != len(ptrs):
        raise ValueError(f"crc32c_extend_many: {len(crcs)} CRCs but {len(ptrs)} buffers")
    out = crc32c_many(ptrs, nbytes)
    cols = _shift_columns(nbytes)
    for k in range(32):
        out ^= np.where((crcs >> np.uint32(k)) & np.uint32(1), cols[k], np.uint32(0))
    return out


def copy_crc32c(src: Sequence[int] | np.ndarray, head_dst: Sequence[int] | np.ndarray | None,
                body_dst: Sequence[int] | np.ndarray, head_bytes: int, body_bytes: int,
                threads: int = 0) -> np.ndarray:
    """For each i: head_bytes from src[i] to head_dst[i], the next body_bytes to body_dst[i];
    returns the uint32 CRC-32C of each body as it landed. The caller guarantees the ranges are
    valid, writable where written, and do not overlap."""
    s, b = _addresses(src), _addresses(body_dst)
    h = _addresses(head_dst) if head_dst is not None else None
    if len(b) != len(s) or (h is not None and len(h) != len(s)):
        raise ValueError(f"copy_crc32c: {len(s)} sources but {len(b)} body / "
                         f"{'-' if h is None else len(h)} header destinations")
    if head_bytes > 0 and h is None:
        raise ValueError("copy_crc32c: head_bytes > 0 needs header destinations")
    out = np.empty(len(s), dtype=np.uint32)
    rc = _lib().bsr_copy_crc32c(len(s), s.ctypes.data, None if h is None else h.ctypes.data, b.ctypes.data,
                                head_bytes, body_bytes, out.ctypes.data, threads)
    if rc != 0:
        raise ValueError(f"bsr_copy_crc32c: invalid arguments (n={len(s)}, head={head_bytes}, body={body_bytes})")
    return out

