"""The connector's configuration: `kv_connector_extra_config` of vLLM's KVTransferConfig.

    {"tiers": [{"type": "filesystem", "root": "/ssd/bsr"},
               {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata"},
               {"type": "lmcache-fs", "root": "/ssd/lmcache"}],
     "window_chunks": 32, "pipeline_depth": null, "fetch_timeout_s": 30, "salt": "", "model_id": null,
     "save": true, "report_path": null}

Tier options are those of the tier factory (bsr_runtime/tiers/factory.py); a Mooncake tier
mounts no segment unless `global_segment_size` says so (the objects live on the store hosts).
Tiers are tried in the listed order (plan on the first tier holding the longest prefix, fallback
to the next one holding the same prefix on a failure). Saves go to the tiers whose spec has
`"save": true` (default: the first tier only). Unknown keys are errors, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bsr_kernels import Registration

from ...diagnostics import report_writer
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
         "save", "save_window_chunks", "report_path", "chunk_tokens", "agree_timeout_s"}


@dataclass(frozen=True)
class ConnectorConfig:
    tiers: tuple[TierSpec, ...]
    # "sync": loads before the step's forward, failures reported by block id; "async": the request
    # waits for the load (WAITING_FOR_REMOTE_KVS), failures reported per request (failed_recving);
    # "auto": sync with one KV-cache group, async with several (vLLM maps block ids to requests only
    # with one group)
    load_mode: str = "auto"
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
        if cfg.load_mode not in ("auto", "sync", "async"):
            raise ValueError(f"load_mode must be auto, sync or async, got {cfg.load_mode!r}")
        if isinstance(cfg.window_chunks, bool) or not isinstance(cfg.window_chunks, int) or cfg.window_chunks < 0:
            raise ValueError(f"window_chunks must be an integer >= 0, got {cfg.window_chunks!r}")
        return cfg

    def restore_config(self, tiers: Sequence[Tier]) -> RestoreConfig:
        """The restores' configuration; without a configured pipeline depth the first (planning) tier's
        preferred one: 1 for Mooncake over tcp and LMCache, 2 for the filesystem."""
        depth = self.pipeline_depth if self.pipeline_depth is not None else tiers[0].preferred_pipeline_depth
        return RestoreConfig(prefetch_window_chunks=self.window_chunks, pipeline_depth=depth,
                             fetch_timeout_s=self.fetch_timeout_s, backend=self.backend)

    def load_async(self, num_groups: int) -> bool:
        return self.load_mode == "async" or (self.load_mode == "auto" and num_groups > 1)

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
    """Append one JSON line to the connector's report file (no-op without one); never raises: a
    failure is counted and logged once (bsr_runtime.diagnostics.ReportWriter)."""
    report_writer(path).write(record)
