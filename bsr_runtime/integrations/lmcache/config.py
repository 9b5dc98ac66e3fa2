"""The adapter's configuration and the LMCache storage stack it runs on.

Config, the LMCache way: a config class made by LMCache's `create_config_class`, loaded from the
file named by LMCACHE_BSR_CONFIG_FILE (YAML), then LMCACHE_* variables, then explicit overrides:
LMCACHE_FS_LOAD_CONCURRENCY (read by the FS L2 plugin, fs_l2.py), LMCACHE_PREFETCH_TIMEOUT_S,
LMCACHE_EVICT_RETAINED. W, the install backend and the probe are the restore's, set where it runs
(the connector's config, RestoreConfig) as for every tier: such a key here (RETIRED_KNOBS) is
refused with the place to set it. Unlike LMCache's own loader (which logs a bad
value and falls back to a default or None, and ignores unknown keys), every source is checked by
one schema (`LMCacheKnobs`): an unknown key in the file or the overrides, a variable that does not
parse ("ture", "8.5") or a value out of range is one ValueError naming every bad key and its source.

`build_storage_manager` makes LMCache 0.5.6's multiprocess StorageManager (one DRAM L1, the given
L2 adapters); `fs_l2_config` and `mooncake_l2_config` are the L2 plugin configs of fs_l2.py and
mooncake_l2.py (their parameters: specs.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from lmcache.v1.config_base import create_config_class
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.distributed.storage_manager import StorageManager
from pydantic import Field

from bsr_runtime.config_schema import Count, Schema, Seconds, load_yaml, parse, problems, raise_problems, short_repr
from bsr_runtime.tiers.fs_open import read_regular

from .specs import FSL2Params, MooncakeL2Params

CONFIG_FILE_ENV = "LMCACHE_BSR_CONFIG_FILE"
ENV_PREFIX = "LMCACHE_"
WHAT = "BSR LMCache config"


class LMCacheKnobs(Schema):
    """The LMCache tier's knobs: one line each (the LMCache config class below is made from them)."""

    fs_load_concurrency: Count = Field(1, description="concurrent file reads per FS L2 load task (fs_l2 plugin)")
    prefetch_timeout_s: Seconds = Field(30.0, description="how long a prefetch that missed its fetch's deadline "
                                                          "is waited for before its result is released")
    evict_retained: bool = Field(True, description="a fetch deletes the L2-loaded keys a retaining prefetch policy "
                                                   "kept in L1")


# keys that belong to the restore, not to the tier: refused with where they are set, never ignored
RETIRED_KNOBS = {
    "prefetch_window_chunks": "W is the restore's: the connector's window_chunks or RestoreConfig",
    "probe_only": "the tier's probe always holds nothing",
    "install_backend": "the install backend is the restore's: the connector's backend or RestoreConfig",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text not in _TRUE + _FALSE:
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    return text in _TRUE


def _env_int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else int(str(v).strip(), 10)


def _env_float(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float(str(v).strip())


_CONVERTERS = {bool: _env_bool, int: _env_int, float: _env_float, str: str}


def _definitions() -> dict[str, dict[str, Any]]:
    """LMCache's config definitions, from the schema (its defaults and descriptions)."""
    return {name: {"type": type(f.default), "default": f.default, "env_converter": _CONVERTERS[type(f.default)],
                   "description": f.description} for name, f in LMCacheKnobs.model_fields.items()}


def checked_values(config_file: str | None = None, env: bool = True, values: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The knobs from `config_file` (YAML), then LMCACHE_* variables (`env`), then `values`, checked by
    LMCacheKnobs: one ValueError naming every bad key and where it came from."""
    raw: dict[str, Any] = {}
    source: dict[str, str] = {}
    bad: list[str] = []
    if config_file:
        try:
            data = load_yaml(read_regular(config_file, 1 << 20)) or {}
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise_problems(WHAT, [f"config file {config_file}: {e}"])
        if not isinstance(data, Mapping):
            raise_problems(WHAT, [f"config file {config_file}: expected a mapping of keys, got {type(data).__name__}"])
        raw.update(data)
        source.update({k: f"file {config_file}" for k in data})
    for name, f in LMCacheKnobs.model_fields.items() if env else ():
        text = os.environ.get(ENV_PREFIX + name.upper())
        if text is None:
            continue
        source[name] = f"${ENV_PREFIX}{name.upper()}"
        try:
            raw[name] = _CONVERTERS[type(f.default)](text)
        except ValueError as e:
            bad.append(f"{name} (from {source[name]}): {e} (got {short_repr(text)})")
            raw.pop(name, None)
    for k, v in (values or {}).items():
        raw[k] = v
        source[k] = "overrides"
    for name, why in RETIRED_KNOBS.items():
        where = [source[name]] if name in raw else []
        where += [f"${ENV_PREFIX}{name.upper()}"] if env and ENV_PREFIX + name.upper() in os.environ else []
        if where:
            bad.append(f"{name} (from {', '.join(where)}): no longer an LMCache knob ({why})")
            raw.pop(name, None)
    for p in problems(LMCacheKnobs, raw):
        key = p.partition(":")[0]
        bad.append(p.replace(key, f"{key} (from {source[key]})", 1) if key in source else p)
    if bad:
        raise_problems(WHAT, bad)
    return LMCacheKnobs.model_validate(raw).model_dump()


def _validate(self) -> None:
    parse(LMCacheKnobs, {name: getattr(self, name) for name in LMCacheKnobs.model_fields}, WHAT)


BSRLMCacheConfig = create_config_class(
    "BSRLMCacheConfig", _definitions(), env_prefix=ENV_PREFIX, namespace_extras={
        "validate": _validate,
        # the strict loaders replace LMCache's lenient ones (which log a bad value and carry on)
        "from_env": classmethod(lambda cls: cls(**checked_values())),
        "from_file": classmethod(lambda cls, path: cls(**checked_values(path, env=False))),
        "from_dict": classmethod(lambda cls, d: cls(**checked_values(env=False, values=d))),
        "from_defaults": classmethod(lambda cls, **kw: cls(**checked_values(env=False, values=kw))),
    })


def load_adapter_config(config_file: str | None = None, **overrides):
    """The adapter config, loaded like LMCache's own: file (`config_file` or $LMCACHE_BSR_CONFIG_FILE),
    then LMCACHE_* environment variables, then `overrides`; every key checked (LMCacheKnobs)."""
    return BSRLMCacheConfig(**checked_values(config_file or os.environ.get(CONFIG_FILE_ENV), True, overrides))


def fs_l2_config(base_path: str, load_concurrency: int | None = None, **kw) -> PluginL2AdapterConfig:
    """LMCache's FS L2 adapter with concurrent loads (fs_l2.ConcurrentFSL2Adapter), as a plugin.
    `load_concurrency` None: $LMCACHE_FS_LOAD_CONCURRENCY (default 1 = LMCache's one-at-a-time loads).
    The parameters are checked here (specs.FSL2Params) and again by the plugin's config."""
    params = {"base_path": os.fspath(base_path), **kw}
    if load_concurrency is not None:
        params["load_concurrency"] = load_concurrency
    parse(FSL2Params, params, "FS L2 plugin adapter_params")
    return PluginL2AdapterConfig.from_dict({
        "module_path": "bsr_runtime.integrations.lmcache.fs_l2", "class_name": "ConcurrentFSL2Adapter",
        "adapter_params": params,
    })


def mooncake_l2_config(master_address: str, metadata_server: str, **kw) -> PluginL2AdapterConfig:
    """The Mooncake L2 adapter of mooncake_l2.py (pip wheels only), as a plugin; parameters checked
    here (specs.MooncakeL2Params) and again by the plugin's config."""
    params = {"master_address": master_address, "metadata_server": metadata_server, **kw}
    parse(MooncakeL2Params, params, "Mooncake L2 plugin adapter_params")
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
    """`n` rounded up to a multiple of `a` (LMCache's physical object size: align_up(c, align_bytes))."""
    return -(-n // a) * a if a > 1 else n
