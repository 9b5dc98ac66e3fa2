"""Open a tier by name for the CLI and the benchmarks, starting what it needs and stopping it after.

- filesystem: a FilesystemTier under --root (or a temporary directory removed afterwards)
- mooncake: a MooncakeTier; with --mooncake-master it talks to an existing master, otherwise a
  mooncake_master and a standalone store host (mooncake_client) are started on 127.0.0.1 and
  stopped afterwards, so restored bytes cross TCP as from an external store host.
- lmcache-filesystem / lmcache-mooncake: LMCache's own storage stack (StorageManager with a DRAM L1 and
  the filesystem or Mooncake L2 adapter) as a tier: bsr_runtime.integrations.lmcache's LMCacheTier,
  opened from its tier spec as the vLLM connector opens it (open_lmcache_tier).
- any other registered tier type (bsr_runtime/tiers/registry.py): opened from its spec, {"type": name} and
  the options given (`bsr --tier NAME --tier-option KEY=VALUE`), as the connector opens it; nothing is
  started for it.

Result records keep the tier name they were written with (fs and lmcache-fs before 2026-12-03).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bsr_kernels import Registration
from bsr_runtime.tiers import registry
from bsr_runtime.tiers.base import Tier, TierUnavailableError
from bsr_runtime.tiers.factory import make_tier

from .native_log import redirected

TIER_NAMES = ("filesystem", "mooncake", "lmcache-filesystem", "lmcache-mooncake")  # what the harness starts


def known_tier_names() -> tuple[str, ...]:
    """Every tier the harness opens: its own four, then the other registered tier types."""
    return (*TIER_NAMES, *(n for n in registry.tier_type_names() if n not in TIER_NAMES))


@dataclass
class TierOptions:
    name: str = "filesystem"
    root: str | None = None  # filesystem tiers: keep objects here instead of a temporary directory
    load_concurrency: int | None = None
    mooncake_master: str | None = None  # HOST:PORT of an existing master
    metadata_server: str | None = None  # its metadata server URL (default http://HOST:8080/metadata)
    segment_bytes: int = 1 << 30  # store-host segment when we start our own
    protocol: str = "tcp"
    options: dict = field(default_factory=dict)  # another registered tier type's spec options


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--mooncake-master must be HOST:PORT, got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except OSError as e:
        raise TierUnavailableError(f"Mooncake master {address} does not answer: {e.strerror or e}") from None


@contextlib.contextmanager
def open_tier(opts: TierOptions, reg: Registration, *, capacity_bytes: int = 0,
              l1_bytes: int | None = None) -> Iterator[Tier]:
    """Yield a ready tier; everything started or written here is stopped/removed on exit. `l1_bytes`:
    LMCache's L1 (lmcache-*; default the tier spec's)."""
    if opts.options and opts.name in TIER_NAMES:
        raise ValueError(f"tier options {sorted(opts.options)} are for registered tier types without options of "
                         f"their own here; {opts.name} takes the command's flags")
    if opts.name.startswith("lmcache-"):
        with _lmcache_tier(opts, reg, l1_bytes, capacity_bytes) as tier:
            yield tier
    elif opts.name == "filesystem":
        tmp = None
        root = opts.root
        if root is None:
            tmp = tempfile.mkdtemp(prefix="bsr-fs-")
            root = tmp
        elif not Path(root).is_dir():
            raise ValueError(f"filesystem tier root {root} does not exist or is not a directory")
        try:
            with make_tier(reg, {"type": "filesystem", "root": root, "load_concurrency": opts.load_concurrency}) as t:
                yield t
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    elif opts.name == "mooncake":
        with _mooncake_endpoints(opts, capacity_bytes) as (master_address, metadata, segment):
            with redirected():  # the Mooncake client's glog lines go to the native log
                tier = make_tier(reg, {"type": "mooncake", "master_address": master_address,
                                       "metadata_server": metadata, "protocol": opts.protocol,
                                       "global_segment_size": segment})
            try:
                yield tier
            finally:
                with redirected():
                    tier.close()
    else:  # another registered type (the registry's one-line error for an unknown one)
        with registry.open_tier(reg, {**opts.options, "type": opts.name}) as tier:
            yield tier


@contextlib.contextmanager
def _mooncake_endpoints(opts: TierOptions, capacity_bytes: int) -> Iterator[tuple[str, str, int]]:
    """(master address, metadata server, client segment bytes): an existing master, or one we
    start with a store host."""
    from bsr_harness.mooncake_launcher import MooncakeMaster
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    if opts.mooncake_master:
        _check_reachable(opts.mooncake_master)
        host = opts.mooncake_master.rpartition(":")[0]
        yield (opts.mooncake_master, opts.metadata_server or f"http://{host}:8080/metadata",
               max(opts.segment_bytes, capacity_bytes))
        return
    segment = max(opts.segment_bytes, int(capacity_bytes * 1.25) + (256 << 20))
    with MooncakeMaster() as master, MooncakeStoreHost(master, segment, wait_forgotten=False):  # master stops next
        yield master.master_address, master.metadata_server, 0


@contextlib.contextmanager
def _lmcache_tier(opts: TierOptions, reg: Registration, l1_bytes: int | None, capacity_bytes: int) -> Iterator[Tier]:
    """An LMCacheTier with the filesystem ("lmcache-filesystem") or Mooncake ("lmcache-mooncake") L2 adapter."""
    from bsr_runtime.integrations.lmcache.tier import open_lmcache_tier

    with contextlib.ExitStack() as stack:
        options: dict = {} if l1_bytes is None else {"l1_bytes": l1_bytes}
        if opts.name == "lmcache-filesystem":
            root = opts.root
            if root is None:
                root = tempfile.mkdtemp(prefix="bsr-lmcache-filesystem-")
                stack.callback(shutil.rmtree, root, True)
            elif not Path(root).is_dir():
                raise ValueError(f"filesystem tier root {root} does not exist or is not a directory")
            options.update(root=root, load_concurrency=opts.load_concurrency)
        elif opts.name == "lmcache-mooncake":
            master, metadata, segment = stack.enter_context(_mooncake_endpoints(opts, capacity_bytes))
            options.update(master_address=master, metadata_server=metadata, global_segment_size=segment,
                           protocol=opts.protocol)
        else:
            raise ValueError(f"unknown tier {opts.name!r}; choose one of {', '.join(TIER_NAMES)}")
        with redirected():  # its Mooncake L2 client logs like the Mooncake tier's
            tier = stack.enter_context(open_lmcache_tier(reg, opts.name, options))
        yield tier
