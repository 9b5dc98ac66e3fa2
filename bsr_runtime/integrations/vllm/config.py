"""The connector's configuration: `kv_connector_extra_config` of vLLM's KVTransferConfig.

    {"tiers": [{"type": "filesystem", "root": "/ssd/bsr"},
               {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata"},
               {"type": "lmcache-fs", "root": "/ssd/lmcache"}],
     "window_chunks": 32, "pipeline_depth": null, "fetch_timeout_s": 30, "salt": "", "model_id": null,
     "load_mode": "async", "restore_budget_bytes": null, "max_concurrent_restores": 8,
     "save": true, "save_staging_chunks": null, "report_path": null}

Tier options are those of the tier factory (bsr_runtime/tiers/factory.py); a Mooncake tier
mounts no segment unless `global_segment_size` says so (the objects live on the store hosts).
Tiers are tried in the listed order (plan on the first tier holding the longest prefix, fallback
to the next one holding the same prefix on a failure). Saves go to the tiers whose spec has
`"save": true` (default: the first tier only). Unknown keys are errors, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bsr_kernels import Registration

from ...restore import RestoreConfig
from ...tiers.base import Tier
from ...tiers.factory import make_tier

TIER_TYPES = ("filesystem", "mooncake", "lmcache-fs", "lmcache-mooncake")
_ALIASES = {"fs": "filesystem"}
_CONNECTOR_KEYS = {"type", "save"}  # the rest of a spec goes to the tier factory (or to LMCache)


@dataclass(frozen=True)
class TierSpec:
    """One tier of the connector: `type`, whether saves go to it, and the options of the tier
    factory (bsr_runtime.tiers.factory.make_tier) or of the LMCache tier."""

    type: str
    save: bool | None = None  # None: the first tier saves, the others do not
    options: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierSpec:
        if not isinstance(d, dict) or "type" not in d:
            raise ValueError(f"a tier spec is a dict with a 'type', got {d!r}")
        kind = _ALIASES.get(d["type"], d["type"])
        if kind not in TIER_TYPES:
            raise ValueError(f"unknown tier type {d['type']!r}; choose one of {', '.join(TIER_TYPES)}")
        options = {k: v for k, v in d.items() if k not in _CONNECTOR_KEYS}
        if kind == "mooncake":
            # an engine mounts no segment by default: objects live on the store hosts and outlive the engine
            options.setdefault("global_segment_size", 0)
        return cls(kind, d.get("save"), options)


_KEYS = {"tiers", "load_mode", "window_chunks", "pipeline_depth", "fetch_timeout_s", "backend", "salt", "model_id",
         "save", "save_window_chunks", "report_path", "chunk_tokens", "agree_timeout_s", "restore_budget_bytes",
         "max_concurrent_restores", "save_staging_chunks", "shutdown_timeout_s"}
LOAD_MODES = ("async", "sync")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorConfig:
    tiers: tuple[TierSpec, ...]
    # "async": loads run on the connector's loader threads while the engine keeps stepping; the request
    # waits (WAITING_FOR_REMOTE_KVS) and failures are reported per request (failed_recving). "sync": loads
    # run on the step thread before the forward (every other request waits), failures by block id (one
    # KV-cache group only); kept for comparison. "auto" (earlier default) is read as "async".
    load_mode: str = "async"
    window_chunks: int = 32  # W
    pipeline_depth: int | None = None  # None: the first tier's preferred depth (Tier.preferred_pipeline_depth)
    fetch_timeout_s: float = 30.0
    backend: str = "auto"
    salt: str = ""  # tenant of this engine (a request's cache_salt is added to it)
    model_id: str | None = None  # default: a digest of the served checkpoint's weights (model_identity.py)
    save: bool = True  # store complete prompt chunks after prefill
    save_window_chunks: int | None = None  # staging of the store path (default W)
    report_path: str | None = None  # append one JSON line per load and save (both roles, all ranks)
    chunk_tokens: int = 256
    agree_timeout_s: float = 30.0
    restore_budget_bytes: int | None = None  # B: staging shared by concurrent restores (default W*c)
    max_concurrent_restores: int = 8  # loader threads (restores beyond wait for one)
    save_staging_chunks: int | None = None  # staging of saves waiting for their puts (default: two steps' chunks)
    shutdown_timeout_s: float = 30.0  # how long shutdown waits for loads and saves in flight
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
        if cfg.load_mode == "auto":
            log.warning('BSR connector: load_mode "auto" is deprecated, read as "async" (loads off the step thread)')
            cfg = dataclasses.replace(cfg, load_mode="async")
        if cfg.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be async or sync, got {cfg.load_mode!r}")
        if isinstance(cfg.window_chunks, bool) or not isinstance(cfg.window_chunks, int) or cfg.window_chunks < 0:
            raise ValueError(f"window_chunks must be an integer >= 0, got {cfg.window_chunks!r}")
        return cfg

    def restore_config(self, tiers: Sequence[Tier]) -> RestoreConfig:
        """The restores' configuration; without a configured pipeline depth the first (planning) tier's
        preferred one: 1 for Mooncake over tcp and LMCache, 2 for the filesystem."""
        depth = self.pipeline_depth if self.pipeline_depth is not None else tiers[0].preferred_pipeline_depth
        return RestoreConfig(prefetch_window_chunks=self.window_chunks, pipeline_depth=depth,
                             fetch_timeout_s=self.fetch_timeout_s, backend=self.backend)

    @property
    def load_async(self) -> bool:
        return self.load_mode == "async"

    @property
    def save_tiers(self) -> list[int]:
        out = [i for i, t in enumerate(self.tiers) if t.save or (t.save is None and i == 0)]
        return out if self.save else []


def open_tiers(cfg: ConnectorConfig, reg: Registration, stack: contextlib.ExitStack) -> list[Tier]:
    """Open every configured tier (the one tier factory; LMCache through its integration);
    `stack` closes them."""
    tiers: list[Tier] = []
    for spec in cfg.tiers:
        if spec.type.startswith("lmcache-"):
            from ..lmcache.tier import open_lmcache_tier

            tiers.append(stack.enter_context(open_lmcache_tier(reg, spec.type, spec.options)))
            continue
        options = dict(spec.options)
        if spec.type == "filesystem" and options.get("root"):
            os.makedirs(options["root"], exist_ok=True)
        tier = make_tier(reg, {"type": spec.type, **options})
        stack.callback(tier.close)
        tiers.append(tier)
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
