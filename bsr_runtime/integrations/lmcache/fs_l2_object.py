"""The object file format of the FS L2 plugin (fs_l2.py): a 64-byte header, then the payload (the L1 object's
bytes). Little endian:

    off  size  field
      0     4  magic b"BSRL"
      4     2  format version (1)
      6     2  payload checksum algorithm: 1 = CRC-32 (zlib), 2 = CRC-32C (Castagnoli)
      8     4  header size (64)
     12     4  reserved (0)
     16     8  payload length
     24    32  sha256 of the ObjectKey (chunk_hash, model_name, kv_rank, object_group_id, cache_salt)
     56     4  reserved (0)
     60     4  payload checksum

A reader compares every header byte but the algorithm and the checksum with what it expects for the
key and length, then checks the payload's checksum in place: a damaged file, another key's file (two
swapped, another tenant's copied under this tenant's key) or LMCache's headerless format is refused.
"""

from __future__ import annotations

import hashlib
import struct

from lmcache.v1.distributed.api import ObjectKey

from bsr_runtime.tiers._common import CRC32, CRC32C, DEFAULT_CHECKSUM, crc_at

MAGIC = b"BSRL"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHIIQ32sII")
assert _HEADER.size == HEADER_SIZE
_CRC_OFF = 60


def key_digest(key: ObjectKey) -> bytes:
    """sha256 over the key's fields, each length-prefixed (so no two keys share a digest input)."""
    h = hashlib.sha256(b"bsr-lmcache-fs-l2/1")
    for part in (key.chunk_hash, key.model_name.encode(), str(key.kv_rank).encode(),
                 str(key.object_group_id).encode(), key.cache_salt.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def pack_header(key: ObjectKey, data_ptr: int, length: int, algo: int = DEFAULT_CHECKSUM) -> bytes:
    """The header of `key`'s object whose `length` payload bytes are at host address `data_ptr`."""
    return _HEADER.pack(MAGIC, VERSION, algo, HEADER_SIZE, 0, length, key_digest(key), 0,
                        crc_at(algo, data_ptr, length))


def header_problem(key: ObjectKey, header: bytes | bytearray, length: int) -> str | None:
    """Why a file whose first bytes are `header` is not `key`'s object of `length` payload bytes (None: it
    may be; its payload checksum is checked by payload_problem once the payload is read)."""
    if len(header) < 4 or header[:4] != MAGIC:
        return f"no BSR FS L2 header (magic {bytes(header[:4])!r}): LMCache's headerless format is not read"
    if len(header) != HEADER_SIZE:
        return f"short file ({len(header)} B, no {HEADER_SIZE} B header)"
    _magic, version, algo, hsize, _r0, plen, digest, _r1, _crc = _HEADER.unpack(header)
    if version != VERSION or hsize != HEADER_SIZE:
        return f"format version {version} header {hsize} B, expected {VERSION}/{HEADER_SIZE}"
    if digest != key_digest(key):
        return f"the file holds another key's object (key digest {digest.hex()[:16]})"
    if plen != length:
        return f"header declares {plen:,} B of payload, expected {length:,}"
    if algo not in (CRC32, CRC32C):
        return f"unknown checksum algorithm {algo}"
    return None


def payload_problem(header: bytes | bytearray, data_ptr: int, length: int) -> str | None:
    """A header that passed header_problem: is the payload at `data_ptr` the one it was written with?"""
    _magic, _version, algo, _hsize, _r0, _plen, _digest, _r1, crc = _HEADER.unpack(header)
    if crc_at(algo, data_ptr, length) != crc:
        return "payload checksum mismatch"
    return None
