"""BSR's server module for LMCache's multiprocess server (the paper's patch, out of tree).

Loaded by the stock server:

    python -m lmcache.v1.multiprocess.server --chunk-size 256 --l1-size-gb 1 \\
        --supported-transfer-mode lmcache_driven --l2-adapter '{"type":"fs","base_path":"/data/lmcache"}' \\
        --server-module '{"module_path":"bsr_runtime.integrations.lmcache.server_module",
                          "config":{"prefetch_window_chunks":32,"probe_only":true}}'

Configured by the paper's names (the `config` object of --server-module):

    prefetch_window_chunks  W: chunks a retrieve holds in L1 at once; 0 = no module, the stock
                            handlers untouched (the factory returns nothing)
    probe_only              true: LOOKUP only probes (nothing reserved); required when W > 0
    pipeline_depth          1 (default) or 2: window j+1 prefetched while window j is copied
                            (both of W chunks: a retrieve holds at most 2W chunks' objects, the
                            paper's RWS at depth 2)
    fetch_timeout_s         a window's prefetch deadline (default 30 s): a late object fails closed
    marker_ttl_s            how long a force-local marker outlives a request that never ends its
                            session (default 600 s)
    admission_timeout_s     how long a retrieve waits for the one before it (one retrieve at a time
                            holds L1; default 120 s, then it fails closed)

What it replaces: LookupModule's LOOKUP, QUERY_PREFETCH_STATUS, WAIT_PREFETCH_STATUS,
FREE_LOOKUP_LOCKS, END_SESSION (server_lookup.py) and LMCacheDrivenTransferModule's RETRIEVE
(server_retrieve.py), by registering handlers of the same names after the built-in ones (the ZMQ
transport keeps the last). Registration, STORE and everything else stay LMCache's. It refuses, with
one line, an LMCache it was not written for (server_guard.py) and a transfer mode it cannot bound
(engine_driven and auto: the worker copies from slots the stock lookup reserved, outside this
module's windows).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from bsr_runtime.config_schema import Schema, Seconds, one_line, parse

from .server_guard import IncompatibleLMCache, check_lmcache
from .server_stats import ServerStats


class ServerModuleConfig(Schema):
    """The `config` object of --server-module (unknown keys refused, one error naming every bad key)."""

    prefetch_window_chunks: Annotated[int, Field(ge=0)] = 32
    probe_only: bool = True
    pipeline_depth: Literal[1, 2] = 1
    fetch_timeout_s: Seconds = 30.0
    marker_ttl_s: Seconds = 600.0
    admission_timeout_s: Seconds = 120.0


class RefusedServerModule(ValueError):
    """The module cannot run under this server's configuration (one line naming why)."""


def check_config(cfg: ServerModuleConfig, transfer_mode: str, transport: str) -> None:
    """Refuse, with one line each, what the module cannot bound."""
    if not cfg.probe_only:
        raise RefusedServerModule(
            "BSR server module: probe_only=false with prefetch_window_chunks > 0 is refused: the stock lookup "
            "reserves L1 for the whole prefix, which the windowed retrieve exists to avoid (set probe_only=true, "
            "or prefetch_window_chunks=0 for the stock path)")
    if transfer_mode != "lmcache_driven":
        raise RefusedServerModule(
            f"BSR server module: --supported-transfer-mode {transfer_mode} is refused: in engine_driven transfer the "
            "worker copies from L1 slots the stock lookup reserved for the whole prefix, which this module cannot "
            "bound; use --supported-transfer-mode lmcache_driven")
    if transport != "zmq":
        raise RefusedServerModule(
            f"BSR server module: --transport {transport} is refused: the module replaces the lookup and retrieve "
            "handlers, which only the zmq transport lets a server module do; use --transport zmq")


def build_server_modules(build) -> list:
    """LMCache's server-module factory (ExtServerModuleBuildContext -> modules): no module at W = 0,
    else the probe-only lookup and the windowed retrieve, after the version guard. A refusal ends
    the server with its one line (SystemExit: no traceback to read it from)."""
    try:
        cfg = parse(ServerModuleConfig, dict(build.config), "BSR server module config")
        if cfg.prefetch_window_chunks == 0:
            return []  # W = 0: the stock lookup and retrieve, untouched
        check_lmcache()
        mp = build.mp_config
        check_config(cfg, mp.supported_transfer_mode, getattr(mp, "transport", "zmq"))
    except (ValueError, IncompatibleLMCache) as e:
        raise SystemExit(one_line(str(e))) from None
    return _modules(build, cfg)


def _modules(build, cfg: ServerModuleConfig) -> list:
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import LMCacheDrivenTransferModule
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    from ...markers import ForceLocalMarkers
    from .prefetch import fold_window_lines
    from .server_lookup import ProbeLookupModule
    from .server_retrieve import WindowedRetrieveModule

    stock_lookup = _one(build.modules, LookupModule)
    stock_transfer = _one(build.modules, LMCacheDrivenTransferModule)
    ctx = build.server_context
    stats, markers = ServerStats(), ForceLocalMarkers(ttl_s=cfg.marker_ttl_s)
    stats.register_gauges()
    fold_window_lines()
    return [ProbeLookupModule(ctx, stock_lookup, markers, stats, cfg.fetch_timeout_s),
            WindowedRetrieveModule(ctx, stock_transfer, markers, stats, cfg.prefetch_window_chunks,
                                   cfg.pipeline_depth, cfg.fetch_timeout_s, cfg.admission_timeout_s)]


def _one(modules, cls):
    found = [m for m in modules if isinstance(m, cls)]
    if len(found) != 1:
        raise RefusedServerModule(f"BSR server module: expected one {cls.__name__} among the server's modules, "
                                  f"found {len(found)}")
    return found[0]
