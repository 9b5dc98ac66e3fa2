"""A Mooncake L2 adapter for LMCache that works from the pip wheels.

LMCache 0.5.6's own `mooncake_store` L2 adapter needs `lmcache.lmcache_mooncake`, a C++ extension
the wheel does not ship. This one is a Python client on `mooncake.store.MooncakeDistributedStore`
(the `mooncake-transfer-engine[-non-cuda]` wheel), plugged in through LMCache's `plugin` L2 type:

    {"type": "plugin", "module_path": "bsr_runtime.integrations.lmcache.mooncake_l2",
     "class_name": "BSRMooncakeL2Adapter",
     "adapter_params": {"master_address": "127.0.0.1:50051",
                        "metadata_server": "http://127.0.0.1:8080/metadata",
                        "protocol": "tcp", "global_segment_size": 536870912}}

LMCache's plugin factory imports the module, builds `BSRMooncakeL2AdapterConfig.from_dict(
adapter_params)` (found by the "<class>Config" naming convention) and calls
`BSRMooncakeL2Adapter(config, l1_memory_desc=...)`.

Object format and data path: the MooncakeTier's (bsr_runtime/tiers/mooncake_object.py). Each
object is a 128-byte header (magic, version, `fingerprint`, sha256 of the store key, tenant,
payload length, CRC-32C) followed by the L1 object's bytes, under one key. The whole L1 arena
described by `l1_memory_desc` is registered with the store once (`register_buffer`; required over
RDMA). Loads take the MooncakeTier's read paths (tiers/mooncake_reads.py) into the L1 objects the
prefetch controller reserved: objects in this client's own segment by one checksumming copy, the
others whole into a landing buffer + checksumming copy (tcp) or header and payload apart (rdma),
sub-batch by sub-batch, checked while the next sub-batch lands; an object that fails (another
key's, another tenant's or registration's, damaged, headerless, missing) is a clear bit, i.e. a
miss. Stores stage header + payload in a registered buffer and `batch_upsert_from` them; lookups
are one `batch_is_exist`. Every operation runs on a small thread pool and completes through the
adapter's three event fds, as LMCache requires.

Locks. Mooncake has no pin for readers (a get leaves only a short lease), so "lookup and lock" is a
client-side refcount per key, like LMCache's NativeConnectorL2Adapter; `submit_unlock` drops it and
`locked_keys()` reports what is held. Mooncake objects are not evicted by LMCache's L2 eviction
controller unless `max_capacity_bytes` is set.

Failures (master unreachable, key missing, client closed) are per-key misses in the lookup/load
bitmaps and a failed store result; the retrieve above fails closed on them. Connecting reuses
bsr_runtime.tiers.mooncake.MooncakeTier's set-up (port checks, bounded setup, RPC timeouts, tcp
bind address); every store operation goes through that tier's `_live_store()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from bsr_runtime.config_schema import parse
from bsr_runtime.tiers._common import shutdown_bounded
from bsr_runtime.tiers.base import TierError
from bsr_runtime.tiers.mooncake import MooncakeTier
from bsr_runtime.tiers.mooncake_object import HEADER_SIZE, ObjectCodec

from .specs import MooncakeL2Params

logger = init_logger(__name__)

_SEP = "@"


class BSRMooncakeL2AdapterConfig(L2AdapterConfigBase):
    """Connection settings of the Mooncake L2 plugin (see MooncakeTier for their meaning), checked by one
    schema (specs.MooncakeL2Params: strict types, unknown keys refused, one error naming every bad key)."""

    def __init__(self, master_address: str, metadata_server: str, **kw: Any) -> None:
        p = parse(MooncakeL2Params, {"master_address": master_address, "metadata_server": metadata_server, **kw},
                  "Mooncake L2 plugin adapter_params")
        for name in MooncakeL2Params.model_fields:
            if name != "eviction":
                setattr(self, name, getattr(p, name))

    @classmethod
    def from_dict(cls, d: dict) -> BSRMooncakeL2AdapterConfig:
        d = dict(d)
        d.pop("type", None)
        eviction = cls._parse_eviction_config(d)
        d.pop("eviction", None)
        cfg = cls(**d)
        cfg.eviction_config = eviction
        return cfg

    @classmethod
    def help(cls) -> str:
        fields = ", ".join(f"{k} (default {f.default!r})" for k, f in MooncakeL2Params.model_fields.items()
                           if not f.is_required())
        return "BSR Mooncake L2 plugin: master_address (HOST:PORT), metadata_server (URL), " + fields


def padding_rooms(ptrs: Sequence[int], sizes: Sequence[int], physical: Sequence[int]) -> list[int]:
    """Scratch bytes before each L1 object of a load: where object i starts right where object i-1's
    allocation ends, the alignment padding after i-1's payload (align_up(c) - c, 4,800 B for the
    sweep's chunks): both are this load's own objects, and nothing reads padding. There object i
    lands whole, its header in that padding, with no copy (tiers/mooncake_reads.py)."""
    rooms = [0] * len(ptrs)
    for i in range(1, len(ptrs)):
        if ptrs[i] == ptrs[i - 1] + physical[i - 1] and physical[i - 1] > sizes[i - 1]:
            rooms[i] = physical[i - 1] - sizes[i - 1]
    return rooms


def _key_string(prefix: str, key) -> str:
    base = (f"{prefix}/{key.model_name}{_SEP}{key.kv_rank:08x}{_SEP}{key.object_group_id:x}"
            f"{_SEP}{key.chunk_hash.hex()}")
    return f"{base}{_SEP}{key.cache_salt}" if key.cache_salt else base


class BSRMooncakeL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter on mooncake.store.MooncakeDistributedStore (see the module docstring)."""

    def __init__(self, config: BSRMooncakeL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=int(config.max_capacity_bytes))
        self.config = config
        # MooncakeTier owns the client: its set-up handles the store's quirks (see tiers/mooncake.py)
        self._tier = MooncakeTier(
            1, "lmcache-l2", config.master_address, config.metadata_server, protocol=config.protocol,
            local_hostname=config.local_hostname, global_segment_size=config.global_segment_size,
            local_buffer_size=config.local_buffer_size, device_name=config.device_name,
            connect_timeout_s=config.connect_timeout_s, rpc_timeout_s=config.rpc_timeout_s,
            tenant_id=config.tenant_id, fetch_workers=config.num_workers,
            verify_batch_bytes=int(config.verify_batch_bytes),
        )
        self._codec = ObjectCodec(config.fingerprint, config.tenant_id)
        self._registered: int | None = None
        try:
            if config.register_l1 and l1_memory_desc is not None and l1_memory_desc.ptr and l1_memory_desc.size > 0:
                # through the tier's registrations, so its reads know the L1 objects are covered
                try:
                    self._tier._registrations.add(l1_memory_desc.ptr, l1_memory_desc.size)
                    self._registered = l1_memory_desc.ptr
                except TierError as e:
                    if config.protocol != "tcp":
                        raise RuntimeError(f"registering the L1 arena ({l1_memory_desc.size} B): {e}") from e
                    logger.warning("registering the L1 arena failed (%s); tcp works without it", e)
            elif config.protocol != "tcp":
                raise ValueError(f"protocol {config.protocol!r} needs the L1 memory descriptor to register L1")
        except BaseException:
            self._tier.close()
            raise
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_task = 0
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self._locks: dict[Any, int] = defaultdict(int)
        self._sizes: dict[Any, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix="bsr-lmcache-mooncake")
        self._closed = False
        logger.info("BSRMooncakeL2Adapter connected to %s (%s), L1 registered: %s", config.master_address,
                    config.protocol, self._registered is not None)

    # -- plumbing -------------------------------------------------------------------------------
    def _task_id(self) -> int:
        with self._lock:
            self._next_task += 1
            return self._next_task

    def _keys(self, keys) -> list[str]:
        return [_key_string(self.config.key_prefix, k) for k in keys]

    def _submit(self, fn, *args) -> int:
        task = self._task_id()
        self._pool.submit(fn, task, *args)
        return task

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- store --------------------------------------------------------------------------------------
    def submit_store_task(self, keys, objects) -> int:
        return self._submit(self._store_task, list(keys), list(objects))

    def _store_task(self, task: int, keys, objects) -> None:
        ok, nbytes, stored, sizes = False, 0, [], []
        try:
            store = self._tier._live_store()
            sizes_all = [o.get_size() for o in objects]
            codes = self._put_objects(store, self._keys(keys), objects, sizes_all)
            ok = len(codes) == len(keys) and all(c == 0 for c in codes)
            with self._lock:
                for k, c, s in zip(keys, codes, sizes_all, strict=False):
                    if c == 0:
                        nbytes += s
                        stored.append(k)
                        sizes.append(0 if k in self._sizes else s)
                        self._sizes[k] = s
            if not ok:
                logger.warning("Mooncake store of %d objects: codes %s", len(keys), sorted(set(codes)))
        except Exception:
            logger.exception("BSRMooncakeL2Adapter store task %d failed", task)
        if stored:
            self._notify_keys_stored(stored, sizes)
        with self._lock:
            self._stores[task] = L2StoreResult(ok, nbytes)
        self._store_efd.notify()

    def _put_objects(self, store, names: list[str], objects, sizes: list[int]) -> list[int]:
        """Header + payload per object, staged in registered buffers of about put_batch_bytes."""
        codes: list[int] = []
        start, cap = 0, self.config.put_batch_bytes
        while start < len(names):
            end, total = start, 0
            while end < len(names) and (end == start or total + HEADER_SIZE + sizes[end] <= cap):
                total += HEADER_SIZE + sizes[end]
                end += 1
            buf = self._tier._staging.acquire(total)
            try:
                ptrs, off = [], 0
                for o, name, size in zip(objects[start:end], names[start:end], sizes[start:end], strict=True):
                    row = buf[off : off + HEADER_SIZE + size]
                    ctypes.memmove(row.data_ptr() + HEADER_SIZE, o.data_ptr, size)
                    self._codec.write_header(row, name, size)
                    ptrs.append(row.data_ptr())
                    off += HEADER_SIZE + size
                codes += store.batch_upsert_from(names[start:end], ptrs, [HEADER_SIZE + s for s in sizes[start:end]])
            finally:
                self._tier._staging.release(buf)
            start = end
        return codes

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ---------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        return self._submit(self._lookup_task, list(keys))

    def _lookup_task(self, task: int, keys) -> None:
        bitmap = Bitmap(len(keys))
        try:
            codes = self._tier._live_store().batch_is_exist(self._keys(keys))
            with self._lock:
                for i, (k, c) in enumerate(zip(keys, codes, strict=False)):
                    if c == 1:
                        bitmap.set(i)
                        self._locks[k] += 1
        except Exception:
            logger.exception("BSRMooncakeL2Adapter lookup task %d failed", task)
        with self._lock:
            self._lookups[task] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys) -> None:
        with self._lock:
            for k in keys:
                n = self._locks.get(k, 0)
                if n <= 1:
                    self._locks.pop(k, None)
                else:
                    self._locks[k] = n - 1

    def locked_keys(self) -> dict:
        """Keys held by lookup-and-lock and not yet unlocked, with their counts."""
        with self._lock:
            return dict(self._locks)

    # -- load ---------------------------------------------------------------------------------------
    def submit_load_task(self, keys, objects) -> int:
        return self._submit(self._load_task, list(keys), list(objects))

    def _load_task(self, task: int, keys, objects) -> None:
        bitmap = Bitmap(len(keys))
        try:
            ptrs, sizes = [o.data_ptr for o in objects], [o.get_size() for o in objects]
            rooms = padding_rooms(ptrs, sizes, [o.get_physical_size() for o in objects])
            good = self._load_verified(self._keys(keys), ptrs, sizes, rooms)
            for i in good:
                bitmap.set(i)
            if good:
                self._notify_keys_accessed([keys[i] for i in good])
        except Exception:
            logger.exception("BSRMooncakeL2Adapter load task %d failed", task)
        with self._lock:
            self._loads[task] = bitmap
        self._load_efd.notify()

    def _load_verified(self, names: list[str], ptrs: list[int], sizes: list[int],
                       rooms: Sequence[int] | int = 0) -> list[int]:
        """Indices of the objects that landed and passed their checks: the MooncakeTier's read
        paths (tiers/mooncake_reads.py), collecting per-object problems instead of failing all.
        `rooms`: scratch bytes before each object (padding_rooms), or before every one."""
        bad = self._tier._reads.read(self._codec, names, ptrs, sizes, float("inf"), collect=True, headroom=rooms)
        if bad:
            logger.warning("Mooncake L2: %d objects refused, first: %s", len(bad), bad[min(bad)])
        return [i for i in range(len(names)) if i not in bad]

    def query_load_result(self, task_id: int):
        with self._lock:
            return self._loads.pop(task_id, None)

    # -- eviction, status, close ---------------------------------------------------------------------
    def delete(self, keys) -> None:
        keys = list(keys)
        if not keys:
            return
        try:
            codes = self._tier._live_store().batch_remove(self._keys(keys), True)
        except Exception:
            logger.exception("BSRMooncakeL2Adapter delete of %d keys failed", len(keys))
            return
        gone, sizes = [], []
        with self._lock:
            for k, c in zip(keys, codes, strict=False):
                if c == 0 and k in self._sizes:
                    gone.append(k)
                    sizes.append(self._sizes.pop(k))
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        health = self._tier.health()
        return {"is_healthy": health == 0 and not self._closed, "type": "BSRMooncakeL2Adapter",
                "master_address": self.config.master_address, "protocol": self.config.protocol,
                "health_check": health, "l1_registered": self._registered is not None,
                "locked_keys": len(self.locked_keys())}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not shutdown_bounded(self._pool, "BSRMooncakeL2Adapter"):
            return  # a job still running may use the client, the L1 registration and the event fds
        if self._registered is not None:  # even while a fault makes _live_store() raise
            with contextlib.suppress(Exception):
                self._tier._registrations.remove(self._registered)
        self._registered = None
        self._tier.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            with contextlib.suppress(Exception):
                efd.close()
