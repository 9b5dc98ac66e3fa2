"""The connector's configuration: `kv_connector_extra_config` of vLLM's KVTransferConfig.

    {"tiers": [{"type": "fs", "root": "/ssd/bsr"},
               {"type": "mooncake", "master": "H:50051", "metadata_server": "http://H:8080/metadata"},
               {"type": "lmcache-fs", "root": "/ssd/lmcache"}],
     "window_chunks": 32, "pipeline_depth": 1, "fetch_timeout_s": 30, "salt": "", "model_id": null,
     "save": true, "report_path": null}

Tiers are tried in the listed order (plan on the first tier holding the longest prefix, fallback
to the next one holding the same prefix on a failure). Saves go to the tiers whose spec has
`"save": true` (default: the first tier only). Unknown keys are errors, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from bsr_harness.tier_setup import TierOptions, open_tier
from bsr_kernels import Registration

from ...tiers.base import Tier

TIER_TYPES = ("fs", "mooncake", "lmcache-fs", "lmcache-mooncake")
_TIER_KEYS = {"type", "root", "master", "metadata_server", "protocol", "segment_bytes", "load_concurrency", "save",
              "l1_bytes", "config_file"}


@dataclass(frozen=True)
class TierSpec:
    type: str
    root: str | None = None  # fs, lmcache-fs
    master: str | None = None  # mooncake, lmcache-mooncake: HOST:PORT of the master
    metadata_server: str | None = None  # default http://HOST:8080/metadata
    protocol: str = "tcp"
    segment_bytes: int = 0  # segment this client mounts; 0: objects live on the store hosts only
    load_concurrency: int | None = None
    save: bool | None = None  # None: the first tier saves, the others do not
    l1_bytes: int = 256 << 20  # lmcache-*: LMCache's L1 (the staging of its windows)
    config_file: str | None = None  # lmcache-*: LMCache config file (LMCACHE_* variables apply too)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierSpec:
        if not isinstance(d, dict) or "type" not in d:
            raise ValueError(f"a tier spec is a dict with a 'type', got {d!r}")
        unknown = set(d) - _TIER_KEYS
        if unknown:
            raise ValueError(f"tier spec {d['type']!r}: unknown keys {sorted(unknown)}")
        kind = {"filesystem": "fs"}.get(d["type"], d["type"])
        if kind not in TIER_TYPES:
            raise ValueError(f"unknown tier type {d['type']!r}; choose one of {', '.join(TIER_TYPES)}")
        if kind in ("fs", "lmcache-fs") and not d.get("root"):
            raise ValueError(f"tier {kind!r} needs a 'root' directory")
        if kind in ("mooncake", "lmcache-mooncake") and not d.get("master"):
            raise ValueError(f"tier {kind!r} needs 'master' (HOST:PORT of a running mooncake_master)")
        return cls(**{**d, "type": kind})

    def options(self) -> TierOptions:
        if self.root:
            os.makedirs(self.root, exist_ok=True)
        return TierOptions(name=self.type, root=self.root, load_concurrency=self.load_concurrency,
                           mooncake_master=self.master, metadata_server=self.metadata_server,
                           segment_bytes=self.segment_bytes, protocol=self.protocol)


_KEYS = {"tiers", "window_chunks", "pipeline_depth", "fetch_timeout_s", "backend", "salt", "model_id", "save",
         "save_window_chunks", "report_path", "chunk_tokens", "agree_timeout_s"}


@dataclass(frozen=True)
class ConnectorConfig:
    tiers: tuple[TierSpec, ...]
    window_chunks: int = 32  # W
    pipeline_depth: int = 1
    fetch_timeout_s: float = 30.0
    backend: str = "auto"
    salt: str = ""  # tenant of this engine (a request's cache_salt is added to it)
    model_id: str | None = None  # default: the served model name and revision
    save: bool = True  # store complete prompt chunks after prefill
    save_window_chunks: int | None = None  # staging of the store path (default W)
    report_path: str | None = None  # append one JSON line per load and save (both roles, all ranks)
    chunk_tokens: int = 256
    agree_timeout_s: float = 30.0
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = set(extra) - _KEYS
        if unknown:
            raise ValueError(f"BSR connector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(_KEYS)}")
        tiers = extra.pop("tiers", None)
        if not tiers:
            raise ValueError("BSR connector: kv_connector_extra_config needs 'tiers' (a non-empty list)")
        specs = tuple(TierSpec.from_dict(t) for t in tiers)
        cfg = cls(tiers=specs, **extra)
        if isinstance(cfg.window_chunks, bool) or not isinstance(cfg.window_chunks, int) or cfg.window_chunks < 0:
            raise ValueError(f"window_chunks must be an integer >= 0, got {cfg.window_chunks!r}")
        return cfg

    @property
    def save_tiers(self) -> list[int]:
        out = [i for i, t in enumerate(self.tiers) if t.save or (t.save is None and i == 0)]
        return out if self.save else []


def open_tiers(cfg: ConnectorConfig, reg: Registration, stack: contextlib.ExitStack) -> list[Tier]:
    """Open every configured tier through the CLI's tier factory (tier_setup); `stack` closes them."""
    tiers: list[Tier] = []
    for spec in cfg.tiers:
        if spec.type.startswith("lmcache-"):
            from .lmcache_tier import open_lmcache_tier

            tiers.append(stack.enter_context(open_lmcache_tier(spec, reg)))
        else:
            tiers.append(stack.enter_context(open_tier(spec.options(), reg)))
    return tiers


def write_report(path: str | None, record: dict[str, Any]) -> None:
    """Append one JSON line to the connector's report file (no-op without one). Lines are short
    and written with one O_APPEND write, so ranks and roles can share a file."""
    if not path:
        return
    import json
    import os
    import time

    line = (json.dumps({"t": time.time(), "pid": os.getpid(), **record}, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
