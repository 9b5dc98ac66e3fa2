"""An engine connector's configuration, engine-neutral (imports no engine): for vLLM, the
`kv_connector_extra_config` of its KVTransferConfig (integrations/vllm/); a second engine's adapter reads
the same mapping and opens the same tiers.

    {"tiers": [{"type": "filesystem", "root": "/ssd/bsr"},
               {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata"},
               {"type": "lmcache-filesystem", "root": "/ssd/lmcache"}],
     "window_chunks": 32, "restore_budget_bytes": null, "load_mode": "async", "save": true,
     "restore_partial_chunk": true, "salt": "", "model_id": null, "report_path": null,
     "timeouts": {"fetch_s": 30, "probe_s": 5, ...}, "tuning": {"pipeline_depth": null, ...}}

Tier options are those of the tier's registered type (bsr_runtime/tiers/registry.py: the built-in
ones' in tiers/specs.py, LMCache's in integrations/lmcache/specs.py); a Mooncake tier mounts no
segment unless `global_segment_size` says so (the objects live on the store hosts). Tiers are tried
in the listed order (plan on the first tier holding the longest prefix, fallback to the next one
holding the same prefix on a failure). Saves go to the tiers whose spec has `"save": true`
(default: the first tier only).

The whole mapping is checked by one schema (ConnectorConfig, tier specs by their type's schema:
bsr_runtime/config_schema.py) when the connector is built, before the engine starts: wrong types
("256" for an integer), values out of range and unknown keys are one ValueError naming every bad
key, so a typo never silently falls back to a default or turns saves and loads off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from bsr_kernels import Registration
from bsr_kernels.registration import MAX_CHUNK_TOKENS

from .config_schema import (
    Backend,
    ConfigError,
    HostBytes,
    Name,
    OutputFile,
    Schema,
    Seconds,
    Text,
    problems,
    raise_problems,
    short_repr,
)
from .diagnostics import report_writer
from .restore import MAX_WINDOW_CHUNKS, RestoreConfig
from .tiers.base import Tier
from .tiers.registry import tier_type, tier_type_names

WHAT = "BSR connector: kv_connector_extra_config"

Window = Annotated[int, Field(ge=0, le=MAX_WINDOW_CHUNKS)]  # W in chunks; 0 = the whole plan
SaveWindow = Annotated[int, Field(ge=1, le=MAX_WINDOW_CHUNKS)]
ChunkTokens = Annotated[int, Field(ge=1, le=MAX_CHUNK_TOKENS)]
Depth = Annotated[int, Field(ge=1, le=2)]


class TierSpec(Schema):
    """One tier of the connector: `type` (a registered tier type, bsr_runtime/tiers/registry.py), whether saves
    go to it, and its options, checked by that type's schema (an integration's schema, LMCache's, is imported
    only when such a tier is listed)."""

    type: str
    save: bool | None = None  # None: the first tier saves, the others do not
    options: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def check(cls, d: object, where: str) -> tuple[TierSpec | None, list[str]]:
        """(the spec, []) or (None, every problem of `d`, each prefixed with `where`)."""
        if not isinstance(d, Mapping):
            return None, [f"{where}: a tier spec is a mapping with a 'type', got {type(d).__name__}"]
        kind = d.get("type")
        if not isinstance(kind, str) or kind not in tier_type_names():
            return None, [f"{where}.type: unknown tier type {short_repr(kind)}; "
                          f"choose one of {', '.join(tier_type_names())}"]
        t = tier_type(kind)
        options = {**t.engine_defaults, **{k: v for k, v in d.items() if k not in ("type", "save")}}
        bad = problems(t.load_schema(), {"type": kind, **options}, where)
        if "save" in d and not (d["save"] is None or isinstance(d["save"], bool)):
            bad.append(f"{where}.save: must be true, false or null (got {short_repr(d['save'])})")
        return (None, bad) if bad else (cls(type=kind, save=d.get("save"), options=options), [])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierSpec:
        """One checked tier spec (ConnectorConfig.from_extra checks them all at once)."""
        spec, bad = cls.check(d, "tier")
        if bad:
            raise_problems(WHAT, bad)
        return spec


class Timeouts(Schema):
    """How long each wait of the connector may take (`timeouts` in the config); past it, what waited fails
    closed (a load, a save at shutdown) or misses (a lookup): no wait is unbounded."""

    fetch_s: Seconds = 30.0  # one window's reads
    # how long a load's window waits for staging from the budget B before the load fails closed (staging a
    # late read still holds comes back when the read lands; a read that never lands must not hold loads)
    staging_wait_s: Seconds = 30.0
    agree_s: Seconds = 30.0  # TP ranks agreeing on a plan or a commit
    # a request's tier lookup that has not answered within this is a miss (the request prefills locally):
    # a probe hung in one tier never holds the request, nor (each lookup has its own thread) any other
    probe_s: Seconds = 5.0
    shutdown_s: Seconds = 30.0  # how long shutdown waits for loads and saves in flight


class Tuning(Schema):
    """Knobs with working defaults (`tuning` in the config): how restores are pipelined, threaded and
    staged, what a chunk is."""

    pipeline_depth: Depth | None = None  # None: the first tier's preferred depth at W (Tier.preferred_pipeline_depth)
    backend: Backend = "auto"  # the install backend (bsr_kernels/backends.py)
    chunk_tokens: ChunkTokens = 256
    max_concurrent_restores: Annotated[int, Field(ge=1, le=1024)] = 8  # loader threads
    # staging replaced (B bytes more each, until its reads land) when reads that never land leave B no room
    # for a window; past this many, such loads fail at once until the reads land (bsr_runtime/loader.py)
    max_staging_retirements: Annotated[int, Field(ge=0, le=64)] = 2
    save_staging_chunks: SaveWindow | None = None  # staging of saves whose puts run (default: two steps' chunks)
    # with background loads, how long the step that first asks for a request's lookup waits for it
    # (once per request; 0: never): a probe thread that shares the interpreter with the engine's step
    # takes several times longer, and the request then waits for a later step
    probe_wait_s: Seconds = 0.05
    # with background loads, how long the step that starts loads waits for their loader threads to begin
    # (once per load; 0: never): a woken loader thread otherwise waits for the interpreter behind the step's
    # own Python, up to several ms, and the request waits with it
    load_start_wait_s: Annotated[float, Field(ge=0, le=0.1, allow_inf_nan=False)] = 0.002
    # a tier that could not be reached (TierUnavailableError: its Mooncake master down) is neither probed nor
    # read for this long, so a dead store costs one failure, not one per request; once it passes, the next
    # request probes it again (a restarted master is found then). A lost store host is not this: the tier
    # stays in use and only that host's objects miss
    unavailable_cooldown_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 30.0
    # with background loads, the interpreter's switch interval (sys.setswitchinterval; Python's default is
    # 5 ms): each time a loader thread needs the GIL back while the step thread runs Python it can wait one
    # interval, several times per window; a shorter one lets restores finish near their standalone time.
    # null leaves the interpreter's setting alone
    gil_switch_interval_s: Annotated[float, Field(ge=0.0001, le=0.1, allow_inf_nan=False)] | None = 0.0005


class ConnectorConfig(Schema):
    """kv_connector_extra_config, checked as a whole by `from_extra`. One line per key; the waits' bounds in
    `timeouts`, the knobs with working defaults in `tuning`."""

    tiers: tuple[TierSpec, ...] = Field(min_length=1)
    window_chunks: Window = 32  # W
    # B: staging shared by concurrent restores (default W*c); at most the machine's memory, since
    # the arena is allocated (and touched) when the engine starts
    restore_budget_bytes: Annotated[HostBytes, Field(ge=1)] | None = None
    # "async": loads run on the connector's loader threads while the engine keeps stepping; the request
    # waits (WAITING_FOR_REMOTE_KVS), failures are reported per request (failed_recving). "sync": loads run
    # on the step thread before the forward (every other request waits), failures by block id (one
    # KV-cache group only); kept for comparison.
    load_mode: Literal["sync", "async"] = "async"
    save: bool = True  # store complete prompt chunks after prefill
    # restore up to the last whole block before a prompt's last token, as vLLM's own prefix cache does
    # (prompts' partial chunks stored as objects of their own); False: whole chunks only (the restored prefix
    # then ends on a chunk boundary, where a cold prefill of 256-token steps also stops: bit-identical)
    restore_partial_chunk: bool = True
    salt: Text = ""  # tenant of this engine (a request's cache_salt is added to it)
    model_id: Name | None = None  # default: a digest of the served checkpoint's weights (model_identity.py)
    report_path: OutputFile | None = None  # append one JSON line per load and save (both roles, all ranks)
    timeouts: Timeouts = Timeouts()
    tuning: Tuning = Tuning()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """The checked config; one ConfigError (a ValueError) naming every bad key otherwise, before
        anything opens."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{WHAT}: expected a mapping of keys, got {type(extra).__name__}")
        extra = dict(extra or {})
        tiers = extra.get("tiers")
        specs, bad = [], []
        if not isinstance(tiers, (list, tuple)) or not tiers:
            bad.append(f"tiers: needs 'tiers', a non-empty list of tier specs (got {short_repr(tiers)})")
        else:
            for i, t in enumerate(tiers):
                spec, spec_bad = TierSpec.check(t, f"tiers[{i}]")
                specs.append(spec)
                bad += spec_bad
        rest = {k: v for k, v in extra.items() if k != "tiers"}
        top = problems(cls, {"tiers": tuple(specs) if specs and not bad else (_PLACEHOLDER,), **rest})
        bad += [p for p in top if not p.startswith("tiers")]
        if bad:
            raise_problems(WHAT, bad)
        cfg = cls.model_validate({"tiers": tuple(specs), **rest})
        if cfg.window_chunks == 0 and cfg.load_mode == "async":
            raise_problems(WHAT, ['window_chunks: 0 (the whole plan staged at once) is for load_mode "sync" only; '
                                  "background loads stage windows of W > 0 chunks"])
        return cfg

    def restore_config(self, tiers: Sequence[Tier]) -> RestoreConfig:
        """The restores' configuration; without a configured pipeline depth the first (planning) tier's
        preferred one for windows of W chunks: 2 for the filesystem, for LMCache and Mooncake over tcp
        by the window's size (tiers/base.py: depth_by_window)."""
        depth = self.tuning.pipeline_depth
        if depth is None:
            depth = tiers[0].preferred_pipeline_depth(self.window_chunks * tiers[0].chunk_bytes)
        return RestoreConfig(window_chunks=self.window_chunks, pipeline_depth=depth,
                             fetch_timeout_s=self.timeouts.fetch_s, backend=self.tuning.backend,
                             admission_timeout_s=self.timeouts.staging_wait_s)

    @property
    def load_async(self) -> bool:
        return self.load_mode != "sync"

    @property
    def save_tiers(self) -> list[int]:
        out = [i for i, t in enumerate(self.tiers) if t.save or (t.save is None and i == 0)]
        return out if self.save else []


# stands for the tier list while the other keys are checked (the tier list's own problems are reported apart)
_PLACEHOLDER = TierSpec(type="filesystem")


def open_tiers(cfg: ConnectorConfig, reg: Registration, stack: contextlib.ExitStack) -> list[Tier]:
    """Open every configured tier (its registered type's opener); `stack` closes them. A directory a
    tier type names (a filesystem root) is created where it is missing."""
    tiers: list[Tier] = []
    for i, spec in enumerate(cfg.tiers):
        t = tier_type(spec.type)
        if t.directory_option is not None:
            make_root(f"tiers[{i}].{t.directory_option}", spec.options[t.directory_option])
        tiers.append(stack.enter_context(t.open(reg, spec.options)))
    return tiers


ROOT_SHOWN_CHARS = 1024  # a path is shown whole up to here (cut beyond: the error stays one line)


def make_root(key: str, root: str) -> None:
    """The directory `root` of the config key `key`, created with its parents where missing; one line
    naming the key and the path where it cannot be created or written (was: an OSError from
    os.makedirs, deep in the engine's start-up)."""
    path = short_repr(root, ROOT_SHOWN_CHARS)
    try:
        os.makedirs(root, exist_ok=True)
        problem = None if os.access(root, os.W_OK | os.X_OK) else f"the directory {path} is not writable"
    except OSError as e:
        problem = f"cannot create the directory {path} ({e.strerror or type(e).__name__})"
    if problem:  # raised outside the except: the OSError's traceback is not chained onto the line
        raise_problems(WHAT, [f"{key}: {problem}"])


def write_report(path: str | None, record: dict[str, Any]) -> None:
    """Append one JSON line to the connector's report file (no-op without one); never raises: a
    failure is counted and logged once (bsr_runtime.diagnostics.ReportWriter)."""
    report_writer(path).write(record)
