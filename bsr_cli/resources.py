"""Refuse work that cannot fit in this machine's memory or disk before anything is allocated."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .args import CliError
from .output import human_bytes

TOKEN_ID_BYTES = 40  # a Python int token id in a list: the object and its slot


MEMORY_HEADROOM = 0.9  # use at most this share of the available memory


def kv_bytes(reg, num_chunks: int) -> int:
    """Bytes of the destination tensors that hold `num_chunks` chunks (Registration.allocate)."""
    tokens = num_chunks * reg.chunk_tokens
    return sum(reg.blocks_needed(s.group, tokens) * s.block_size * s.entry_bytes for s in reg.specs)


def available_memory() -> int:
    """Memory this process may still use: MemAvailable, capped by a cgroup (v2) limit."""
    avail = None
    with contextlib.suppress(ImportError):
        import psutil

        avail = psutil.virtual_memory().available
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    return max(0, avail)


def require_memory(what: str, parts: dict[str, int]) -> None:
    """Raise CliError when `parts` (label -> bytes) do not fit in the available memory."""
    need = sum(parts.values())
    avail = available_memory()
    if need > avail * MEMORY_HEADROOM:
        detail = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
        raise CliError(f"{what} needs about {human_bytes(need)} of memory ({detail}) but {human_bytes(avail)} is "
                       "available here; use shorter --tokens, a smaller --window-chunks or a smaller --scale")


def require_disk(what: str, root: str | None, need: int) -> None:
    path = root or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path).free
        if need > free * MEMORY_HEADROOM:
            raise CliError(f"{what} needs about {human_bytes(need)} of disk in {path} but {human_bytes(free)} is "
                           "free; use shorter --tokens or a smaller --scale")


def tier_bytes(reg, tier_names: list[str], num_chunks: int, l1_chunks: int = 0) -> int:
    """Memory a tier holding `num_chunks` objects takes here (Mooncake segments, LMCache's L1)."""
    c = reg.chunk_bytes
    mem = 0
    for name in tier_names:
        if name.endswith("mooncake"):
            mem = max(mem, num_chunks * c)
        if name.startswith("lmcache-"):
            mem = max(mem, (l1_chunks + 2) * (c + 4096) + (num_chunks * c if name.endswith("mooncake") else 0))
    return mem


def require_tier_disk(reg, tier_names: list[str], num_chunks: int, root: str | None) -> None:
    if any(name.endswith("filesystem") for name in tier_names):
        require_disk("this run", root, num_chunks * (reg.chunk_bytes + 4096))


def check_sweep_fits(args, reg, tier_names: list[str], max_chunks: int, windows: list[int]) -> None:
    c, kv = reg.chunk_bytes, kv_bytes(reg, max_chunks)
    staging = sum(w * c for w in windows if w) + (max_chunks * c if 0 in windows else 0)
    l1 = max_chunks if 0 in windows else max(windows)
    require_memory("this run", {
        "source state": kv, "destinations": kv, "token ids": max_chunks * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": staging + min(32, max_chunks) * c, "tier": tier_bytes(reg, tier_names, max_chunks, l1)})
    require_tier_disk(reg, tier_names, max_chunks, args.root)
