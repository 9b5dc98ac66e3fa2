"""LMCache's filesystem L2 adapter with concurrent loads, for LMCache's `plugin` L2 adapter type.

LMCache 0.5.6's FSL2Adapter reads the keys of a load task one after another. This subclass reads up
to `load_concurrency` of them at a time (an asyncio semaphore on the adapter's own event loop; each
aiofiles read runs on the loop's thread pool), with the same semantics: the same files, one bit per
key in the result bitmap (set iff the whole object was read), reads straight into the preallocated
L1 memory objects the prefetch controller passed in. Stores, lookups and deletes are LMCache's.

    {"type": "plugin", "module_path": "bsr_runtime.integrations.lmcache.fs_l2",
     "class_name": "ConcurrentFSL2Adapter",
     "adapter_params": {"base_path": "/data/lmcache", "load_concurrency": 4}}

`load_concurrency` absent: $LMCACHE_FS_LOAD_CONCURRENCY (the adapter's config, config.py), default 1,
which runs LMCache's own sequential load unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiofiles
from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (
    FSL2Adapter,
    FSL2AdapterConfig,
    _async_readinto_full,
)

from .config import BSRLMCacheConfig

logger = init_logger(__name__)


class ConcurrentFSL2AdapterConfig(FSL2AdapterConfig):
    """FSL2AdapterConfig plus `load_concurrency` (None: $LMCACHE_FS_LOAD_CONCURRENCY)."""

    def __init__(self, base_path: str, relative_tmp_dir: str | None = None, read_ahead_size: int | None = None,
                 use_odirect: bool = False, load_concurrency: int | None = None) -> None:
        super().__init__(base_path, relative_tmp_dir, read_ahead_size, use_odirect)
        if load_concurrency is not None and (
            isinstance(load_concurrency, bool) or not isinstance(load_concurrency, int) or load_concurrency < 1
        ):
            raise ValueError(f"load_concurrency must be a positive integer, got {load_concurrency!r}")
        self.load_concurrency = load_concurrency

    @classmethod
    def from_dict(cls, d: dict) -> ConcurrentFSL2AdapterConfig:
        base = FSL2AdapterConfig.from_dict(d)
        return cls(base.base_path, base.relative_tmp_dir, base.read_ahead_size, base.use_odirect,
                   d.get("load_concurrency"))

    @classmethod
    def help(cls) -> str:
        return FSL2AdapterConfig.help() + "\n- load_concurrency (int): concurrent reads per load task (optional)"


def _env_load_concurrency() -> int:
    cfg = BSRLMCacheConfig.from_env()
    cfg.validate()
    return cfg.fs_load_concurrency


class ConcurrentFSL2Adapter(FSL2Adapter):
    """FSL2Adapter whose load tasks read up to `load_concurrency` keys at a time."""

    def __init__(self, config: FSL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__(config)
        conc = getattr(config, "load_concurrency", None)
        self.load_concurrency = int(conc) if conc is not None else _env_load_concurrency()
        logger.info("ConcurrentFSL2Adapter: load_concurrency=%d", self.load_concurrency)

    def report_status(self) -> dict:
        status = super().report_status()
        status.update(type="ConcurrentFSL2Adapter", load_concurrency=self.load_concurrency)
        return status

    async def _execute_load(self, keys, objects, task_id) -> None:
        if self.load_concurrency <= 1:
            await super()._execute_load(keys, objects, task_id)
            return
        sem = asyncio.Semaphore(self.load_concurrency)
        bitmap = Bitmap(len(keys))

        async def one(i: int) -> None:
            async with sem:
                if await self._load_one(keys[i], objects[i]):
                    bitmap.set(i)  # the event loop thread only: no lock needed

        await asyncio.gather(*(one(i) for i in range(len(keys))))
        loaded_keys = [keys[i] for i in bitmap.get_indices_list()]
        if loaded_keys:
            self._notify_keys_accessed(loaded_keys)
        with self._lock:
            self._completed_load_tasks[task_id] = bitmap
        self._load_efd.notify()

    async def _load_one(self, key, obj) -> bool:
        """One key into its preallocated object, as FSL2Adapter._execute_load reads it."""
        file_path = self._key_to_path(key)
        try:
            dst_buf = obj.byte_array
            expected = len(dst_buf)
            if self._use_odirect:
                num_read = await self._loop.run_in_executor(None, self._read_with_odirect, file_path, dst_buf)
            else:
                async with aiofiles.open(file_path, "rb") as f:
                    if self._read_ahead_size is None:
                        num_read = await _async_readinto_full(f, dst_buf)
                    else:
                        view = memoryview(dst_buf) if not isinstance(dst_buf, memoryview) else dst_buf
                        ra = self._read_ahead_size
                        num_read = await _async_readinto_full(f, view[:ra])
                        if num_read == ra:
                            num_read += await _async_readinto_full(f, view[ra:])
            if num_read != expected:
                logger.warning("Incomplete read for %s: expected %d, got %s", file_path.name, expected, num_read)
                return False
            return True
        except FileNotFoundError:
            return False
        except Exception:
            logger.exception("ConcurrentFSL2Adapter failed to load %s", file_path)
            return False
