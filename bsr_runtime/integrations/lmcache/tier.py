"""LMCacheTier: LMCache 0.5.6's multiprocess storage stack (`lmcache.v1.distributed`: StorageManager,
L1 manager, L2 adapters) as a BSR Tier: the one road into LMCache. The vLLM connector lists it among
its ordered tiers and the `bsr` sweeps restore from it like from any tier (plan, windowed restore
bounded by W, fallback, commit rule: the runtime's).

One TP rank's view of a StorageManager, configured the LMCache way (config file or
$LMCACHE_BSR_CONFIG_FILE, then LMCACHE_* variables; config.py) with an FS or Mooncake L2:

- probe: L1 (a prefetch served from L1 only, read locks returned at once) and every L2 adapter's
  lookup-and-lock, unlocked at once (probe.py); holds nothing.
- restore (window_source, l1_source.py): each window prefetched into L1 (`submit_prefetch_task` of
  its keys, L2 -> L1), waited for (deadline), every key required to hit, and installed straight from
  the L1 objects (read-locked from then until the window's release: one copy per byte), then
  `finish_read_prefetched` and the L2-loaded objects deleted from L1 (unless the prefetch policy is
  known to keep none: `l2_loads_are_temporary`). LMCache's L1 holds at most the windows in flight,
  bounded by W. A whole-plan restore (W = 0) is one prefetch of every key: LMCache's all-or-nothing
  L1 reservation, as its own lookup.
- fetch: the same prefetch for one window, copied from L1 into the caller's views (the Tier contract;
  the restore does not take this road).
- put: `reserve_write` -> copy into the reserved L1 objects -> `finish_write`; LMCache's store
  controller writes them to the L2 adapters; the put waits until an L2 adapter holds them and
  deletes them from L1 (l1_writes.py). A key it cannot reserve is an error. `overwrites` is False
  (an L2 lookup cannot tell the new object from an old one under the key), so the store path deletes
  first (`delete`: L1 and every L2 adapter): a damaged object is replaced, not kept.

Object keys: objects.py. LMCache objects carry no checksum of their own; the BSR FS and Mooncake L2
plugins (fs_l2.py, mooncake_l2.py) add the BSR header and CRC.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_kernels import Registration

from ...config_schema import parse
from ...keys import PrefixKeys
from ...tiers.base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
    depth_by_window,
)
from .config import align_up, build_storage_manager, fs_l2_config, load_adapter_config, mooncake_l2_config
from .l1_source import L1Reads, L1Source
from .l1_usage import L1UsageTracker
from .l1_writes import abort_writes, delete_everywhere, flush_l1, wait_in_l2
from .objects import _owners, chunk_layout, model_name, object_keys
from .prefetch import WINDOW_TAG, LatePrefetches, evict_l2_loaded, fold_window_lines, release_result
from .probe import L2Lookups, probe_l1
from .specs import LMCACHE_TIER_SPECS, LMCacheFSTierSpec, LMCacheMooncakeTierSpec


class LMCacheTier(Tier):
    """BSR objects in an LMCache StorageManager (one TP rank's view)."""

    name = "lmcache"

    def __init__(self, reg: Registration, storage_manager: StorageManager, config=None, *,
                 owns_storage_manager: bool = False, l2_loads_are_temporary: bool = False,
                 put_timeout_s: float = 60.0, l2_lookup_timeout_s: float = 10.0) -> None:
        """`config`: the knobs of config.py (default: loaded the LMCache way). `l2_loads_are_temporary`:
        the prefetch policy is known to keep nothing it loads from L2 (LMCache's default policy: the
        last finish_read frees those objects), so a fetch need not delete them from L1 itself."""
        super().__init__(reg.chunk_bytes, reg.fingerprint)
        self.reg = reg
        self.sm = storage_manager
        self.config = config if config is not None else load_adapter_config()
        self.config.validate()
        self.layout = chunk_layout(reg)
        self.put_timeout_s = put_timeout_s
        self.l2_loads_are_temporary = l2_loads_are_temporary
        self._owns = owns_storage_manager
        self._model = model_name(reg.fingerprint)
        self.l2 = L2Lookups(storage_manager, self.layout, l2_lookup_timeout_s)
        self.late = LatePrefetches(storage_manager, lambda: self.config.prefetch_timeout_s)
        self.l1_tracker = L1UsageTracker(storage_manager)  # LMCache's L1 peak, for whoever measures it
        fold_window_lines()  # one line per restore (its report), not one LMCache line per window
        align = storage_manager.l1_memory_desc.align_bytes
        if align % 16:
            raise ValueError(f"L1 align_bytes {align} is not a multiple of 16: staged objects must be 16-byte aligned")
        self.l1_object_bytes = align_up(reg.chunk_bytes, align)
        self.name = f"lmcache[{'+'.join(type(a).__name__ for _, a in storage_manager.l2_adapters()) or 'L1'}]"

    @classmethod
    def create(cls, reg: Registration, l1_bytes: int, l2: Sequence[L2AdapterConfigBase] = (), config=None, *,
               align_bytes: int = 4096, store_policy: str = "skip_l1", prefetch_policy: str = "default",
               **kw) -> LMCacheTier:
        """A tier owning a new StorageManager (config.build_storage_manager), closed with the tier."""
        sm = build_storage_manager(l1_bytes, l2, align_bytes=align_bytes, store_policy=store_policy,
                                   prefetch_policy=prefetch_policy)
        try:
            return cls(reg, sm, config, owns_storage_manager=True,
                       l2_loads_are_temporary=prefetch_policy == "default", **kw)
        except BaseException:
            sm.close()
            raise

    def l1_usage(self) -> tuple[int, int]:
        """(used, capacity) bytes of LMCache's L1."""
        return self.sm.get_l1_usage()

    def _object_keys(self, keys: Sequence[str]) -> list[ObjectKey]:
        return object_keys(keys, self._model)

    def _spec(self, okeys: list[ObjectKey], **kw) -> PrefetchTaskSpec:
        return PrefetchTaskSpec([GroupedObjectKeys(okeys, 0, self.layout)], **kw)

    def preferred_pipeline_depth(self, window_bytes: int) -> int:
        """By the window's size (base.depth_by_window): each fetch pays LMCache's per-request work (CPU, not
        latency), and depth 2's half windows pay it twice as often, which costs more than the overlap saves
        below half windows of 16 MiB and less from there (`bsr wlaw --tier lmcache-mooncake --depth {1,2}`,
        figures beside depth_by_window)."""
        return depth_by_window(window_bytes)

    def probe(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        okeys = self._object_keys(keys)
        hit = [False] * len(keys)
        for i in probe_l1(self.sm, self.layout, okeys):  # read locks returned at once
            hit[i] = True
        found, _errors = self.l2.lookup(okeys)  # lookup locks returned at once
        for row in found.values():
            for i, h in enumerate(row):
                hit[i] = hit[i] or h
        return hit

    def window_source(self, keys: PrefixKeys, timeout_s: float) -> L1Source:
        """A restore's windows installed straight from the L1 objects LMCache prefetched (l1_source.py),
        not copied into BSR's staging first."""
        evict = self.config.evict_retained and not self.l2_loads_are_temporary
        reads = L1Reads(self.sm, self.late, self.layout, self._model, self.chunk_bytes, self.l1_object_bytes, evict)
        return L1Source(reads, keys, timeout_s)

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
        result = self.late.wait(h, okeys, max(0.001, deadline - time.monotonic()))
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
        if self.config.evict_retained and not self.l2_loads_are_temporary:  # the default policy freed them
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
        reserved = self.sm.reserve_write(okeys, self.layout)
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
                wait_in_l2(self.l2, okeys, deadline)
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
        found, errors = self.l2.lookup(okeys)
        left = sum(any(row[i] for row in found.values()) for i in range(len(okeys)))
        if left or errors:
            raise TierError(f"LMCache delete: {left}/{len(okeys)} objects are still in L2 {'; '.join(errors)}")

    def close(self) -> None:
        self.late.join()
        self.l2.unlock_orphans(wait_s=1.0)
        if self._owns:
            self.sm.close()

    def __enter__(self) -> LMCacheTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def open_lmcache_tier(reg: Registration, kind: str, options: Mapping) -> Iterator[LMCacheTier]:
    """An LMCacheTier with LMCache's FS ("lmcache-filesystem": `root`,
    `load_concurrency`, ...) or Mooncake ("lmcache-mooncake": `master_address`, `metadata_server`,
    `protocol`, `global_segment_size`, ...) L2 adapter, an L1 of `l1_bytes`, and the adapter config
    loaded the LMCache way (`config_file`, then LMCACHE_* variables). The options are checked first
    (specs.py: one error naming every bad key)."""
    if kind not in LMCACHE_TIER_SPECS:
        raise ValueError(f"{kind!r} is not an LMCache tier ({' | '.join(LMCACHE_TIER_SPECS)})")
    spec = parse(LMCACHE_TIER_SPECS[kind], {"type": kind, **options}, f"{kind} tier spec")
    with open_lmcache_spec(reg, spec) as tier:
        yield tier


@contextlib.contextmanager
def open_lmcache_spec(reg: Registration, spec: LMCacheFSTierSpec | LMCacheMooncakeTierSpec) -> Iterator[LMCacheTier]:
    """The LMCacheTier of a checked spec (the tier registry's opener of both LMCache types)."""
    config = load_adapter_config(spec.config_file)
    l2_params = spec.model_dump(exclude={"type", "l1_bytes", "config_file", "root"}, exclude_defaults=True)
    if isinstance(spec, LMCacheFSTierSpec):
        Path(spec.root).mkdir(parents=True, exist_ok=True)
        l2 = fs_l2_config(spec.root, **l2_params)
    else:
        l2 = mooncake_l2_config(**{"global_segment_size": spec.global_segment_size, **l2_params})
    tier = LMCacheTier.create(reg, spec.l1_bytes, [l2], config)
    try:
        yield tier
    finally:
        tier.close()
