"""BSR objects and keys in LMCache, and reading L1 memory objects in place.

Objects. One LMCache object per (chunk, TP rank) holds the BSR chunk layout: c =
`Registration.chunk_bytes` bytes (MemoryLayoutDesc([c], [uint8]), object group 0, full attention:
the registration's own groups and sliding windows live inside the object and are handled by the
install kernel's -1 blocks). LMCache allocates each object at its physical size,
align_up(c, L1 align_bytes); that padding is LMCache's only per-object overhead.

Keys: `ObjectKey(chunk_hash=blake2b-128(BSR key), model_name="bsr-" + fingerprint[:16],
kv_rank=ComputeKVRank(world, rank, world, rank), cache_salt=blake2b-64(salt))`, so a key binds
everything a BSR key binds (registration, TP geometry, tenant, prefix hash chain).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

from bsr_kernels import Registration
from bsr_runtime.keys import KeySpace, PrefixKeys

_POLL_S = (0.0005, 0.01)  # first and longest sleep between polls of an L2 adapter result
T = TypeVar("T")


def chunk_layout(reg: Registration) -> MemoryLayoutDesc:
    """The LMCache layout of one BSR object: c bytes."""
    return MemoryLayoutDesc(shapes=[torch.Size([reg.chunk_bytes])], dtypes=[torch.uint8])


class LMCacheKeys:
    """LMCache ObjectKeys of one request's prefix, window by window (O(1) state: PrefixKeys)."""

    def __init__(self, space: KeySpace, tokens: Sequence[int], chunk_tokens: int) -> None:
        self._keys = PrefixKeys(space, tokens, chunk_tokens)
        self.num_chunks = self._keys.num_chunks
        self.model_name = f"bsr-{space.fingerprint[:16]}"
        self.kv_rank = ObjectKey.ComputeKVRank(space.tp_world, space.tp_rank, space.tp_world, space.tp_rank)
        self.salt = hashlib.blake2b(space.salt.encode(), digest_size=8).hexdigest() if space.salt else ""

    def window(self, first_chunk: int, num_chunks: int) -> list[ObjectKey]:
        return [
            ObjectKey(chunk_hash=hashlib.blake2b(k.encode(), digest_size=16).digest(), model_name=self.model_name,
                      kv_rank=self.kv_rank, object_group_id=0, cache_salt=self.salt)
            for k in self._keys.window(first_chunk, num_chunks)
        ]


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


def _runs(objs, chunk_bytes: int, stride: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first index, count, uint8 view) per run of consecutive objects that lie `stride` bytes apart
    (LMCache's object size, align_up(c, align_bytes)) in one L1 storage: a (count, c) view with that
    row stride, or 1-D when stride == c. The views alias LMCache's L1 memory (no copy), one install
    or gather launch per run. None entries break runs."""
    start = 0
    n = len(objs)
    while start < n:
        if objs[start] is None:
            start += 1
            continue
        raw = objs[start].raw_tensor
        if raw is None:
            raise RuntimeError("an L1 memory object has no tensor (invalidated or not host memory)")
        end = start + 1
        while (end < n and objs[end] is not None
               and objs[end].data_ptr == objs[start].data_ptr + (end - start) * stride):
            end += 1
        count = end - start
        storage = raw.untyped_storage()
        offset = raw.storage_offset() * raw.element_size()
        if offset + (count - 1) * stride + chunk_bytes > storage.nbytes():
            count, end = 1, start + 1  # not one storage: one object at a time
        view = torch.empty(0, dtype=torch.uint8, device=raw.device)
        if stride == chunk_bytes or count == 1:
            view.set_(storage, offset, (count * chunk_bytes,))
        else:
            view.set_(storage, offset, (count, chunk_bytes), (stride, 1))
        yield start, count, view
        start = end


def synchronize_device(kv: Sequence[torch.Tensor], stream=None) -> None:
    """Wait for the kernels launched on the destinations' device (`stream`, or the whole device);
    nothing to do on CPU, where the kernels are synchronous."""
    if kv and kv[0].device.type == "cuda":
        if stream is not None:
            stream.synchronize()
        else:
            torch.cuda.synchronize(kv[0].device)
