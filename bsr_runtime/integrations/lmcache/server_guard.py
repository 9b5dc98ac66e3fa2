"""The version guard of BSR's LMCache server module: it replaces LMCache's own lookup and retrieve
handlers and calls into LMCache's storage manager, session and transfer code, so it loads only into
an LMCache whose names and signatures are those it was written for (LMCache 0.5.6). Anything else
is refused with one line naming the version and the first difference, before the server starts
serving: a module written against other handlers could hold locks the stock flow never releases
or answer a lookup the client misreads.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

WRITTEN_FOR = "0.5.6"

# "<module>:<qualified name>" -> its signature in LMCache 0.5.6, module paths left out (`normalized`).
_LOOKUP = "lmcache.v1.multiprocess.modules.lookup:LookupModule"
_TRANSFER = "lmcache.v1.multiprocess.modules.lmcache_driven_transfer:LMCacheDrivenTransferModule"
_SM = "lmcache.v1.distributed.storage_manager:StorageManager"
_OGT = "lmcache.v1.multiprocess.object_group_transfer:"
_OWNERS = "l1_owners: dict[ObjectKey, int] | None = None"
EXPECTED: dict[str, str] = {
    f"{_LOOKUP}.lookup": "(self, key: IPCCacheServerKey, tp_size: int) -> None",
    f"{_LOOKUP}.query_prefetch_status": "(self, request_id: str) -> int | None",
    f"{_LOOKUP}.wait_prefetch_status": "(self, request_id: str, timeout: float) -> int | None",
    f"{_LOOKUP}.free_lookup_locks": "(self, key: IPCCacheServerKey, tp_size: int) -> None",
    f"{_LOOKUP}.end_session": "(self, request_id: str) -> None",
    f"{_TRANSFER}.retrieve": ("(self, key: IPCCacheServerKey, instance_id: int, gpu_block_ids: list[list[int]], "
                             "event_ipc_handle: bytes, skip_first_n_tokens: int = 0) -> tuple[bytes, bool]"),
    f"{_TRANSFER}.get_and_touch_context_entry": "(self, instance_id: int) -> ContextEntry | None",
    f"{_SM}.submit_prefetch_task": ("(self, spec: PrefetchTaskSpec, external_request_id: str = '', "
                                   "skip_l2: bool = False) -> PrefetchHandle"),
    f"{_SM}.query_prefetch_status": "(self, handle: PrefetchHandle) -> PrefetchResult | None",
    f"{_SM}.wait_prefetch_status": "(self, handle: PrefetchHandle, timeout: float) -> bool",
    f"{_SM}.read_prefetched_results": f"(self, keys: list[ObjectKey], {_OWNERS}) -> Iterator[list[MemoryObj] | None]",
    f"{_SM}.finish_read_prefetched": f"(self, keys: list[ObjectKey], read_locks: int = 1, {_OWNERS}) -> None",
    f"{_SM}.delete_l1_keys": "(self, keys: list[ObjectKey], force: bool = False) -> tuple[int, int]",
    f"{_OGT}downsample_and_stage_block_ids": (
        "(cache_context: BaseCacheContext, block_ids: list[list[int]]) -> list[Tensor]"),
    f"{_OGT}transfer_kv_per_object_group": (
        "(cache_context: BaseCacheContext, block_ids_gpu: list[Tensor], memory_objs: Sequence[MemoryObj | None], "
        "object_group_id: int, batch_size: int, skip_first_n_tokens: int, direction: 'TransferDirection', *, "
        "transfer_key: str, block_ids_host: Sequence[Sequence[int]] = ()) -> None"),
}
_MODULE_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])")


class IncompatibleLMCache(RuntimeError):
    """The running LMCache is not the one the server module was written for."""


def _resolve(path: str) -> Callable | None:
    import importlib

    module_name, qualname = path.split(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


def _signature(fn: Callable) -> str:
    """The signature with module paths left out (`a.b.C` -> `C`): what matters is the names and types."""
    # the undecorated function: the transfer module wraps retrieve in an NVTX annotation
    return _MODULE_PATH.sub("", str(inspect.signature(inspect.unwrap(fn))))


def differences(expected: dict[str, str] = EXPECTED) -> list[str]:
    """Each handler or call of `expected` that is missing or whose signature differs."""
    out = []
    for path, want in expected.items():
        fn = _resolve(path)
        if fn is None:
            out.append(f"{path} is missing")
            continue
        got = _signature(fn)
        if got != want:
            out.append(f"{path}{got} (expected {want})")
    return out


def lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # noqa: BLE001 - a version we cannot read is reported as unknown
        return "unknown"


def check_lmcache(expected: dict[str, str] = EXPECTED) -> None:
    """Raise IncompatibleLMCache (one line) unless every name and signature is as written for."""
    bad = differences(expected)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise IncompatibleLMCache(
            f"BSR server module refused: LMCache {lmcache_version()} differs from LMCache {WRITTEN_FOR}, "
            f"which it was written for: {bad[0]}{more}")
