"""Open a tier by name for the CLI and the benchmarks, starting what it needs and stopping it after.

- fs: a FilesystemTier under --root (or a temporary directory removed afterwards)
- mooncake: a MooncakeTier; with --mooncake-master it talks to an existing master, otherwise a
  mooncake_master and a standalone store host (mooncake_client) are started on 127.0.0.1 and
  stopped afterwards, so restored bytes cross TCP as from an external store host.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bsr_kernels import Registration

from .tiers.base import Tier, TierUnavailableError

TIER_NAMES = ("fs", "mooncake")


@dataclass
class TierOptions:
    name: str = "fs"
    root: str | None = None  # fs: keep objects here instead of a temporary directory
    load_concurrency: int | None = None
    mooncake_master: str | None = None  # HOST:PORT of an existing master
    metadata_server: str | None = None  # its metadata server URL (default http://HOST:8080/metadata)
    segment_bytes: int = 1 << 30  # store-host segment when we start our own
    protocol: str = "tcp"


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
def open_tier(opts: TierOptions, reg: Registration, *, capacity_bytes: int = 0) -> Iterator[Tier]:
    """Yield a ready tier; everything started or written here is stopped/removed on exit."""
    if opts.name == "fs":
        from .tiers.filesystem import FilesystemTier

        tmp = None
        root = opts.root
        if root is None:
            tmp = tempfile.mkdtemp(prefix="bsr-fs-")
            root = tmp
        elif not Path(root).is_dir():
            raise ValueError(f"filesystem tier root {root} does not exist or is not a directory")
        try:
            with FilesystemTier(root, reg.chunk_bytes, reg.fingerprint, load_concurrency=opts.load_concurrency) as t:
                yield t
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    elif opts.name == "mooncake":
        from .mooncake_master import MooncakeMaster, MooncakeStoreHost
        from .tiers.mooncake import MooncakeTier

        with contextlib.ExitStack() as stack:
            if opts.mooncake_master:
                _check_reachable(opts.mooncake_master)
                master_address = opts.mooncake_master
                host = master_address.rpartition(":")[0]
                metadata = opts.metadata_server or f"http://{host}:8080/metadata"
                segment = 0 if capacity_bytes == 0 else max(opts.segment_bytes, capacity_bytes)
            else:
                master = stack.enter_context(MooncakeMaster())
                segment_bytes = max(opts.segment_bytes, int(capacity_bytes * 1.25) + (256 << 20))
                stack.enter_context(MooncakeStoreHost(master, segment_bytes))
                master_address, metadata, segment = master.master_address, master.metadata_server, 0
            tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, master_address, metadata,
                                protocol=opts.protocol, global_segment_size=segment)
            stack.callback(tier.close)
            yield tier
    else:
        raise ValueError(f"unknown tier {opts.name!r}; choose one of {', '.join(TIER_NAMES)}")
