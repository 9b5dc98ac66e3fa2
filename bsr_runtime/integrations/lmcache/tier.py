"""LMCacheTier: LMCache's own storage stack as a BSR Tier, so an engine connector (vLLM) can list
it among its ordered tiers (plan, windowed restore, fallback, commit rule: the runtime's).

It drives the StorageManager of an `LMCacheAdapter` (adapter.py), configured the LMCache way
(config file or $LMCACHE_BSR_CONFIG_FILE, then LMCACHE_* variables) with an FS or Mooncake L2:

- probe: L1 (a prefetch served from L1 only, read locks returned at once) and every L2 adapter's
  lookup-and-lock, unlocked at once (LMCacheAdapter's probe path); holds nothing.
- fetch: one window: `submit_prefetch_task` of its keys (L2 -> L1), wait (deadline), every key must
  hit, `read_prefetched_results`, copy each object from L1 into the BSR staging slot,
  `finish_read_prefetched`, delete the L2-loaded objects from L1 (unless the prefetch policy is known
  to keep none: LMCacheAdapter.l2_loads_are_temporary). LMCache's L1 holds at most this
  window's objects during the fetch, BSR's staging the window: both bounded by W.
- put: `reserve_write` -> copy into the reserved L1 objects -> `finish_write`; LMCache's store
  controller writes them to the L2 adapters; the put waits until an L2 adapter holds them and
  deletes them from L1. A key it cannot reserve is an error. `overwrites` is False (an L2 lookup
  cannot tell the new object from an old one under the key), so the store path deletes first
  (`delete`: L1 and every L2 adapter): a damaged object is replaced, not kept.

Object keys: LMCache ObjectKeys whose chunk_hash is a 128-bit hash of the BSR key (which binds the
registration, TP geometry, tenant, model and prefix chain), model_name "bsr-<fingerprint[:16]>",
the key's TP rank, no cache salt (the tenant is already in the BSR key). LMCache objects carry no
checksum: a damaged byte in LMCache's L2 is not detected here (the filesystem and Mooncake tiers
check CRCs).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, ObjectKey, PrefetchTaskSpec

from bsr_kernels import Registration

from ...config_schema import parse
from ...tiers.base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
)
from .adapter import LMCacheAdapter
from .config import fs_l2_config, load_adapter_config, mooncake_l2_config
from .objects import _owners
from .probe import _probe_l1
from .retrieve import WINDOW_TAG, evict_l2_loaded, release_result
from .specs import LMCACHE_TIER_SPECS, LMCacheFSTierSpec
from .store import abort_writes, delete_everywhere, flush_l1, wait_in_l2

_RANK = re.compile(r"-r(\d+)of(\d+)-")


class LMCacheTier(Tier):
    name = "lmcache"

    def __init__(self, adapter: LMCacheAdapter, *, put_timeout_s: float = 60.0) -> None:
        super().__init__(adapter.reg.chunk_bytes, adapter.reg.fingerprint)
        self.adapter = adapter
        self.sm = adapter.sm
        self.name = adapter.tier_name()
        self.put_timeout_s = put_timeout_s
        self._model = f"bsr-{adapter.reg.fingerprint[:16]}"

    def _object_keys(self, keys: Sequence[str]) -> list[ObjectKey]:
        out = []
        for k in keys:
            m = _RANK.search(k)
            rank, world = (int(m.group(1)), int(m.group(2))) if m else (0, 1)
            out.append(ObjectKey(chunk_hash=hashlib.blake2b(k.encode(), digest_size=16).digest(),
                                 model_name=self._model,
                                 kv_rank=ObjectKey.ComputeKVRank(world, rank, world, rank),
                                 object_group_id=0, cache_salt=""))
        return out

    def _spec(self, okeys: list[ObjectKey], **kw) -> PrefetchTaskSpec:
        return PrefetchTaskSpec([GroupedObjectKeys(okeys, 0, self.adapter.layout)], **kw)

    @property
    def preferred_pipeline_depth(self) -> int:
        """1, as LMCache's own retrieve: each fetch pays LMCache's per-request work (CPU, not latency),
        and depth 2's half-size windows pay it twice as often (a depth-2 retrieve, a temporary patch
        recorded in benchmarks/results/sweep_lmcache_fs_scale64_r5.txt: 1.34-1.99x the whole plan
        against 1.20-1.56x at depth 1)."""
        return 1

    def probe(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        okeys = self._object_keys(keys)
        hit = [False] * len(keys)
        for i in _probe_l1(self.sm, self.adapter.layout, okeys):  # read locks returned at once
            hit[i] = True
        found, _errors = self.adapter.l2.lookup(okeys)  # lookup locks returned at once
        for row in found.values():
            for i, h in enumerate(row):
                hit[i] = hit[i] or h
        return hit

    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> FetchHandle:
        handle = FetchHandle(tuple(keys), deadline)
        try:
            handle.set_result(self._fetch(list(keys), list(views), deadline))
        except TierError as e:
            handle.set_error(e)
        except Exception as e:  # noqa: BLE001 - any failure of LMCache fails the window
            handle.set_error(TierError(f"LMCache fetch failed: {type(e).__name__}: {e}"))
        return handle

    def _fetch(self, keys: list[str], views: list[torch.Tensor], deadline: float) -> int:
        c = self.chunk_bytes
        okeys = self._object_keys(keys)
        h = self.sm.submit_prefetch_task(self._spec(okeys, num_kv_readers=1, fetching_policy="prefix"),
                                         external_request_id=WINDOW_TAG)
        result = self.adapter.late.wait(h, okeys, max(0.001, deadline - time.monotonic()))
        if result is None:
            raise FetchTimeoutError(f"LMCache prefetch of {len(keys)} objects missed its deadline")
        hit = result.hit_cells[0].get_indices_list()
        if len(hit) != len(keys):
            release_result(self.sm, result, okeys, evict_loaded=True)
            missing = next(i for i in range(len(keys)) if i >= len(hit) or hit[i] != i)
            raise MissingObjectError(f"LMCache holds {len(hit)}/{len(keys)} objects; {keys[missing]} is missing")
        owners = _owners(result, okeys)
        entered = False
        try:
            with self.sm.read_prefetched_results(okeys, owners) as objs:
                entered = True
                if objs is None:
                    raise CorruptObjectError("LMCache: prefetched objects not readable in L1")
                for obj, view in zip(objs, views, strict=True):
                    raw = obj.raw_tensor
                    if raw is None or raw.numel() * raw.element_size() < c:
                        raise CorruptObjectError("LMCache: an L1 object is shorter than a chunk")
                    view.copy_(raw.view(torch.uint8).reshape(-1)[:c])
        except BaseException:
            if entered:
                evict_l2_loaded(self.sm, result, okeys)
            else:
                release_result(self.sm, result, okeys, evict_loaded=True)
            raise
        self.sm.finish_read_prefetched(okeys, read_locks=1, l1_owners=owners)
        if not self.adapter.l2_loads_are_temporary:  # LMCache's default policy freed them already
            evict_l2_loaded(self.sm, result, okeys)
        return len(keys) * c

    @property
    def overwrites(self) -> bool:
        """False: a put goes to L2 through LMCache's store controller, and the put waits until an L2 lookup
        finds each key, which an old object under the key already satisfies; so a replacing put
        (store.store_prefix, through tiers.base.put_replacing) deletes the keys first (`delete`)."""
        return False

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        """reserve_write -> copy into the reserved L1 objects -> finish_write; waits until an L2 adapter holds
        every key and flushes them from L1. A key that cannot be reserved in L1 (resident there already,
        or no room) is a TierError, never a success without a write."""
        c = self.chunk_bytes
        okeys = self._object_keys(keys)
        reserved = self.sm.reserve_write(okeys, self.adapter.layout)
        try:
            missing = [k for k in okeys if reserved.get(k) is None]
            if missing:
                raise TierError(f"LMCache put: {len(missing)}/{len(okeys)} objects could not be reserved in L1 "
                                "(already resident, being written, or no room)")
            for k, view in zip(okeys, views, strict=True):
                reserved[k].raw_tensor.view(torch.uint8).reshape(-1)[:c].copy_(view.reshape(-1)[:c])
        except BaseException:
            abort_writes(self.sm, list(reserved))
            raise
        self.sm.finish_write(okeys)
        deadline = time.monotonic() + self.put_timeout_s
        try:
            if self.sm.l2_adapters():
                wait_in_l2(self.adapter.l2, okeys, deadline)
                flush_l1(self.sm, okeys, deadline)
        except TimeoutError as e:
            raise TierError(f"LMCache put: {e}") from e

    def delete(self, keys: Sequence[str]) -> None:
        """The keys' objects gone from L1 (waiting out readers' locks) and from every L2 adapter."""
        okeys = self._object_keys(keys)
        if not okeys:
            return
        try:
            delete_everywhere(self.sm, okeys, time.monotonic() + self.put_timeout_s)
        except TimeoutError as e:
            raise TierError(f"LMCache delete: {e}") from e
        found, errors = self.adapter.l2.lookup(okeys)
        left = sum(any(row[i] for row in found.values()) for i in range(len(okeys)))
        if left or errors:
            raise TierError(f"LMCache delete: {left}/{len(okeys)} objects are still in L2 {'; '.join(errors)}")

    def close(self) -> None:
        self.adapter.close()


@contextlib.contextmanager
def open_lmcache_tier(reg: Registration, kind: str, options: Mapping) -> Iterator[LMCacheTier]:
    """An LMCacheTier with LMCache's FS ("lmcache-fs": `root`, `load_concurrency`, ...) or Mooncake
    ("lmcache-mooncake": `master_address`, `metadata_server`, `protocol`, `global_segment_size`, ...)
    L2 adapter, an L1 of `l1_bytes`, and the adapter config loaded the LMCache way (`config_file`,
    then LMCACHE_* variables). The options are checked first (specs.py: one error naming every bad key)."""
    if kind not in LMCACHE_TIER_SPECS:
        raise ValueError(f"{kind!r} is not an LMCache tier (lmcache-fs | lmcache-mooncake)")
    spec = parse(LMCACHE_TIER_SPECS[kind], {"type": kind, **options}, f"{kind} tier spec")
    config = load_adapter_config(spec.config_file)
    l2_params = spec.model_dump(exclude={"type", "l1_bytes", "config_file", "root"}, exclude_defaults=True)
    if isinstance(spec, LMCacheFSTierSpec):
        Path(spec.root).mkdir(parents=True, exist_ok=True)
        l2 = fs_l2_config(spec.root, **l2_params)
    else:
        l2 = mooncake_l2_config(**{"global_segment_size": spec.global_segment_size, **l2_params})
    adapter = LMCacheAdapter.create(reg, spec.l1_bytes, [l2], config)
    tier = LMCacheTier(adapter)
    try:
        yield tier
    finally:
        tier.close()
