"""LMCache adapter: BSR's windowed retrieve, probe-only lookup and store path inside LMCache 0.5.6's
multiprocess storage stack (`lmcache.v1.distributed`: StorageManager, L1 manager, L2 adapters).

This module and `bsr_runtime/lmcache_*_l2.py` are the only places that import LMCache; nothing
else in bsr_runtime imports them at import time.

Objects. One LMCache object per (chunk, TP rank) holds the BSR chunk layout: c =
`Registration.chunk_bytes` bytes (MemoryLayoutDesc([c], [uint8]), object group 0, full attention:
the registration's own groups and sliding windows live inside the object and are handled by the
install kernel's -1 blocks). Keys: `ObjectKey(chunk_hash=blake2b-128(BSR key), model_name="bsr-" +
fingerprint[:16], kv_rank=ComputeKVRank(world, rank, world, rank), cache_salt=blake2b-64(salt))`, so a
key binds everything a BSR key binds (registration, TP geometry, tenant, prefix hash chain).

LMCache's own lookup is a whole-plan prefetch: it read-locks every L1 hit, loads every L2 hit into L1
and keeps them locked until the retrieve (probing makes the hit set resident). Its L1 reservation
for the loads is all-or-nothing per request: one chunk more than free L1 and the whole request
reports zero hits. This adapter keeps that path as W = 0 and adds:

- probe (`probe_only`): hit discovery through the same L1 and L2 adapters, holding nothing. L1: a
  `submit_prefetch_task(..., skip_l2=True)` (served on the calling thread: `reserve_read` of the
  resident keys, no allocation), whose retained read locks are returned at once with
  `finish_read_prefetched(hit keys, read_locks=1, l1_owners)`. L2: every adapter's
  `submit_lookup_and_lock_task`, polled with `query_lookup_and_lock_result`, then `submit_unlock` of
  the keys it found (FS takes no lock; the Mooncake plugin keeps a client-side refcount). A lookup
  that does not answer in time is remembered and unlocked when it does.
- windowed retrieve (W > 0): for each window of at most W chunks: `submit_prefetch_task` of the
  window's keys, `wait_prefetch_status` + `query_prefetch_status` (every key must be a hit, or the
  retrieve fails), `read_prefetched_results` (the staged L1 objects), `install_window` straight from
  L1 memory (zero copy: each run of objects that are contiguous in the L1 arena is one launch),
  synchronize, `finish_read_prefetched` (temporary objects are freed by LMCache) and
  `delete_l1_keys` of the L2-loaded keys a retaining prefetch policy kept. Then the next window.
- a store path: `reserve_write` -> `gather_window` into the reserved L1 objects -> `finish_write`;
  LMCache's store controller writes them to every L2 adapter; the path waits until the L2 adapters
  hold them and (flush_l1) deletes them from L1, batch by batch, so any length fits a small L1.

Failure (missing key, timeout, install error, admission refused, any exception): the report has
ok=False, committed_tokens = 0, `invalid_block_ids` = per group every destination block id the
retrieve could have written (the blocks covering chunks 0..N-1, -1 skipped), `force_local` set (the
request id is added to `adapter.force_local` and to an optional shared `markers` table), and every
lock and staged object of the retrieve released, so L1 usage returns to its pre-retrieve value. A
prefetch that misses its deadline is still running inside LMCache: its result is collected when it
lands (within 1 s on this thread, later on a reaper thread) and released the same way.

Admission: the retrieve (and the store path) run under the runtime's admission, SerialAdmission
(process-wide, shared with BoundedRestorer) by default or a ByteBudget B from which every window
reserves its W*c bytes, so concurrent requests cannot multiply the L1 staging.

RWS. `LMCacheRestoreReport.peak_staging_bytes` is the peak of LMCache's own L1 usage
(`StorageManager.get_l1_usage()`, i.e. the L1 memory allocator's used bytes) above its value when
the retrieve started. It is sampled by an L1ManagerListener right after every L1 allocation
(`on_l1_keys_reserved_write`, called by the L1 manager with the new objects allocated) and when
each window is complete, so no allocation peak is missed. LMCache allocates each object at its
physical size, align_up(c, L1 align_bytes); that padding is LMCache's only per-object overhead.

Config (the LMCache way: a config class made by LMCache's `create_config_class`, loaded with
`load_config_with_overrides`: file named by LMCACHE_BSR_CONFIG_FILE, then LMCACHE_* variables,
then explicit overrides): LMCACHE_PREFETCH_WINDOW_CHUNKS (W, default 0 = LMCache's whole-plan
behaviour), LMCACHE_PROBE_ONLY, LMCACHE_FS_LOAD_CONCURRENCY (read by the FS L2 plugin in
lmcache_fs_l2.py), LMCACHE_PREFETCH_TIMEOUT_S, LMCACHE_INSTALL_BACKEND, LMCACHE_EVICT_RETAINED.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from lmcache.v1.config_base import create_config_class, load_config_with_overrides
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchHandle,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.internal_api import L1ManagerListener
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_kernels import Registration, gather_window, install_window
from bsr_kernels.validate import check_destinations
from bsr_runtime.admission import ByteBudget, SerialAdmission
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.plan import count_windows, plan_windows
from bsr_runtime.restore import MAX_WINDOW_CHUNKS, RestoreReport, RestoreRequest
from bsr_runtime.state_hash import ChunkHasher
from bsr_runtime.store import StoreReport

PROBE_BATCH_CHUNKS = 256
_POLL_S = (0.0005, 0.01)  # first and longest sleep between polls of an L2 adapter result


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def _to_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _validate(self) -> None:
    w = self.prefetch_window_chunks
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WINDOW_CHUNKS:
        raise ValueError(f"prefetch_window_chunks (W) must be an integer in [0, {MAX_WINDOW_CHUNKS}], got {w!r}")
    n = self.fs_load_concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fs_load_concurrency must be an integer >= 1, got {n!r}")
    if not (isinstance(self.prefetch_timeout_s, (int, float)) and self.prefetch_timeout_s > 0):
        raise ValueError(f"prefetch_timeout_s must be positive, got {self.prefetch_timeout_s!r}")


_CONFIG_DEFINITIONS = {
    "prefetch_window_chunks": {"type": int, "default": 0, "env_converter": int,
                               "description": "W: chunks per prefetch window; 0 = LMCache's whole-plan prefetch"},
    "probe_only": {"type": bool, "default": False, "env_converter": _to_bool,
                   "description": "lookup() reports hits without making them resident or keeping locks"},
    "fs_load_concurrency": {"type": int, "default": 1, "env_converter": int,
                            "description": "concurrent file reads per FS L2 load task (lmcache_fs_l2 plugin)"},
    "prefetch_timeout_s": {"type": float, "default": 30.0, "env_converter": float,
                           "description": "per window: a prefetch not complete by then fails the retrieve"},
    "install_backend": {"type": str, "default": "auto", "env_converter": str,
                        "description": "bsr_kernels install backend: auto, torch, triton, cuda"},
    "evict_retained": {"type": bool, "default": True, "env_converter": _to_bool,
                       "description": "W > 0: delete L2-loaded keys a retaining prefetch policy kept in L1"},
}

BSRLMCacheConfig = create_config_class(
    "BSRLMCacheConfig", _CONFIG_DEFINITIONS, namespace_extras={"validate": _validate}, env_prefix="LMCACHE_"
)
CONFIG_FILE_ENV = "LMCACHE_BSR_CONFIG_FILE"


def load_adapter_config(config_file: str | None = None, **overrides):
    """The adapter config, loaded like LMCache's own: file (`config_file` or $LMCACHE_BSR_CONFIG_FILE),
    then LMCACHE_* environment variables, then `overrides`; validated."""
    return load_config_with_overrides(BSRLMCacheConfig, CONFIG_FILE_ENV, config_file, overrides or None)


# ---------------------------------------------------------------------------------------------
# Building a StorageManager and L2 plugin configs
# ---------------------------------------------------------------------------------------------
def fs_l2(base_path: str, load_concurrency: int | None = None, **kw) -> PluginL2AdapterConfig:
    """LMCache's FS L2 adapter with concurrent loads (lmcache_fs_l2.ConcurrentFSL2Adapter), as a plugin.
    `load_concurrency` None: $LMCACHE_FS_LOAD_CONCURRENCY (default 1 = LMCache's one-at-a-time loads)."""
    params = {"base_path": str(base_path), **kw}
    if load_concurrency is not None:
        params["load_concurrency"] = int(load_concurrency)
    return PluginL2AdapterConfig.from_dict({
        "module_path": "bsr_runtime.integrations.lmcache.fs_l2", "class_name": "ConcurrentFSL2Adapter",
        "adapter_params": params,
    })


def mooncake_l2(master_address: str, metadata_server: str, **kw) -> PluginL2AdapterConfig:
    """The Mooncake L2 adapter of lmcache_mooncake_l2 (pip wheels only), as a plugin."""
    params = {"master_address": master_address, "metadata_server": metadata_server, **kw}
    return PluginL2AdapterConfig.from_dict({
        "module_path": "bsr_runtime.integrations.lmcache.mooncake_l2", "class_name": "BSRMooncakeL2Adapter",
        "adapter_params": params,
    })


def build_storage_manager(l1_bytes: int, l2: Sequence[L2AdapterConfigBase] = (), *, align_bytes: int = 4096,
                          store_policy: str = "skip_l1", prefetch_policy: str = "default",
                          eviction_policy: str = "LRU") -> StorageManager:
    """A StorageManager with one DRAM L1 of `l1_bytes` (eager, no SHM) and the given L2 adapters.

    store_policy "skip_l1" (LMCache's BufferOnlyStorePolicy) drops objects from L1 once every L2
    adapter stored them; "default" keeps them. prefetch_policy "default" loads L2 objects as
    temporary L1 objects (freed by the last finish_read), "retain" keeps them."""
    mem = L1MemoryManagerConfig(size_in_bytes=int(l1_bytes), use_lazy=False, shm_name="", align_bytes=align_bytes)
    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=mem),
        eviction_config=EvictionConfig(eviction_policy=eviction_policy),
        l2_adapter_config=L2AdaptersConfig(list(l2)),
        store_policy=store_policy,
        prefetch_policy=prefetch_policy,
    )
    return StorageManager(cfg)


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a if a > 1 else n


# ---------------------------------------------------------------------------------------------
# Keys and layout
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# L1 usage
# ---------------------------------------------------------------------------------------------
class _Measure:
    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.peak = baseline
        self.samples = 1


class _L1UsageTracker(L1ManagerListener):
    """Peak of StorageManager.get_l1_usage() during each active measurement, sampled right after
    every L1 allocation and whenever the adapter asks (e.g. when a window is complete).

    L1 managers call listeners with their lock held: the callbacks only read the allocator's
    usage (not under that lock) and never block."""

    def __init__(self, sm: StorageManager) -> None:
        self._sm = sm
        self._lock = threading.Lock()
        self._active: list[_Measure] = []
        self.listening = False
        managers = getattr(sm, "_l1_managers_by_id", None)  # StorageManager has no public accessor
        if managers:
            for m in managers.values():
                m.register_listener(self)
            self.listening = True

    def used(self) -> int:
        return int(self._sm.get_l1_usage()[0])

    def sample(self) -> int:
        used = self.used()
        with self._lock:
            for m in self._active:
                m.peak = max(m.peak, used)
                m.samples += 1
        return used

    def start(self) -> _Measure:
        m = _Measure(self.used())
        with self._lock:
            self._active.append(m)
        return m

    def stop(self, m: _Measure) -> _Measure:
        self.sample()
        with self._lock:
            self._active.remove(m)
        return m

    # listener callbacks
    def on_l1_keys_reserved_write(self, keys) -> None:
        if self._active:
            self.sample()

    def on_l1_keys_finish_write_and_reserve_read(self, keys) -> None:
        if self._active:
            self.sample()

    def on_l1_keys_reserved_read(self, keys) -> None:
        pass

    def on_l1_keys_read_finished(self, keys) -> None:
        pass

    def on_l1_keys_write_finished(self, keys) -> None:
        pass

    def on_l1_keys_deleted_by_manager(self, keys) -> None:
        pass

    def on_l1_keys_accessed(self, keys) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Results and reports
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LMCacheProbeResult:
    bitmap: bytes  # one byte per candidate chunk: 1 = present in L1 or an L2 adapter
    prefix_chunks: int  # longest fully present prefix
    l1_bitmap: bytes
    l2_bitmaps: dict[str, bytes]  # per adapter ("<index>:<type>")
    errors: tuple[str, ...] = ()
    resident: bool = False  # True only for the legacy (whole-plan) lookup

    @property
    def hits(self) -> int:
        return sum(self.bitmap)


@dataclass
class LMCacheLookup:
    """Result of `lookup()`. probe_only: nothing is held. Legacy: the hit prefix is resident in L1 and
    read-locked (as after LMCache's LookupModule.lookup) until `release_lookup()`."""

    request_id: str
    prefix_chunks: int
    resident: bool
    probe: LMCacheProbeResult | None = None
    held_keys: list[ObjectKey] = field(default_factory=list)
    l1_owners: dict = field(default_factory=dict)
    l2_loaded_keys: list[ObjectKey] = field(default_factory=list)


@dataclass
class LMCacheRestoreReport(RestoreReport):
    hit_chunks: int = 0  # chunks LMCache reported resident (all windows)
    l1_baseline_bytes: int = 0  # L1 used when the retrieve started
    l1_peak_bytes: int = 0  # peak L1 used during the retrieve
    l1_after_bytes: int = 0  # L1 used after it (== baseline unless a retaining policy kept keys at W = 0)
    l1_capacity_bytes: int = 0
    l1_object_bytes: int = 0  # bytes LMCache allocates per object: align_up(c, align_bytes)
    install_launches: int = 0
    l1_samples: int = 0
    invalid_block_ids: list[list[int]] = field(default_factory=list)  # per group, on failure
    force_local: bool = False


class _WindowFailed(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------
class LMCacheAdapter:
    """BSR on top of an LMCache StorageManager (one TP rank's view)."""

    def __init__(self, reg: Registration, storage_manager: StorageManager, config=None, *,
                 admission: SerialAdmission | ByteBudget | None = None, stream: torch.cuda.Stream | None = None,
                 owns_storage_manager: bool = False, l2_lookup_timeout_s: float = 10.0, markers=None) -> None:
        self.reg = reg
        self.sm = storage_manager
        self.config = config if config is not None else load_adapter_config()
        self.config.validate()
        self.admission = admission or SerialAdmission()
        self.stream = stream
        self.layout = chunk_layout(reg)
        self.l2_lookup_timeout_s = l2_lookup_timeout_s
        self.force_local: set[str] = set()  # request ids that failed closed (see clear_force_local)
        self.markers = markers  # optional shared force-local table: anything with set(request_id, reason)
        self._owns = owns_storage_manager
        self._tracker = _L1UsageTracker(storage_manager)
        self._orphans: list[tuple[object, int, list[ObjectKey]]] = []  # (adapter, task id, keys) to unlock
        self._orphan_lock = threading.Lock()
        self._reapers: list[threading.Thread] = []
        align = storage_manager.l1_memory_desc.align_bytes
        if align % 16:
            raise ValueError(f"L1 align_bytes {align} is not a multiple of 16: staged objects must be 16-byte aligned")
        self.l1_object_bytes = align_up(reg.chunk_bytes, align)

    @classmethod
    def create(cls, reg: Registration, l1_bytes: int, l2: Sequence[L2AdapterConfigBase] = (), config=None, *,
               align_bytes: int = 4096, store_policy: str = "skip_l1", prefetch_policy: str = "default",
               **kw) -> LMCacheAdapter:
        sm = build_storage_manager(l1_bytes, l2, align_bytes=align_bytes, store_policy=store_policy,
                                   prefetch_policy=prefetch_policy)
        try:
            return cls(reg, sm, config, owns_storage_manager=True, **kw)
        except BaseException:
            sm.close()
            raise

    # -- misc ------------------------------------------------------------------------------
    def l1_usage(self) -> tuple[int, int]:
        return self.sm.get_l1_usage()

    def keys(self, keyspace: KeySpace, tokens: Sequence[int]) -> LMCacheKeys:
        if keyspace.fingerprint != self.reg.fingerprint:
            raise ValueError("keyspace was built for another registration "
                             f"({keyspace.fingerprint} != {self.reg.fingerprint})")
        return LMCacheKeys(keyspace, tokens, self.reg.chunk_tokens)

    def l2_adapters(self):
        return self.sm.l2_adapters()

    def _tier_name(self) -> str:
        names = [type(a).__name__ for _, a in self.sm.l2_adapters()]
        return f"lmcache[{'+'.join(names) or 'L1'}]"

    def clear_force_local(self, request_id: str) -> None:
        """Drop the force-local marker (the request was admitted RUNNING or torn down). A shared
        `markers` table is cleared by its owner."""
        self.force_local.discard(request_id)

    def close(self) -> None:
        for t in self._reapers:
            t.join(timeout=self.config.prefetch_timeout_s)
        self._unlock_orphans(wait_s=1.0)
        if self._owns:
            self.sm.close()

    def __enter__(self) -> LMCacheAdapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- L2 lookups (probe, store-path presence) ---------------------------------------------
    def _l2_lookup(self, keys: list[ObjectKey]) -> tuple[dict[str, list[bool]], list[str]]:
        """Ask every L2 adapter which keys it holds; every lookup lock is returned before this
        returns (an adapter that did not answer in time is unlocked when it does)."""
        self._unlock_orphans()
        out: dict[str, list[bool]] = {}
        errors: list[str] = []
        pending = []
        for desc, adapter in self.sm.l2_adapters():
            name = f"{desc.index}:{desc.type_name}"
            try:
                task = adapter.submit_lookup_and_lock_task(keys, {0: self.layout})
            except Exception as e:  # noqa: BLE001 - an adapter that fails is a miss, reported
                errors.append(f"{name}: lookup failed: {type(e).__name__}: {e}")
                out[name] = [False] * len(keys)
                continue
            pending.append((name, adapter, task))
        deadline = time.monotonic() + self.l2_lookup_timeout_s
        for name, adapter, task in pending:
            result = _poll(lambda a=adapter, t=task: a.query_lookup_and_lock_result(t), deadline)
            if result is None:
                errors.append(f"{name}: lookup did not answer within {self.l2_lookup_timeout_s}s")
                out[name] = [False] * len(keys)
                with self._orphan_lock:
                    self._orphans.append((adapter, task, keys))
                continue
            found = result.get_indices_list()
            if found:
                adapter.submit_unlock([keys[i] for i in found])
            hit = [False] * len(keys)
            for i in found:
                hit[i] = True
            out[name] = hit
        return out, errors

    def _unlock_orphans(self, wait_s: float = 0.0) -> None:
        with self._orphan_lock:
            orphans, self._orphans = self._orphans, []
        deadline = time.monotonic() + wait_s
        left = []
        for adapter, task, keys in orphans:
            try:
                result = _poll(lambda a=adapter, t=task: a.query_lookup_and_lock_result(t), deadline)
            except Exception:  # noqa: BLE001 - a closed adapter holds nothing
                continue
            if result is None:
                left.append((adapter, task, keys))
                continue
            found = result.get_indices_list()
            if found:
                adapter.submit_unlock([keys[i] for i in found])
        with self._orphan_lock:
            self._orphans.extend(left)

    # -- probe / lookup -----------------------------------------------------------------------
    def probe(self, keyspace: KeySpace, tokens: Sequence[int], num_chunks: int | None = None,
              batch_chunks: int = PROBE_BATCH_CHUNKS) -> LMCacheProbeResult:
        """Hit bitmap and prefix through LMCache's L1 and L2 adapters; holds nothing afterwards
        (no L1 allocation, every L1 read lock and L2 lookup lock released)."""
        keys = self.keys(keyspace, tokens)
        total = keys.num_chunks if num_chunks is None else min(num_chunks, keys.num_chunks)
        l1 = bytearray(total)
        l2: dict[str, bytearray] = {}
        errors: list[str] = []
        for first in range(0, total, batch_chunks):
            n = min(batch_chunks, total - first)
            batch = keys.window(first, n)
            # L1: LMCache's prefetch served from L1 only (no allocation), locks returned at once
            spec = PrefetchTaskSpec([GroupedObjectKeys(batch, 0, self.layout)], fetching_policy="full")
            handle = self.sm.submit_prefetch_task(spec, external_request_id="bsr-probe", skip_l2=True)
            result = self.sm.query_prefetch_status(handle)
            if result is not None and result.hit_cells:
                hit = result.hit_cells[0].get_indices_list()
                if hit:
                    hit_keys = [batch[i] for i in hit]
                    self.sm.finish_read_prefetched(hit_keys, read_locks=1, l1_owners=_owners(result, hit_keys))
                for i in hit:
                    l1[first + i] = 1
            # L2: every adapter's lookup-and-lock, unlocked at once
            found, errs = self._l2_lookup(batch)
            errors.extend(errs)
            for name, hits in found.items():
                row = l2.setdefault(name, bytearray(total))
                for i, h in enumerate(hits):
                    if h:
                        row[first + i] = 1
        bitmap = bytearray(l1)
        for row in l2.values():
            for i, h in enumerate(row):
                if h:
                    bitmap[i] = 1
        p = bitmap.find(0)
        return LMCacheProbeResult(bytes(bitmap), total if p < 0 else p, bytes(l1),
                                  {k: bytes(v) for k, v in l2.items()}, tuple(errors))

    def lookup(self, keyspace: KeySpace, tokens: Sequence[int], num_chunks: int | None = None,
               request_id: str = "lookup") -> LMCacheLookup:
        """probe_only: `probe()`. Otherwise LMCache's own lookup: a whole-plan prefetch that makes the
        hit prefix resident and read-locked in L1 until `release_lookup()`."""
        if self.config.probe_only:
            p = self.probe(keyspace, tokens, num_chunks)
            return LMCacheLookup(request_id, p.prefix_chunks, False, probe=p)
        keys = self.keys(keyspace, tokens)
        total = keys.num_chunks if num_chunks is None else min(num_chunks, keys.num_chunks)
        if total == 0:
            return LMCacheLookup(request_id, 0, True)
        batch = keys.window(0, total)
        handle = self.sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(batch, 0, self.layout)]),
                                              external_request_id=request_id)
        result = self._wait_result(handle, batch, self.config.prefetch_timeout_s)
        if result is None:
            return LMCacheLookup(request_id, 0, True)
        hit = result.hit_cells[0].get_indices_list()
        held = [batch[i] for i in hit]
        loaded = [batch[i] for i in result.l2_hit_cells[0].get_indices_list()]
        return LMCacheLookup(request_id, len(hit), True, held_keys=held, l1_owners=_owners(result, held) or {},
                             l2_loaded_keys=loaded)

    def release_lookup(self, lookup: LMCacheLookup) -> None:
        """LMCache's free_lookup_locks for a legacy lookup (no-op for a probe)."""
        if lookup.held_keys:
            self.sm.finish_read_prefetched(lookup.held_keys, read_locks=1, l1_owners=lookup.l1_owners or None)
            lookup.held_keys = []

    # -- retrieve -------------------------------------------------------------------------------
    def retrieve(self, req: RestoreRequest, num_chunks: int, *, window_chunks: int | None = None,
                 admission_timeout_s: float | None = None) -> LMCacheRestoreReport:
        """Restore chunks 0..num_chunks-1 of `req` from LMCache into its destination blocks.

        W = `window_chunks` or config.prefetch_window_chunks; W = 0 is LMCache's whole-plan prefetch.
        Bad arguments raise ValueError before anything is submitted; every other failure returns a
        fail-closed report (ok=False)."""
        reg, cfg = self.reg, self.config
        w = cfg.prefetch_window_chunks if window_chunks is None else int(window_chunks)
        if not 0 <= w <= MAX_WINDOW_CHUNKS:
            raise ValueError(f"window_chunks (W) must be in [0, {MAX_WINDOW_CHUNKS}], got {w}")
        if num_chunks < 0 or num_chunks * reg.chunk_tokens > len(req.tokens):
            raise ValueError(f"confirmed prefix of {num_chunks} chunks exceeds the request's {len(req.tokens)} tokens")
        keys = self.keys(req.keyspace, req.tokens)
        kv, tables = check_destinations(reg, req.kv, req.block_tables, 0, num_chunks)
        adapters = self._tier_name()
        rep = LMCacheRestoreReport(
            request_id=req.request_id, tier=adapters, ok=False, num_chunks=num_chunks,
            committed_tokens=0, window_chunks=w, pipeline_depth=1, windows=count_windows(num_chunks, w),
            windows_installed=0, chunk_bytes=reg.chunk_bytes, bytes_moved=0, peak_staging_bytes=0,
            tiers_tried=[adapters], l1_capacity_bytes=int(self.sm.get_l1_usage()[1]),
            l1_object_bytes=self.l1_object_bytes,
        )
        t0 = time.perf_counter()
        measure = self._tracker.start()
        base = rep.l1_baseline_bytes = measure.baseline
        try:
            with self.admission.restore(admission_timeout_s):
                for win in plan_windows(num_chunks, w):
                    nbytes = win.num_chunks * reg.chunk_bytes
                    self.admission.reserve(nbytes, admission_timeout_s)
                    try:
                        self._window(req.request_id, keys, win.index, win.first_chunk, win.num_chunks, kv, tables,
                                     rep, evict_retained=cfg.evict_retained and w > 0)
                    finally:
                        self.admission.release(nbytes)
                    rep.windows_installed += 1
                    rep.bytes_moved += nbytes
            rep.ok = True
            rep.committed_tokens = num_chunks * reg.chunk_tokens
        except _WindowFailed as e:
            rep.error = str(e)
        except Exception as e:  # noqa: BLE001 - any failure fails the request closed
            rep.error = f"{type(e).__name__}: {e}"
            if rep.failed_window is None:
                rep.failed_window = rep.windows_installed
        finally:
            self._tracker.stop(measure)
            rep.l1_peak_bytes = measure.peak
            rep.peak_staging_bytes = measure.peak - base
            rep.l1_after_bytes = self._tracker.used()
            rep.l1_samples = measure.samples
            rep.total_s = time.perf_counter() - t0
        if not rep.ok:
            self._fail_closed(req, rep)
        return rep

    def _fail_closed(self, req: RestoreRequest, rep: LMCacheRestoreReport) -> None:
        """Every destination block the retrieve could have written (per group, the blocks covering
        chunks 0..N-1, -1 skipped) is invalid, nothing is committed, the request prefills locally."""
        rep.committed_tokens = 0
        rep.force_local = True
        tokens = rep.num_chunks * self.reg.chunk_tokens
        rep.invalid_block_ids = [
            sorted({int(b) for b in t[: self.reg.blocks_needed(g, tokens)].tolist() if int(b) >= 0})
            for g, t in enumerate(req.block_tables)
        ]
        self.force_local.add(req.request_id)
        if self.markers is not None:
            self.markers.set(req.request_id, rep.error or "LMCache retrieve failed")

    def _wait_result(self, handle: PrefetchHandle, keys: list[ObjectKey], timeout_s: float):
        """The prefetch's result, or None after `timeout_s` (its locks are then released whenever the
        late result arrives, so nothing stays resident)."""
        if self.sm.wait_prefetch_status(handle, timeout_s):
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                return result
        self._settle_late(handle, keys)
        return None

    def _settle_late(self, handle: PrefetchHandle, keys: list[ObjectKey]) -> None:
        def settle(wait_s: float) -> bool:
            if not self.sm.wait_prefetch_status(handle, wait_s):
                return False
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                self._release_result(result, keys, evict_loaded=True)
            return True

        if settle(min(1.0, self.config.prefetch_timeout_s)):
            return
        t = threading.Thread(target=settle, args=(max(60.0, 4 * self.config.prefetch_timeout_s),),
                             name="bsr-lmcache-late-prefetch", daemon=True)
        t.start()
        self._reapers = [r for r in self._reapers if r.is_alive()] + [t]

    def _release_result(self, result, keys: list[ObjectKey], evict_loaded: bool) -> None:
        hit_keys = [keys[i] for i in result.hit_cells[0].get_indices_list()]
        if hit_keys:
            self.sm.finish_read_prefetched(hit_keys, read_locks=1, l1_owners=_owners(result, hit_keys))
        if evict_loaded:
            loaded = [keys[i] for i in result.l2_hit_cells[0].get_indices_list()]
            if loaded:
                self.sm.delete_l1_keys(loaded)

    def _window(self, request_id: str, lmkeys: LMCacheKeys, index: int, first: int, n: int, kv, tables,
                rep: LMCacheRestoreReport, evict_retained: bool) -> None:
        keys = lmkeys.window(first, n)
        spec = PrefetchTaskSpec([GroupedObjectKeys(keys, 0, self.layout)], num_kv_readers=1, fetching_policy="prefix")
        t = time.perf_counter()
        handle = self.sm.submit_prefetch_task(spec, external_request_id=f"{request_id}/w{index}")
        result = self._wait_result(handle, keys, self.config.prefetch_timeout_s)
        rep.fetch_s += time.perf_counter() - t
        self._tracker.sample()
        if result is None:
            rep.failed_window = index
            raise _WindowFailed(f"window {index} (chunks {first}..{first + n - 1}): prefetch not complete within "
                                f"{self.config.prefetch_timeout_s}s")
        hit = result.hit_cells[0].get_indices_list()
        rep.hit_chunks += len(hit)
        if len(hit) != n:
            self._release_result(result, keys, evict_loaded=True)
            rep.failed_window = index
            missing = next(i for i in range(n) if i >= len(hit) or hit[i] != i)
            raise _WindowFailed(
                f"window {index} (chunks {first}..{first + n - 1}): LMCache holds {len(hit)}/{n} chunks; "
                f"chunk {first + missing} is not resident (missing in L1 and L2, or L1 had no room)"
            )
        owners = _owners(result, keys)
        # read_prefetched_results returns the read locks itself when it yields None or the body
        # raises; when it raises before yielding, or the body completes, they are ours to return
        entered = False
        try:
            with self.sm.read_prefetched_results(keys, owners) as objs:
                entered = True
                if objs is None:
                    raise _WindowFailed(f"window {index}: prefetched objects not readable in L1")
                t = time.perf_counter()
                rep.install_launches += self._install(objs, first, kv, tables, rep)
                self._synchronize(kv)
                rep.install_s += time.perf_counter() - t
        except Exception as e:
            rep.failed_window = index
            if entered:
                self._evict_loaded(result, keys, True)  # a failed window leaves nothing behind
            else:
                self._release_result(result, keys, evict_loaded=True)
            if isinstance(e, _WindowFailed):
                raise
            raise _WindowFailed(f"window {index} (chunks {first}..{first + n - 1}): install failed: "
                                f"{type(e).__name__}: {e}") from e
        t = time.perf_counter()
        self.sm.finish_read_prefetched(keys, read_locks=1, l1_owners=owners)  # frees temporary objects
        self._evict_loaded(result, keys, evict_retained)
        rep.sync_s += time.perf_counter() - t

    def _evict_loaded(self, result, keys: list[ObjectKey], evict: bool) -> None:
        if not evict:
            return
        loaded = [keys[i] for i in result.l2_hit_cells[0].get_indices_list()]
        if loaded:
            self.sm.delete_l1_keys(loaded)  # objects a retaining policy kept; temporary ones are gone

    def _install(self, objs, first: int, kv, tables, rep) -> int:
        """install_window from L1 memory, one launch per run of arena-contiguous objects."""
        launches = 0
        for start, count, view in _runs(objs, self.reg.chunk_bytes):
            rep.backend = install_window(view, self.reg, kv, tables, first + start, count,
                                         backend=self.config.install_backend, stream=self.stream,
                                         fingerprint=self.reg.fingerprint)
            launches += 1
        return launches

    def _synchronize(self, kv) -> None:
        if kv and kv[0].device.type == "cuda":
            if self.stream is not None:
                self.stream.synchronize()
            else:
                torch.cuda.synchronize(kv[0].device)

    # -- store ------------------------------------------------------------------------------------
    def store(self, keyspace: KeySpace, tokens: Sequence[int], kv: Sequence[torch.Tensor],
              block_tables: Sequence[torch.Tensor], num_chunks: int | None = None, *,
              batch_chunks: int | None = None, flush_l1: bool = True, timeout_s: float = 60.0) -> StoreReport:
        """Write chunks 0..num_chunks-1 into LMCache: reserve_write -> gather_window into the reserved
        L1 objects -> finish_write; LMCache's store controller puts them into the L2 adapters. Batches
        of at most `batch_chunks` (default W, or 32) that also fit the free L1; each batch is waited
        for in L2 (when there is one) and, with flush_l1, deleted from L1 before the next.

        Returns the canonical state hash of what was written (state_hash.py)."""
        reg = self.reg
        keys = self.keys(keyspace, tokens)
        n_total = keys.num_chunks if num_chunks is None else num_chunks
        if not 0 <= n_total <= keys.num_chunks:
            raise ValueError(f"{n_total} chunks requested, the tokens hold {keys.num_chunks}")
        kv, tables = check_destinations(reg, kv, block_tables, 0, n_total)
        has_l2 = bool(self.sm.l2_adapters())
        if flush_l1 and not has_l2:
            raise ValueError("flush_l1 needs an L2 adapter (the objects would be lost)")
        want = batch_chunks or self.config.prefetch_window_chunks or 32
        hasher = ChunkHasher()
        scratch = torch.empty(reg.chunk_bytes, dtype=torch.uint8)
        budget = getattr(self.admission, "budget_bytes", None)
        if budget is not None:
            want = max(1, min(want, budget // reg.chunk_bytes))
        t0 = time.perf_counter()
        measure = self._tracker.start()
        try:
            with self.admission.restore(timeout_s):  # the store stages in L1 too: same admission
                first = 0
                while first < n_total:
                    used, total = self.sm.get_l1_usage()
                    n = min(want, (total - used) // self.l1_object_bytes, n_total - first)
                    if n <= 0:
                        raise MemoryError(f"L1 has no room for one object ({used:,}/{total:,} B used)")
                    self.admission.reserve(n * reg.chunk_bytes, timeout_s)
                    try:
                        self._store_batch(keys, first, n, kv, tables, hasher, scratch, has_l2, flush_l1, timeout_s)
                    finally:
                        self.admission.release(n * reg.chunk_bytes)
                    first += n
        finally:
            self._tracker.stop(measure)
        return StoreReport(self._tier_name(),
                           n_total, n_total * reg.chunk_bytes, time.perf_counter() - t0,
                           measure.peak - measure.baseline, hasher.hexdigest())

    def _store_batch(self, keys: LMCacheKeys, first: int, n: int, kv, tables, hasher: ChunkHasher,
                     scratch: torch.Tensor, has_l2: bool, flush_l1: bool, timeout_s: float) -> None:
        reg = self.reg
        batch = keys.window(first, n)
        reserved = self.sm.reserve_write(batch, self.layout)
        objs = [reserved.get(k) for k in batch]  # None: already resident, or no room
        try:
            for start, count, view in _runs(objs, reg.chunk_bytes):
                gather_window(view, reg, kv, tables, first + start, count, backend=self.config.install_backend)
            self._synchronize(kv)
        except BaseException:
            self._abort_writes(list(reserved))
            raise
        for i, obj in enumerate(objs):  # the canonical hash, in chunk order
            if obj is None:
                gather_window(scratch, reg, kv, tables, first + i, 1, backend="torch")
                hasher.update(scratch)
            else:
                hasher.update(obj.raw_tensor[: reg.chunk_bytes])
        if reserved:
            self.sm.finish_write([k for k in batch if k in reserved])
        if has_l2:
            self._wait_in_l2(batch, time.monotonic() + timeout_s)
        elif len(reserved) < n:
            raise RuntimeError(f"{n - len(reserved)} objects could not be reserved in L1")
        if flush_l1:
            self._flush_l1(batch, time.monotonic() + timeout_s)

    def _abort_writes(self, keys: list[ObjectKey]) -> None:
        """Discard reservations that were never filled. StorageManager has no public abort (its
        finish_write would admit, and store, unwritten bytes): use the L1 manager's
        finish_write_and_delete under the manager's write tag; otherwise LMCache's write TTL
        reclaims them."""
        from lmcache.v1.distributed import storage_manager as smod

        mgr, tag = getattr(self.sm, "_l1_manager", None), getattr(smod, "_L1_WRITE_TAG", None)
        if keys and mgr is not None and tag is not None:
            mgr.finish_write_and_delete(keys, tag=tag)

    def _wait_in_l2(self, keys: list[ObjectKey], deadline: float) -> None:
        pending = list(keys)
        delay = _POLL_S[0]
        while True:
            found, _errors = self._l2_lookup(pending)
            present = [any(row[i] for row in found.values()) for i in range(len(pending))]
            pending = [k for k, p in zip(pending, present, strict=True) if not p]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} objects did not reach any L2 adapter in time")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _flush_l1(self, keys: list[ObjectKey], deadline: float) -> None:
        """Delete stored keys from L1; the store controller holds a read lock until its L2 store
        completes, so locked keys are retried."""
        delay = _POLL_S[0]
        while True:
            _deleted, skipped = self.sm.delete_l1_keys(keys)
            if skipped == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{skipped} stored objects stayed locked in L1")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _poll(fn, deadline: float):
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
    owners = getattr(result, "l1_owners", None)
    if not owners:
        return None
    return {k: owners[k] for k in keys if k in owners} or None


def _runs(objs, chunk_bytes: int):
    """(first index, count, uint8 view) per run of consecutive objects that lie back to back in one
    L1 storage; the views alias LMCache's L1 memory (no copy). None entries break runs."""
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
               and objs[end].data_ptr == objs[start].data_ptr + (end - start) * chunk_bytes):
            end += 1
        count = end - start
        storage = raw.untyped_storage()
        if raw.storage_offset() * raw.element_size() + count * chunk_bytes > storage.nbytes():
            count, end = 1, start + 1  # not one storage: one object at a time
        view = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(
            storage, raw.storage_offset() * raw.element_size(), (count * chunk_bytes,))
        yield start, count, view
        start = end
