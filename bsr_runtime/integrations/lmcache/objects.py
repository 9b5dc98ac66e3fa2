"""BSR objects and keys in LMCache.

Objects. One LMCache object per (chunk, TP rank) holds the BSR chunk layout: c =
`Registration.chunk_bytes` bytes (MemoryLayoutDesc([c], [uint8]), object group 0, full attention:
the registration's own groups and sliding windows live inside the object and are handled by the
install kernel's -1 blocks). LMCache allocates each object at its physical size,
align_up(c, L1 align_bytes); that padding is LMCache's only per-object overhead.

Keys: `ObjectKey(chunk_hash=blake2b-128(BSR key), model_name="bsr-" + fingerprint[:16],
kv_rank=ComputeKVRank(world, rank, world, rank), cache_salt="")`, so a key binds everything a BSR
key binds (registration, TP geometry, tenant, prefix hash chain).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

from bsr_kernels import Registration

_POLL_S = (0.0005, 0.01)  # first and longest sleep between polls of an L2 adapter result
T = TypeVar("T")


def chunk_layout(reg: Registration) -> MemoryLayoutDesc:
    """The LMCache layout of one BSR object: c bytes."""
    return MemoryLayoutDesc(shapes=[torch.Size([reg.chunk_bytes])], dtypes=[torch.uint8])


_RANK = re.compile(r"-r(\d+)of(\d+)-")


def model_name(fingerprint: str) -> str:
    """The LMCache model name of a registration's objects."""
    return f"bsr-{fingerprint[:16]}"


def object_keys(keys: Sequence[str], model: str) -> list[ObjectKey]:
    """The LMCache ObjectKeys of BSR keys: a 128-bit hash of each key (which binds registration, TP
    geometry, tenant, model and prefix chain), the key's TP rank, no cache salt (the tenant is in the key)."""
    out = []
    for k in keys:
        m = _RANK.search(k)
        rank, world = (int(m.group(1)), int(m.group(2))) if m else (0, 1)
        out.append(ObjectKey(chunk_hash=hashlib.blake2b(k.encode(), digest_size=16).digest(), model_name=model,
                             kv_rank=ObjectKey.ComputeKVRank(world, rank, world, rank), object_group_id=0,
                             cache_salt=""))
    return out


def _poll(fn: Callable[[], T | None], deadline: float) -> T | None:
    """fn() until it returns something, with growing sleeps; None once `deadline` (monotonic) passed."""
    delay = _POLL_S[0]
    while True:
        r = fn()
        if r is not None:
            return r
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])


def _owners(result, keys: list[ObjectKey]) -> dict | None:
    """The L1 owners a prefetch result recorded for `keys` (None: LMCache's default owner)."""
    owners = getattr(result, "l1_owners", None)
    if not owners:
        return None
    return {k: owners[k] for k in keys if k in owners} or None
