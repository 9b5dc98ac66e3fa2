"""The filesystem tier's object names and file format.

File names
    `<root>/ab/cd/<sha256(key) hex>.bsr`, where `ab`, `cd` are the first two byte pairs of the
    hex digest. A key is never used as a path: whatever it contains ("../", "/", NUL, 10 kB of
    text), it becomes 64 hex digits under two hex fan-out directories.

File format (little endian), 96-byte header then the payload:

    off  size  field
      0     4  magic b"BSR1"
      4     2  header version (1)
      6     2  payload checksum algorithm: 1 = CRC-32 (zlib), 2 = CRC-32C (Castagnoli)
      8     4  header size (96)
     12     4  CRC-32 (zlib) of the 96 header bytes with this field zeroed
     16     8  payload length (= chunk_bytes)
     24     4  payload checksum
     28     4  reserved (0)
     32    32  registration fingerprint (32 ASCII hex chars; see `fingerprint_bytes`)
     64    32  sha256 of the key (detects a misplaced / renamed file)
     96     -  payload, exactly chunk_bytes bytes
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

from .base import CorruptObjectError

MAGIC = b"BSR1"
HEADER_VERSION = 1
HEADER_STRUCT = struct.Struct("<4sHHIIQII32s32s")
HEADER_SIZE = HEADER_STRUCT.size
assert HEADER_SIZE == 96
_HEADER_CRC_OFFSET = 12
SUFFIX = ".bsr"
ENV_LOAD_CONCURRENCY = "LMCACHE_FS_LOAD_CONCURRENCY"

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | O_CLOEXEC  # NONBLOCK: a FIFO must not hang us
TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_CLOEXEC


def key_digest(key: str) -> bytes:
    """sha256 of the key's UTF-8 bytes (lone surrogates pass through, so any str maps)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def object_relpath(key: str) -> str:
    """The object's path relative to the root: `ab/cd/<64 hex>.bsr`."""
    return digest_relpath(key_digest(key))


def digest_relpath(digest: bytes) -> str:
    """The path relative to the root of the object whose key has this digest (key_digest)."""
    h = digest.hex()
    return f"{h[0:2]}/{h[2:4]}/{h}{SUFFIX}"


def fingerprint_bytes(fingerprint: str) -> bytes:
    """A registration fingerprint is 32 hex chars (Registration.fingerprint). Any other ASCII
    string of at most 32 chars is stored NUL padded; anything else is replaced by the first 32
    hex chars of its sha256, so every fingerprint has a fixed 32-byte form."""
    try:
        b = fingerprint.encode("ascii")
    except UnicodeEncodeError:
        b = None
    if b is None or len(b) > 32 or b"\0" in b:
        return hashlib.sha256(fingerprint.encode("utf-8", "surrogatepass")).hexdigest()[:32].encode()
    return b.ljust(32, b"\0")


def pack_header(fingerprint: bytes, digest: bytes, length: int, algo: int, crc: int) -> bytes:
    h = bytearray(HEADER_STRUCT.pack(MAGIC, HEADER_VERSION, algo, HEADER_SIZE, 0, length, crc, 0, fingerprint, digest))
    struct.pack_into("<I", h, _HEADER_CRC_OFFSET, zlib.crc32(h))
    return bytes(h)


def io_full(fn, fd: int, bufs: list, offset: int) -> int:
    """preadv/pwritev until every buffer is done or EOF; returns the bytes moved."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = 0
    while views:
        n = fn(fd, views, offset)
        if n <= 0:
            break
        total += n
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def check_header(key: str, header: bytes, digest: bytes, fp_bytes: bytes, fingerprint: str,
             chunk_bytes: int) -> tuple[int, int]:
    """(checksum algorithm, payload checksum) of a header that belongs to `key` under this
    registration and chunk size; CorruptObjectError naming what is wrong otherwise."""
    magic, version, algo, hsize, hcrc, length, crc, _, fp, kd = HEADER_STRUCT.unpack(header)
    if magic != MAGIC:
        raise CorruptObjectError(f"filesystem tier: object {key} has bad magic {magic!r}")
    zeroed = header[:_HEADER_CRC_OFFSET] + bytes(4) + header[_HEADER_CRC_OFFSET + 4 :]
    if zlib.crc32(zeroed) != hcrc:
        raise CorruptObjectError(f"filesystem tier: header checksum mismatch for {key}")
    if version != HEADER_VERSION or hsize != HEADER_SIZE:
        raise CorruptObjectError(
            f"filesystem tier: object {key} has header version {version} size {hsize}, "
            f"expected {HEADER_VERSION}/{HEADER_SIZE}"
        )
    if fp != fp_bytes:
        raise CorruptObjectError(
            f"filesystem tier: registration mismatch for {key}: written under "
            f"{fp.rstrip(bytes(1)).decode('ascii', 'replace')}, this tier is {fingerprint}"
        )
    if length != chunk_bytes:
        raise CorruptObjectError(
            f"filesystem tier: object {key} declares {length:,} B, expected {chunk_bytes:,}"
        )
    if kd != digest:
        raise CorruptObjectError(f"filesystem tier: object file for {key} holds another key (misplaced file)")
    return algo, crc


def bad_size_error(fd: int, key: str, size: int, fp_bytes: bytes, fingerprint: str,
                   chunk_bytes: int) -> CorruptObjectError:
    """The error for an object file of `size` bytes (not HEADER_SIZE + chunk_bytes) open at `fd`:
    a registration mismatch when its header says so (another registration's chunk size), else
    truncated / trailing bytes."""
    head = os.pread(fd, HEADER_SIZE, 0) if size >= HEADER_SIZE else b""
    if len(head) == HEADER_SIZE and head[:4] == MAGIC:
        fp = HEADER_STRUCT.unpack(head)[8]
        if fp != fp_bytes:
            return CorruptObjectError(
                f"filesystem tier: registration mismatch for {key}: written under "
                f"{fp.rstrip(bytes(1)).decode('ascii', 'replace')}, this tier is {fingerprint}"
            )
    expected = HEADER_SIZE + chunk_bytes
    return CorruptObjectError(
        f"filesystem tier: object {key} has {size:,} B, expected {expected:,} "
        f"({'truncated' if size < expected else 'trailing bytes'})"
    )
