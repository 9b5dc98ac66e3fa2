"""The fault matrix: fail-closed scenarios against real tiers (a Mooncake master, real files).

Each scenario stores a prefix, drives one request through the StandaloneConnector lifecycle with a
fault armed at a chosen point (probe, fetch of window k, install of window k, the store
itself), then checks what the engine would see, re-admits the request (which must not look
the prefix up again while its force-local marker is set), admits it RUNNING (which clears
the marker), tears it down, and finally restores a healthy request through the same
connector and checks its state hash. `run_fault_matrix()` returns one `FaultRow` per
scenario (for `bsr faults`); the tests drive `FaultMatrix.run()` and check the details.


The faults and where each scenario arms its own are in `fault_scenarios.py`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bsr_harness.fault_scenarios import (
    ARM_AT_PROBE,
    ARM_BEFORE_LOAD,
    DAMAGE_SCENARIOS,
    DEDICATED_MASTER,
    EXPECTED,
    FETCH,
    INSTALL,
    SCENARIO_CONFIG,
    SCENARIOS,
    FaultSpec,
    FetchCallHook,
    InjectedFault,
    Scene,
    Source,
    arm_install_fault,
    damage_object,
    disarm,
    make_source,
    store,
)
from bsr_harness.faulty_installer import InjectedInstallError
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.standalone_connector import ConnectorRequest, StandaloneConnector
from bsr_harness.testdata import block_tables, poison, prefix_block_ids
from bsr_kernels import Registration, presets
from bsr_runtime.restore import RestoreConfig
from bsr_runtime.retrieve import LOCAL, LoadRecord
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers.base import Tier, TierError
from bsr_runtime.tiers.filesystem import FilesystemTier


@dataclass
class FaultRow:
    scenario: str
    outcome: str  # "committed" | "failed_closed"
    tokens: int  # external tokens advertised at the probe
    exposed_tokens: int  # external tokens exposed after the load
    invalid_blocks: int
    total_blocks: int  # every block of the loaded prefix, from the request's tables (testdata.prefix_block_ids)
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
    # the blocks reported invalid are exactly the request's (per group, the oracle's), when it failed
    invalid_ids_match: bool = True

    @property
    def passed(self) -> bool:
        """The fail-closed contract for this row (all or nothing, nothing leaked)."""
        common = self.staging_leaked_bytes == 0 and self.marker_cleared and self.state_hash_ok
        if self.outcome == "committed":
            return common and self.exposed_tokens == self.tokens > 0 and self.invalid_blocks == 0
        return (common and self.exposed_tokens == 0 and self.invalid_blocks == self.total_blocks > 0
                and self.invalid_ids_match and self.marker_set and self.probes_while_marked == 0
                and self.served_by == LOCAL)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


@dataclass
class ScenarioResult:
    row: FaultRow
    outcome: LoadRecord
    healthy: LoadRecord
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
        threads = getattr(self._remote, "worker_threads", None)  # MooncakeTier: fetch + verify pools
        if threads is not None:
            return threads()
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
        kw.setdefault("window_chunks", self.window_chunks)
        kw.setdefault("pipeline_depth", self.depth)
        kw.setdefault("fetch_timeout_s", 10.0)
        return RestoreConfig(backend=self.backend, **kw)

    # -- one scenario ----------------------------------------------------------------------
    def run(self, scenario: str) -> ScenarioResult:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        self._runs += 1
        t0 = time.monotonic()
        reg = self.reg
        seed = self.seed + 1000 * self._runs
        salt = f"{scenario}-{self._runs}-{time.monotonic_ns()}"  # fresh keys in a shared store
        n = self.long_chunks if scenario == "last_window_fault" else self.num_chunks
        src = make_source(reg, n, seed, salt)
        healthy_src = make_source(reg, self.num_chunks, seed + 500, salt)
        config = self._config(**SCENARIO_CONFIG.get(scenario, {}))
        fs_dir = Path(tempfile.mkdtemp(prefix=f"fs-{scenario}-", dir=self.workdir))
        # closed in reverse order: connector (unregisters staging), tiers, store host, master, files
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, fs_dir, ignore_errors=True)
            master, remote = self._remote_for(scenario, stack, [src, healthy_src])
            fs = stack.enter_context(FilesystemTier(fs_dir, reg.chunk_bytes, reg.fingerprint, load_concurrency=2))
            store(src, fs if scenario in DAMAGE_SCENARIOS else remote)
            if scenario == "remote_fails_ssd_serves":
                store(src, fs)
            store(healthy_src, fs)
            store(healthy_src, remote)
            blocks, (tables, healthy_tables) = block_tables(reg, [n, self.num_chunks], seed + 7)
            kv = poison(reg.allocate(blocks))
            conn = stack.enter_context(StandaloneConnector(reg, [remote, fs], kv, config=config, salt=salt))
            scene = Scene(conn, remote, fs, master, src, self.workdir / f"outside-{self._runs}.bsr")
            return self._drive(scenario, scene, healthy_src, tables, healthy_tables, kv, t0)

    def _remote_for(self, scenario: str, stack: contextlib.ExitStack, sources: list[Source]):
        """(master, FaultyTier): the shared master, or a dedicated one with its own store host."""
        from bsr_harness.mooncake_launcher import MooncakeMaster
        from bsr_harness.mooncake_store_host import MooncakeStoreHost

        if scenario not in DEDICATED_MASTER:
            remote = FaultyTier(self.shared_remote(), close_inner=False)
            stack.callback(remote.close)
            stack.callback(self._forget, remote.inner, sources)
            stack.callback(remote.clear)  # never leave an object damaged in the shared store
            return self.master, remote
        master = MooncakeMaster()
        stack.callback(master.stop)
        master.start()
        host = MooncakeStoreHost(master, self.segment_bytes, wait_forgotten=False)  # the master stops next
        stack.callback(host.stop)
        host.start()
        remote = FaultyTier(self._mooncake(master, global_segment_size=0, rpc_timeout_s=0.5, connect_timeout_s=5.0))
        stack.callback(remote.close)
        return master, remote

    def _drive(self, scenario: str, scene: Scene, healthy_src: Source, tables, healthy_tables, kv,
               t0: float) -> ScenarioResult:
        conn, src = scene.conn, scene.src
        req = ConnectorRequest(f"{scenario}-req", src.tokens)
        ARM_AT_PROBE.get(scenario, _nothing)(scene)
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, tables, tokens)
        ARM_BEFORE_LOAD.get(scenario, _nothing)(scene)
        (outcome,) = conn.start_load()
        finished = conn.get_finished(set())
        load_errors = conn.get_block_ids_with_load_errors()
        marker_set = conn.markers.is_set(req.request_id)
        disarm(conn.retriever, [scene.remote, scene.fs])
        partial_ok = self._partial_prefix_ok(scenario, outcome, kv, tables, src)
        probes, marker_cleared = self._readmit(scenario, scene, req, tables, marker_set)
        hash_ok = not outcome.committed or state_hash(self.reg, kv, tables, src.num_chunks) == src.state_hash
        healthy, healthy_ok = self._healthy_request(scenario, conn, healthy_src, healthy_tables, kv)
        first = outcome.attempts[0] if outcome.attempts else None
        every = prefix_block_ids(self.reg, tables, outcome.num_chunks)  # the oracle, not the connector's count
        row = FaultRow(
            scenario=scenario, outcome=outcome.outcome, tokens=tokens, exposed_tokens=outcome.exposed_tokens,
            invalid_blocks=outcome.invalid_blocks, total_blocks=sum(len(ids) for ids in every),
            invalid_ids_match=outcome.committed or tuple(outcome.invalid_block_ids) == every, marker_set=marker_set,
            marker_cleared=marker_cleared, staging_leaked_bytes=_live_staging(conn), served_by=outcome.served_by,
            state_hash_ok=hash_ok and healthy_ok, expected=EXPECTED[scenario], error=outcome.error,
            windows=first.windows if first else 0, windows_installed=first.windows_installed if first else 0,
            probes_while_marked=probes, healthy_served_by=healthy.served_by if healthy else "",
            seconds=time.monotonic() - t0,
        )
        return ScenarioResult(row, outcome, healthy, src, tables, kv, load_errors, set(finished.finished_recving),
                              set(finished.failed_recving), healthy_src, healthy_tables, conn.retriever.config,
                              partial_ok)

    def _partial_prefix_ok(self, scenario: str, outcome: LoadRecord, kv, tables, src: Source) -> bool | None:
        """last_window_fault: the early windows really were installed before the fault."""
        if scenario != "last_window_fault":
            return None
        windows = SCENARIO_CONFIG[scenario]["window_chunks"]
        done = outcome.attempts[0].windows_installed * windows
        return done > 0 and state_hash(self.reg, kv, tables, done) == src.hash_of(done)

    def _readmit(self, scenario: str, scene: Scene, req: ConnectorRequest, tables, marker_set: bool):
        """The next admission pass (zero external tokens and no lookup while the marker is set),
        RUNNING admission (clears the marker) and teardown; -> (lookups seen, marker cleared)."""
        conn = scene.conn
        counter = _ProbeCounter([scene.remote, scene.fs])
        try:
            again, _ = conn.get_num_new_matched_tokens(req, 0)
        finally:
            counter.restore()
        if marker_set and again != 0:
            raise AssertionError(f"{scenario}: re-admission with a force-local marker reported {again} tokens")
        conn.on_request_running(req)
        cleared = not conn.markers.is_set(req.request_id)
        conn.request_finished(req, [t.tolist() for t in tables])
        return counter.count, cleared and not conn.markers.is_set(req.request_id)

    def _healthy_request(self, scenario: str, conn: StandaloneConnector, src: Source, tables, kv):
        """A healthy request through the same connector -> (outcome, its state matched)."""
        req = ConnectorRequest(f"{scenario}-healthy", src.tokens)
        tokens, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, tables, tokens)
        (healthy,) = conn.start_load() if tokens else (None,)
        ok = (healthy is not None and healthy.committed
              and state_hash(self.reg, kv, tables, src.num_chunks) == src.state_hash
              and healthy.exposed_tokens == src.num_chunks * self.reg.chunk_tokens == tokens)
        conn.on_request_running(req)
        conn.request_finished(req)
        return healthy, ok


def _nothing(scene: Scene) -> None:
    return None


def _live_staging(conn: StandaloneConnector) -> int:
    pool = conn.retriever.restorer.staging
    return pool.live_bytes if pool is not None else 0


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
    "run_fault_matrix",
    "store",
]
