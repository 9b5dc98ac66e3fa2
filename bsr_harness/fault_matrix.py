"""The fault matrix: fail-closed scenarios against real tiers (a Mooncake master, real files).

Each scenario stores a prefix, drives one request through the BSRConnector lifecycle with a
fault armed at a chosen point (probe, fetch of window k, install of window k, the store
itself), then checks what the engine would see, re-admits the request (which must not look
the prefix up again while its force-local marker is set), admits it RUNNING (which clears
the marker), tears it down, and finally restores a healthy request through the same
connector and checks its state hash. `run_fault_matrix()` returns one `FaultRow` per
scenario (for `bsr faults`); the tests drive `FaultMatrix.run()` and check the details.

Fault injection used here (FaultPlan on the tiers, plus):
- `arm_install_fault(retriever, window)`: raise during the install of window k
- `FetchCallHook`: run an action (kill the master, raise) when fetch number k starts
- `FaultSpec.rank`: a fault that applies to one TP rank only (`applies_to(rank)`)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bsr_harness.faulty_installer import InjectedInstallError, InstallFault
from bsr_kernels import Registration, WindowInstaller, presets
from bsr_runtime.connector import BSRConnector, ConnectorRequest
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import RestoreConfig
from bsr_runtime.retrieve import LOCAL, RetrieveOutcome, Retriever
from bsr_runtime.state_hash import state_hash
from bsr_runtime.store import store_prefix
from bsr_runtime.tiers.base import Tier, TierError
from bsr_runtime.tiers.filesystem import HEADER_SIZE, FilesystemTier, pack_header

FETCH, INSTALL = "fetch", "install"


class InjectedFault(TierError):
    """A fault raised on purpose by a fault hook (a TierError: the restore fails closed)."""


# -- hooks -------------------------------------------------------------------------------------
class FetchCallHook:
    """FaultPlan.fail_fetch hook: runs `action(call_index, keys)` on every fetch call from
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

    def arm(self, retriever: Retriever, tier: Tier, rank: int = 0) -> None:
        """Arm this fault on `tier` / `retriever` if it applies to `rank`: fetch call k of the
        next restore from `tier` is window k at any pipeline depth (windows are submitted in
        order); an install fault fires once (see arm_install_fault)."""
        if not self.applies_to(rank):
            return
        if self.phase == FETCH:
            tier.faults.fail_fetch = FetchCallHook(self.window, raise_injected)
        else:
            arm_install_fault(retriever, self.window)


def disarm(retriever: Retriever, tiers: Sequence[Tier]) -> None:
    retriever.restorer.make_installer = WindowInstaller
    for t in tiers:
        t.faults.clear()


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


def make_tables(reg: Registration, num_chunks_per_request: Sequence[int], seed: int,
                spare: int = 1, holes: bool = True) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Disjoint shuffled block tables for several requests sharing one set of destination
    tensors: (blocks per group, per request the per-group tables). Groups with a sliding
    window get -1 blocks at the start of longer prefixes, as an engine marks blocks outside it."""
    gen = torch.Generator().manual_seed(seed)
    per_req: list[list[torch.Tensor]] = [[] for _ in num_chunks_per_request]
    blocks = []
    for g in range(reg.num_groups):
        needs = [reg.blocks_needed(g, n * reg.chunk_tokens) for n in num_chunks_per_request]
        total = sum(needs) + spare
        blocks.append(total)
        perm = torch.randperm(total, generator=gen)
        windowed = any(s.sliding_window for s in reg.specs if s.group == g)
        at = 0
        for i, need in enumerate(needs):
            table = perm[at : at + need].clone()
            at += need
            if holes and windowed and need > 4:
                table[: need // 3] = -1
            per_req[i].append(table)
    return blocks, per_req


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
    blocks, (tables,) = make_tables(reg, [num_chunks], seed + 1)
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


# -- the matrix --------------------------------------------------------------------------------
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
class FaultRow:
    scenario: str
    outcome: str  # "committed" | "failed_closed"
    tokens: int  # external tokens advertised at the probe
    exposed_tokens: int  # external tokens exposed after the load
    invalid_blocks: int
    total_blocks: int
    marker_set: bool
    marker_cleared: bool  # no marker left after RUNNING admission (and teardown)
    staging_leaked_bytes: int
    served_by: str
    state_hash_ok: bool  # every committed restore of the scenario (the request, the healthy one) matched
    expected: str = ""
    error: str | None = None
    windows: int = 0
    windows_installed: int = 0  # by the first (plan-tier) attempt before it failed
    probes_while_marked: int = 0  # tier lookups during the re-admission with the marker set
    healthy_served_by: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """The fail-closed contract for this row (all or nothing, nothing leaked)."""
        common = self.staging_leaked_bytes == 0 and self.marker_cleared and self.state_hash_ok
        if self.outcome == "committed":
            return common and self.exposed_tokens == self.tokens > 0 and self.invalid_blocks == 0
        return (common and self.exposed_tokens == 0 and self.invalid_blocks == self.total_blocks > 0
                and self.marker_set and self.probes_while_marked == 0 and self.served_by == LOCAL)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


@dataclass
class ScenarioResult:
    row: FaultRow
    outcome: RetrieveOutcome
    healthy: RetrieveOutcome
    source: Source
    tables: list[torch.Tensor]  # the faulted request's destination tables
    kv: list[torch.Tensor]
    load_errors: set[int]  # get_block_ids_with_load_errors() after the load
    finished_recving: set[str]
    failed_recving: set[str]
    healthy_source: Source
    healthy_tables: list[torch.Tensor]
    config: RestoreConfig
    partial_prefix_hash_ok: bool | None = None  # last_window_fault: the early windows really landed


class _ProbeCounter:
    """Counts Tier.probe calls (instance attribute shadowing the method; undone by restore())."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.count = 0
        self._tiers = list(tiers)
        for t in self._tiers:
            orig = t.probe

            def counted(keys, _orig=orig):
                self.count += 1
                return _orig(keys)

            t.probe = counted

    def restore(self) -> None:
        for t in self._tiers:
            t.__dict__.pop("probe", None)


class FaultMatrix:
    """Runs the scenarios against a Mooncake master (`master`, shared; dedicated masters with
    a standalone store host are started for the scenarios that stop one) and filesystem tiers
    under `workdir`. Every tier a scenario opens it also closes."""

    def __init__(self, reg: Registration, workdir: str | Path, master=None, *, num_chunks: int = 5,
                 long_chunks: int = 12, window_chunks: int = 4, depth: int = 2, backend: str = "torch",
                 seed: int = 0, mooncake_segment_bytes: int = 64 << 20) -> None:
        self.reg = reg
        self.workdir = Path(workdir)
        self.master = master
        self.num_chunks = num_chunks
        self.long_chunks = long_chunks
        self.window_chunks = window_chunks
        self.depth = depth
        self.backend = backend
        self.seed = seed
        self.segment_bytes = mooncake_segment_bytes
        self._runs = 0
        self._remote = None

    def shared_remote(self):
        """The Mooncake tier on the shared master, made on first use and kept until close()
        (a Mooncake client takes 1-2 s to close; its fetch threads are `shared_threads()`)."""
        if self._remote is None:
            if self.master is None:
                raise ValueError("FaultMatrix needs a running MooncakeMaster (master=...)")
            self._remote = self._mooncake(self.master)
        return self._remote

    def shared_threads(self) -> set[threading.Thread]:
        pool = getattr(self._remote, "_pool", None)
        return set(getattr(pool, "_threads", ())) if pool is not None else set()

    def close(self) -> None:
        remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    def __enter__(self) -> FaultMatrix:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _forget(tier: Tier, sources: Sequence[Source]) -> None:
        """Delete a scenario's objects from the shared store (best effort)."""
        for src in sources:
            try:
                tier.delete(src.keys())
            except (TierError, NotImplementedError):
                pass

    # -- tiers -----------------------------------------------------------------------------
    def _mooncake(self, master, **kw):
        from bsr_runtime.tiers.mooncake import MooncakeTier

        kw.setdefault("global_segment_size", self.segment_bytes)
        return MooncakeTier(self.reg.chunk_bytes, self.reg.fingerprint, master.master_address,
                            master.metadata_server, **kw)

    def _config(self, **kw) -> RestoreConfig:
        kw.setdefault("prefetch_window_chunks", self.window_chunks)
        kw.setdefault("pipeline_depth", self.depth)
        kw.setdefault("fetch_timeout_s", 10.0)
        return RestoreConfig(backend=self.backend, **kw)

    # -- one scenario ----------------------------------------------------------------------
    def run(self, scenario: str) -> ScenarioResult:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        from bsr_harness.mooncake_launcher import MooncakeMaster, MooncakeStoreHost

        self._runs += 1
        t0 = time.monotonic()
        reg = self.reg
        seed = self.seed + 1000 * self._runs
        salt = f"{scenario}-{self._runs}-{time.monotonic_ns()}"  # fresh keys in a shared store
        n = self.long_chunks if scenario == "last_window_fault" else self.num_chunks
        src = make_source(reg, n, seed, salt)
        healthy_src = make_source(reg, self.num_chunks, seed + 500, salt)
        dedicated = scenario in ("remote_unavailable_before", "remote_unavailable_mid")
        cfg = {"healthy": {}, "remote_unavailable_mid": {"pipeline_depth": 1},
               "remote_fails_ssd_serves": {"pipeline_depth": 1}, "fetch_timeout": {"fetch_timeout_s": 0.5},
               "last_window_fault": {"prefetch_window_chunks": 2, "pipeline_depth": 1}}.get(scenario, {})
        config = self._config(**cfg)

        fs_dir = Path(tempfile.mkdtemp(prefix=f"fs-{scenario}-", dir=self.workdir))
        master = self.master
        # closed in reverse order: connector (unregisters staging), tiers, store host, master, files
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, fs_dir, ignore_errors=True)
            if dedicated:
                master = MooncakeMaster()
                stack.callback(master.stop)
                master.start()
                host = MooncakeStoreHost(master, self.segment_bytes)
                stack.callback(host.stop)
                host.start()
                remote = self._mooncake(master, global_segment_size=0, rpc_timeout_s=0.5, connect_timeout_s=5.0)
                stack.callback(remote.close)
            else:
                remote = self.shared_remote()
                stack.callback(self._forget, remote, [src, healthy_src])
                stack.callback(remote.faults.clear)  # never leave a fault armed on the shared tier
            fs = stack.enter_context(FilesystemTier(fs_dir, reg.chunk_bytes, reg.fingerprint, load_concurrency=2))

            store(src, fs if scenario in DAMAGE_SCENARIOS else remote)
            if scenario == "remote_fails_ssd_serves":
                store(src, fs)
            store(healthy_src, fs)
            store(healthy_src, remote)

            blocks, (tables, healthy_tables) = make_tables(reg, [n, self.num_chunks], seed + 7)
            kv = reg.allocate(blocks)
            for t in kv:
                t.view(torch.uint8).fill_(0xA5)
            conn = stack.enter_context(BSRConnector(reg, [remote, fs], kv, config=config, salt=salt))
            return self._drive(scenario, conn, remote, fs, master, src, healthy_src, tables, healthy_tables, kv, t0)

    def _drive(self, scenario, conn: BSRConnector, remote, fs, master, src: Source, healthy_src: Source,
               tables, healthy_tables, kv, t0) -> ScenarioResult:
        reg = self.reg
        ct = reg.chunk_tokens
        n = src.num_chunks
        req = ConnectorRequest(f"{scenario}-req", src.tokens)
        windows = conn.retriever.config.prefetch_window_chunks
        # faults that act at the probe
        if scenario == "key_evicted_after_probe":
            remote.faults.drop_after_probe = set(src.keys(min(2, n - 1), 1))
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, tables, tokens)
        # faults that act after the probe and allocation, before or during the load
        if scenario == "remote_unavailable_before":
            master.kill()
        elif scenario == "remote_unavailable_mid":
            remote.faults.fail_fetch = FetchCallHook(1, lambda i, keys: master.kill())
        elif scenario == "remote_and_ssd_absent":
            remote.faults.unavailable = True
        elif scenario == "remote_fails_ssd_serves":
            remote.faults.fail_fetch = FetchCallHook(1, raise_injected)
        elif scenario == "fetch_timeout":
            remote.faults.delay_s = 1.5
        elif scenario == "corrupt_object":
            remote.faults.corrupt_keys = set(src.keys(min(3, n - 1), 1))
        elif scenario == "install_exception":
            arm_install_fault(conn.retriever, 1)
        elif scenario == "last_window_fault":
            last = -(-n // windows) - 1
            remote.faults.fail_fetch = FetchCallHook(last, raise_injected)
        elif scenario in DAMAGE_SCENARIOS:
            damage_object(scenario, fs, src.keys(min(1, n - 1), 1)[0], self.workdir / f"outside-{self._runs}.bsr")
        (outcome,) = conn.start_load()
        finished = conn.get_finished(set())
        load_errors = conn.get_block_ids_with_load_errors()
        marker_set = conn.markers.is_set(req.request_id)
        disarm(conn.retriever, [remote, fs])

        partial_ok = None
        if scenario == "last_window_fault":  # the early windows really were installed before the fault
            done = outcome.attempts[0].windows_installed * windows
            partial_ok = done > 0 and state_hash(reg, kv, tables, done) == src.hash_of(done)

        # the next admission pass: zero external tokens, and no lookup while the marker is set
        counter = _ProbeCounter([remote, fs])
        try:
            again, _ = conn.get_num_new_matched_tokens(req, 0)
        finally:
            counter.restore()
        if marker_set and again != 0:
            raise AssertionError(f"{scenario}: re-admission with a force-local marker reported {again} tokens")
        conn.on_request_running(req)  # admitted RUNNING: prefills locally
        marker_cleared = not conn.markers.is_set(req.request_id)
        conn.request_finished(req, [t.tolist() for t in tables])
        marker_cleared = marker_cleared and not conn.markers.is_set(req.request_id)
        pool = conn.retriever.restorer.pool
        leaked = pool.live_bytes if pool is not None else 0

        hash_ok = True
        if outcome.committed:
            hash_ok = state_hash(reg, kv, tables, n) == src.state_hash

        # a healthy request through the same connector
        hreq = ConnectorRequest(f"{scenario}-healthy", healthy_src.tokens)
        htokens, _ = conn.get_num_new_matched_tokens(hreq, 0)
        conn.update_state_after_alloc(hreq, healthy_tables, htokens)
        (healthy,) = conn.start_load() if htokens else (None,)
        if healthy is None or not healthy.committed:
            hash_ok = False
        else:
            hash_ok = hash_ok and state_hash(reg, kv, healthy_tables, healthy_src.num_chunks) == healthy_src.state_hash
            hash_ok = hash_ok and healthy.exposed_tokens == healthy_src.num_chunks * ct == htokens
        conn.on_request_running(hreq)
        conn.request_finished(hreq)
        pool = conn.retriever.restorer.pool
        leaked += pool.live_bytes if pool is not None else 0

        first = outcome.attempts[0] if outcome.attempts else None
        row = FaultRow(
            scenario=scenario, outcome=outcome.outcome, tokens=tokens, exposed_tokens=outcome.exposed_tokens,
            invalid_blocks=outcome.invalid_blocks, total_blocks=outcome.total_blocks, marker_set=marker_set,
            marker_cleared=marker_cleared, staging_leaked_bytes=leaked, served_by=outcome.served_by,
            state_hash_ok=hash_ok, expected=EXPECTED[scenario], error=outcome.error,
            windows=first.windows if first else 0, windows_installed=first.windows_installed if first else 0,
            probes_while_marked=counter.count, healthy_served_by=healthy.served_by if healthy else "",
            seconds=time.monotonic() - t0,
        )
        return ScenarioResult(row, outcome, healthy, src, tables, kv, load_errors, set(finished.finished_recving),
                              set(finished.failed_recving), healthy_src, healthy_tables, conn.retriever.config,
                              partial_ok)


def run_fault_matrix(reg: Registration | None = None, *, scenarios: Sequence[str] | None = None,
                     workdir: str | Path | None = None, master=None, **kw) -> list[FaultRow]:
    """Run the scenarios (default: all) and return one row each. Starts a local mooncake_master
    on 127.0.0.1 unless `master` is given; files go to a temporary directory unless `workdir`."""
    from bsr_harness.mooncake_launcher import MooncakeMaster

    reg = reg or presets.dsv4_flash(scale=1 / 64)
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="bsr-faults-")) if own_dir else Path(workdir)
    own_master = master is None
    m = MooncakeMaster().start() if own_master else master
    try:
        with FaultMatrix(reg, wd, m, **kw) as matrix:
            return [matrix.run(s).row for s in (scenarios or SCENARIOS)]
    finally:
        if own_master:
            m.stop()
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)


__all__ = [
    "DAMAGE_SCENARIOS",
    "EXPECTED",
    "FETCH",
    "INSTALL",
    "SCENARIOS",
    "FaultMatrix",
    "FaultRow",
    "FaultSpec",
    "FetchCallHook",
    "InjectedFault",
    "InjectedInstallError",
    "ScenarioResult",
    "Source",
    "arm_install_fault",
    "damage_object",
    "disarm",
    "make_source",
    "make_tables",
    "run_fault_matrix",
    "store",
]
