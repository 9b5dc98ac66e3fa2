"""Fault scenarios for the fault matrix: the faults, where they are armed, and the source data.

Fault injection used here (a FaultyTier around the Mooncake tier, its FaultPlan armed per
scenario, plus):
- `arm_install_fault(retriever, window)`: raise during the install of window k
- `FetchCallHook`: run an action (kill the master, raise) when fetch number k starts
- `FaultSpec.rank`: a fault that applies to one TP rank only (`applies_to(rank)`)

Each scenario arms its fault at one point of the request's lifecycle: `ARM_AT_PROBE` before
the lookup, `ARM_BEFORE_LOAD` after the lookup and allocation, before the load.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bsr_harness.faulty_installer import InstallFault
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.standalone_connector import StandaloneConnector
from bsr_harness.testdata import block_tables
from bsr_kernels import Registration, WindowInstaller, presets
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.retrieve import Retriever
from bsr_runtime.state_hash import state_hash
from bsr_runtime.store import store_prefix
from bsr_runtime.tiers.base import Tier, TierError
from bsr_runtime.tiers.filesystem import HEADER_SIZE, FilesystemTier, pack_header

FETCH, INSTALL = "fetch", "install"


class InjectedFault(TierError):
    """A fault raised on purpose by a fault hook (a TierError: the restore fails closed)."""


# -- hooks -------------------------------------------------------------------------------------
class FetchCallHook:
    """A FaultPlan.fail_fetch hook: runs `action(call_index, keys)` on every fetch call from
    `at_call` on (call 0 = the first window's fetch); `once` limits it to that call."""

    def __init__(self, at_call: int, action: Callable[[int, Sequence[str]], None], once: bool = True) -> None:
        self.at_call = at_call
        self.action = action
        self.once = once
        self.calls = 0
        self.fired = 0
        self._lock = threading.Lock()

    def __call__(self, keys: Sequence[str]) -> None:
        with self._lock:
            i = self.calls
            self.calls += 1
        if i == self.at_call or (not self.once and i > self.at_call):
            self.fired += 1
            self.action(i, keys)


def raise_injected(call: int, keys: Sequence[str]) -> None:
    raise InjectedFault(f"injected fetch failure at fetch call {call} ({len(keys)} objects)")


def arm_install_fault(retriever: Retriever, window: int, once: bool = True) -> None:
    """Make the install of window `window` raise InjectedInstallError: in the next restore that
    reaches it only (`once`, a transient fault: a fallback restore then installs cleanly), or
    in every restore."""
    retriever.restorer.make_installer = InstallFault(window, once).make


@dataclass(frozen=True)
class FaultSpec:
    """A fault point: `phase` (fetch | install) of `window`, on TP rank `rank` (None: every rank)."""

    window: int
    phase: str = FETCH
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in (FETCH, INSTALL):
            raise ValueError(f"phase must be {FETCH!r} or {INSTALL!r}, got {self.phase!r}")

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def arm(self, retriever: Retriever, tier: FaultyTier, rank: int = 0) -> None:
        """Arm this fault on `tier` / `retriever` if it applies to `rank`: fetch call k of the
        next restore from `tier` is window k at any pipeline depth (windows are submitted in
        order); an install fault fires once (see arm_install_fault)."""
        if not self.applies_to(rank):
            return
        if self.phase == FETCH:
            tier.plan.fail_fetch = FetchCallHook(self.window, raise_injected)
        else:
            arm_install_fault(retriever, self.window)


def disarm(retriever: Retriever, tiers: Sequence[Tier]) -> None:
    """Disarm the install fault and every FaultyTier among `tiers` (repairing what they damaged)."""
    retriever.restorer.make_installer = WindowInstaller
    for t in tiers:
        if isinstance(t, FaultyTier):
            t.clear()


# -- source state ------------------------------------------------------------------------------
@dataclass
class Source:
    """A prefix stored in some tiers: its tokens, keyspace and canonical state hash."""

    reg: Registration
    tokens: list[int]
    keyspace: KeySpace
    num_chunks: int
    state_hash: str
    kv: list[torch.Tensor] = field(repr=False)
    tables: list[torch.Tensor] = field(repr=False)

    def keys(self, first: int = 0, n: int | None = None) -> list[str]:
        n = self.num_chunks - first if n is None else n
        return PrefixKeys(self.keyspace, self.tokens, self.reg.chunk_tokens).window(first, n)

    def hash_of(self, num_chunks: int) -> str:
        return state_hash(self.reg, self.kv, self.tables, num_chunks)


def random_kv(reg: Registration, blocks: Sequence[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = reg.allocate(list(blocks))
    for t in kv:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(1, 255, (flat.numel(),), dtype=torch.uint8, generator=gen))
    return kv


def make_source(reg: Registration, num_chunks: int, seed: int, salt: str = "", tp_rank: int = 0,
                tp_world: int = 1, extra_tokens: int = 1, kv_seed: int | None = None) -> Source:
    """A random prefix of num_chunks chunks (+ extra_tokens prompt tokens beyond it) held in
    random source blocks; store it with `store(source, tier)`. The tokens depend on `seed`
    only, the state also on `kv_seed` (TP ranks: same request, different state per rank)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_chunks * reg.chunk_tokens + extra_tokens,), generator=gen).tolist()
    blocks, (tables,) = block_tables(reg, [num_chunks], seed + 1)
    kv = random_kv(reg, blocks, seed + 2 if kv_seed is None else kv_seed)
    space = KeySpace(reg.fingerprint, tp_rank, tp_world, salt)
    src = Source(reg, tokens, space, num_chunks, "", kv, tables)
    src.state_hash = src.hash_of(num_chunks)
    return src


def store(src: Source, tier: Tier, window_chunks: int = 4) -> None:
    rep = store_prefix(src.reg, tier, src.keyspace, src.tokens, src.kv, src.tables, src.num_chunks,
                       window_chunks=window_chunks, backend="torch")
    if rep.state_hash != src.state_hash:  # pragma: no cover - a gather/hash bug
        raise AssertionError(f"stored hash {rep.state_hash} != source hash {src.state_hash}")


def damage_object(scenario: str, fs: FilesystemTier, key: str, outside: Path) -> None:
    """Damage one object file of the filesystem tier in place (the damaged-data scenarios)."""
    path = Path(fs.path_of(key))
    if scenario == "ssd_truncated_object":
        os.truncate(path, path.stat().st_size // 2)
    elif scenario == "ssd_flipped_byte":
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif scenario == "ssd_foreign_header":  # a valid header of another registration (MTP on)
        data = bytearray(path.read_bytes())
        other = presets.dsv4_flash(mtp=True, scale=1 / 64).fingerprint[:32].encode()
        data[:HEADER_SIZE] = pack_header(other, bytes(data[64:96]), len(data) - HEADER_SIZE,
                                         int.from_bytes(data[6:8], "little"), int.from_bytes(data[24:28], "little"))
        path.write_bytes(bytes(data))
    elif scenario == "ssd_directory_in_place":
        path.unlink()
        path.mkdir()
    elif scenario == "ssd_symlink_out_of_root":  # valid-looking bytes outside the root
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)
    else:
        raise ValueError(f"{scenario!r} is not a damaged-data scenario")


# the prefix lives only on the filesystem (SSD) tier; one object is damaged after the probe
DAMAGE_SCENARIOS = (
    "ssd_truncated_object",
    "ssd_flipped_byte",
    "ssd_foreign_header",
    "ssd_directory_in_place",
    "ssd_symlink_out_of_root",
)
SCENARIOS = (
    "healthy",
    "remote_unavailable_before",
    "remote_unavailable_mid",
    "remote_and_ssd_absent",
    "remote_fails_ssd_serves",
    "key_evicted_after_probe",
    "fetch_timeout",
    "corrupt_object",
    "install_exception",
    "last_window_fault",
    *DAMAGE_SCENARIOS,
)
EXPECTED = {s: "failed_closed" for s in SCENARIOS} | {"healthy": "committed", "remote_fails_ssd_serves": "committed"}


@dataclass
class Scene:
    """What a scenario's fault acts on."""

    conn: StandaloneConnector
    remote: FaultyTier
    fs: FilesystemTier
    master: object
    src: Source
    outside: Path  # a path outside the filesystem tier's root (symlink scenario)

    def key(self, chunk: int) -> str:
        return self.src.keys(min(chunk, self.src.num_chunks - 1), 1)[0]


def _last_window_fault(s: Scene) -> None:
    windows = s.conn.retriever.config.window_chunks
    s.remote.plan.fail_fetch = FetchCallHook(-(-s.src.num_chunks // windows) - 1, raise_injected)


def _kill_on_first_fetch(s: Scene) -> None:
    s.remote.plan.fail_fetch = FetchCallHook(1, lambda i, keys: s.master.kill())


ARM_AT_PROBE: dict[str, Callable[[Scene], None]] = {
    "key_evicted_after_probe": lambda s: setattr(s.remote.plan, "drop_after_probe", {s.key(2)}),
}
ARM_BEFORE_LOAD: dict[str, Callable[[Scene], None]] = {
    "remote_unavailable_before": lambda s: s.master.kill(),
    "remote_unavailable_mid": _kill_on_first_fetch,
    "remote_and_ssd_absent": lambda s: setattr(s.remote.plan, "unavailable", True),
    "remote_fails_ssd_serves": lambda s: setattr(s.remote.plan, "fail_fetch", FetchCallHook(1, raise_injected)),
    "fetch_timeout": lambda s: setattr(s.remote.plan, "delay_s", 1.5),
    "corrupt_object": lambda s: setattr(s.remote.plan, "corrupt_keys", {s.key(3)}),
    "install_exception": lambda s: arm_install_fault(s.conn.retriever, 1),
    "last_window_fault": _last_window_fault,
    **{name: (lambda s, name=name: damage_object(name, s.fs, s.key(1), s.outside)) for name in DAMAGE_SCENARIOS},
}
# RestoreConfig overrides per scenario
SCENARIO_CONFIG: dict[str, dict] = {
    "remote_unavailable_mid": {"pipeline_depth": 1},
    "remote_fails_ssd_serves": {"pipeline_depth": 1},
    "fetch_timeout": {"fetch_timeout_s": 0.5},
    "last_window_fault": {"window_chunks": 2, "pipeline_depth": 1},
}
# scenarios that stop their master get one of their own
DEDICATED_MASTER = ("remote_unavailable_before", "remote_unavailable_mid")
