"""MooncakeTier against a real mooncake_master and real Mooncake clients over tcp on 127.0.0.1.

No mocks. Skipped only when `mooncake.store` cannot be imported. The Tier contract and every
FaultyTier fault run against it in tests/unit/test_tier_contract.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers.base import (
    CorruptObjectError,
    FetchTimeoutError,
    MissingObjectError,
    TierError,
    TierUnavailableError,
)

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

mc = pytest.importorskip("mooncake.store", reason="mooncake.store cannot be imported (no Mooncake wheel)")

from bsr_harness.mooncake_launcher import MooncakeMaster, free_port, supports_multi_tenants  # noqa: E402
from bsr_runtime.tiers.mooncake import MooncakeTier  # noqa: E402
from bsr_runtime.tiers.mooncake_object import HEADER_SIZE  # noqa: E402

FP = "f00dfeed" * 8
C = 64 * 1024 + 16 * 3  # not a power of two on purpose


def payloads(n: int, chunk_bytes: int = C, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys_for(n: int, salt: str = "", fingerprint: str = FP, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 50000, (n * 16,), generator=g).tolist()
    return PrefixKeys(KeySpace(fingerprint, salt=salt), tokens, 16).window(0, n)


def deadline(s: float = 20.0) -> float:
    return time.monotonic() + s


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def pool():
    return StagingArena(C, 8)


@pytest.fixture(scope="module")
def shared_tier(mooncake_master):
    # One client for the module: closing a Mooncake client takes 1-2 s.
    t = MooncakeTier(C, FP, mooncake_master.master_address, mooncake_master.metadata_server)
    yield t
    t.close()


@pytest.fixture
def tier(shared_tier, pool):
    shared_tier.register_staging(pool.buffer)
    yield shared_tier
    shared_tier.unregister_staging(pool.buffer)
    assert not shared_tier._registrations.temp


def test_roundtrip_into_registered_staging_slot(tier, pool):
    n = 4
    data = payloads(n, seed=1)
    keys = keys_for(n, seed=1)
    tier.put(keys, data)  # the sources are not registered: registered for the call only
    assert tier.probe(keys) == [True] * n
    lease = pool.acquire(n)
    lease.view.zero_()
    views = [lease.chunk(i) for i in range(n)]
    regs_before = tier.stats["temp_registrations"]
    h = tier.fetch(keys, views, deadline())
    assert h.wait() == n * C
    for v, d in zip(views, data, strict=True):
        assert torch.equal(v, d)
    assert tier.stats["temp_registrations"] == regs_before  # landed in the registered buffer
    assert not tier._registrations.temp
    pool.release(lease)


def test_one_round_trip_per_window_and_one_key_per_chunk(tier, pool):
    """No companion records: a fetch of a window smaller than verify_batch_bytes takes at most two
    gets for the objects outside this client's segment (in place: even positions, then odd ones;
    landed: one), and none when all are in it (copied after one replica lookup); the store holds
    exactly one object per chunk."""
    n = 8
    keys = keys_for(n, seed=2)
    tier.put(keys, payloads(n, seed=2))
    assert tier._store.batch_is_exist([k + ".meta" for k in keys]) == [0] * n
    assert all(tier._store.get_size(k) == HEADER_SIZE + C for k in keys)
    before = dict(tier.stats)
    lease = pool.acquire(4)
    tier.fetch(keys[:4], [lease.chunk(i) for i in range(4)], deadline()).wait()
    local = tier.stats["local_reads"] - before["local_reads"]
    gets = tier.stats["get_calls"] - before["get_calls"]
    assert gets == 0 if local == 4 else 1 <= gets <= 2
    assert tier.stats["objects_verified"] - before["objects_verified"] == 4
    pool.release(lease)


def test_put_overwrites(tier, pool):
    keys = keys_for(1, seed=3)
    a, b = payloads(2, seed=3)
    tier.put(keys, [a])
    tier.put(keys, [b])
    lease = pool.acquire(1)
    tier.fetch(keys, [lease.chunk(0)], deadline()).wait()
    assert torch.equal(lease.chunk(0), b)
    pool.release(lease)


def test_fetch_into_unregistered_views(tier):
    n = 3
    data = payloads(n, seed=4)
    keys = keys_for(n, seed=4)
    tier.put(keys, data)
    dst = torch.zeros(n * C, dtype=torch.uint8)  # not registered: registered for the fetch only
    views = [dst[i * C : (i + 1) * C] for i in range(n)]
    tier.fetch(keys, views, deadline()).wait()
    assert torch.equal(dst, torch.cat(data))
    assert not tier._registrations.temp


def test_probe_absent_keys(tier):
    keys = keys_for(3, seed=5)
    assert tier.probe(keys) == [False, False, False]
    tier.put(keys[1:2], payloads(1, seed=5))
    assert tier.probe(keys) == [False, True, False]
    assert tier.probe([]) == []


def test_missing_key_at_fetch(tier, pool):
    keys = keys_for(3, seed=6)
    tier.put(keys[:2], payloads(2, seed=6))
    lease = pool.acquire(3)
    h = tier.fetch(keys, [lease.chunk(i) for i in range(3)], deadline())
    with pytest.raises(MissingObjectError):
        h.wait()
    pool.release(lease)


def test_old_two_key_format_is_refused(tier, pool):
    """A payload-only object plus a BSRM '.meta' record (the old format) probes present (one key
    per chunk) and is refused by the fetch, naming the format; it is never migrated."""
    import struct

    key = keys_for(1, seed=7)[0]
    data = payloads(1, seed=7)[0]
    fp = FP.encode()
    record = struct.pack("<4sHHQI", b"BSRM", 2, len(fp), C, 0) + fp
    assert tier._store.upsert(key, data.numpy().tobytes()) == 0
    assert tier._store.upsert(key + ".meta", record) == 0
    assert tier.probe([key]) == [True]
    lease = pool.acquire(1)
    with pytest.raises(CorruptObjectError, match="old two-key format"):
        tier.fetch([key], [lease.chunk(0)], deadline()).wait()
    assert tier._store.get_size(key) == C  # left as it was
    tier.delete([key])  # removes the legacy record too
    assert tier._store.batch_is_exist([key, key + ".meta"]) == [0, 0]
    pool.release(lease)


@pytest.mark.parametrize("size", [C // 2, C, C + 16, C + HEADER_SIZE + 16])
def test_wrong_size_object_is_corrupt(tier, pool, size):
    key = keys_for(1, seed=9 + size)[0]
    blob = os.urandom(size)
    assert tier._store.upsert(key, blob) == 0
    lease = pool.acquire(1)
    with pytest.raises(CorruptObjectError):
        tier.fetch([key], [lease.chunk(0)], deadline()).wait()
    pool.release(lease)


def test_foreign_fingerprint_is_corrupt(mooncake_tier_factory, tier, pool):
    keys = keys_for(1, seed=10)
    tier.put(keys, payloads(1, seed=10))
    other = mooncake_tier_factory(C, "0" * 64)
    lease = pool.acquire(1)
    with pytest.raises(CorruptObjectError, match="fingerprint"):
        other.fetch(keys, [lease.chunk(0)], deadline()).wait()
    pool.release(lease)


def test_deadline_passed_before_the_transfer_writes_nothing(tier, pool):
    keys = keys_for(2, seed=11)
    tier.put(keys, payloads(2, seed=11))
    lease = pool.acquire(2)
    lease.view.zero_()
    h = tier.fetch(keys, [lease.chunk(i) for i in range(2)], time.monotonic() - 1)
    with pytest.raises(FetchTimeoutError):
        h.wait()
    assert h.quiesce(5.0)  # the worker saw the deadline passed and did not transfer
    assert int(lease.view.count_nonzero()) == 0
    tier.fetch(keys, [lease.chunk(i) for i in range(2)], deadline()).wait()
    assert int(lease.view.count_nonzero()) > 0
    pool.release(lease)


def test_delete(tier):
    keys = keys_for(2, seed=15)
    tier.put(keys, payloads(2, seed=15))
    tier.delete(keys[:1])
    assert tier.probe(keys) == [False, True]
    tier.delete(keys)  # absent keys are fine
    assert tier.probe(keys) == [False, False]


def test_tenant_salts_never_see_each_other(mooncake_tier_factory, pool):
    a = mooncake_tier_factory(C, FP)
    b = mooncake_tier_factory(C, FP)
    a.register_staging(pool.buffer)
    b.register_staging(pool.buffer)
    ka, kb = keys_for(3, salt="tenant-a", seed=16), keys_for(3, salt="tenant-b", seed=16)
    assert not set(ka) & set(kb)
    a.put(ka, payloads(3, seed=16))
    assert a.probe(ka) == [True] * 3 and b.probe(ka) == [True] * 3  # one store: salts separate them
    assert b.probe(kb) == [False] * 3
    lease = pool.acquire(3)
    with pytest.raises(MissingObjectError):
        b.fetch(kb, [lease.chunk(i) for i in range(3)], deadline()).wait()
    pool.release(lease)


@pytest.mark.skipif(not supports_multi_tenants(), reason="this mooncake_master has no --enable_multi_tenants")
def test_mooncake_multi_tenant_namespaces(mooncake_tier_factory, pool):
    with MooncakeMaster(tenants={"bsr-a": 1 << 30, "bsr-b": 1 << 30}) as m:
        a = mooncake_tier_factory(C, FP, master=m, tenant_id="bsr-a")
        b = mooncake_tier_factory(C, FP, master=m, tenant_id="bsr-b")
        keys = keys_for(2, seed=17)  # the same keys in both tenants
        da, db = payloads(2, seed=17), payloads(2, seed=18)
        a.put(keys, da)
        assert b.probe(keys) == [False, False]
        b.put(keys, db)
        lease = pool.acquire(2)
        a.fetch(keys, [lease.chunk(i) for i in range(2)], deadline()).wait()
        assert all(torch.equal(lease.chunk(i), da[i]) for i in range(2))
        b.fetch(keys, [lease.chunk(i) for i in range(2)], deadline()).wait()
        assert all(torch.equal(lease.chunk(i), db[i]) for i in range(2))
        pool.release(lease)
        a.close()
        b.close()


def test_unreachable_master_fails_fast(pool):
    port = free_port()  # nobody listens here
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError):
        MooncakeTier(C, FP, f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata", connect_timeout_s=10)
    assert time.monotonic() - t0 < 10


def test_silent_master_port_times_out(mooncake_master):
    """Something accepts connections on the master port but never answers: setup() would retry
    for minutes; the tier gives up after connect_timeout_s."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError):
            MooncakeTier(C, FP, f"127.0.0.1:{port}", mooncake_master.metadata_server, connect_timeout_s=3)
        assert time.monotonic() - t0 < 4.5


def test_master_stopped_fails_in_bounded_time(mooncake_tier_factory, pool):
    with MooncakeMaster() as m:
        t = mooncake_tier_factory(C, FP, master=m, rpc_timeout_s=1)
        t.register_staging(pool.buffer)
        keys = keys_for(2, seed=19)
        data = payloads(2, seed=19)
        t.put(keys, data)
        m.stop()
        lease = pool.acquire(2)
        for op in (
            lambda: t.probe(keys),
            lambda: t.fetch(keys, [lease.chunk(i) for i in range(2)], deadline(15)).wait(),
            lambda: t.put(keys, data),
        ):
            t0 = time.monotonic()
            with pytest.raises(TierError):
                op()
            assert time.monotonic() - t0 < 15
        pool.release(lease)
        t0 = time.monotonic()
        t.close()  # unmounting against a dead master: bounded by the RPC timeouts
        assert time.monotonic() - t0 < 30


def test_master_restart_loses_objects_not_stale(mooncake_tier_factory, pool):
    with MooncakeMaster() as m:
        t = mooncake_tier_factory(C, FP, master=m)
        t.register_staging(pool.buffer)
        keys = keys_for(3, seed=20)
        data = payloads(3, seed=20)
        t.put(keys, data)
        assert t.probe(keys) == [True] * 3
        m.restart()
        end = time.monotonic() + 30
        while True:  # the client re-registers with the new master on its next heartbeat
            try:
                present = t.probe(keys)
                break
            except TierError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        assert present == [False] * 3
        lease = pool.acquire(3)
        lease.view.zero_()
        with pytest.raises(TierError):
            t.fetch(keys, [lease.chunk(i) for i in range(3)], deadline()).wait()
        assert int(lease.view.count_nonzero()) == 0  # nothing stale landed
        end = time.monotonic() + 30
        while True:  # and it is writable again once its segment is mounted on the new master
            try:
                t.put(keys, data)
                break
            except TierError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        t.fetch(keys, [lease.chunk(i) for i in range(3)], deadline()).wait()
        assert all(torch.equal(lease.chunk(i), data[i]) for i in range(3))
        pool.release(lease)
        t.close()


def test_master_process_is_gone_after_stop():
    psutil = pytest.importorskip("psutil")
    m = MooncakeMaster()
    with m:
        pid = m.pid
        port = m.rpc_port
        workdir = m.workdir
        assert psutil.pid_exists(pid) and m.running()
        assert "mooncake_master" in " ".join(psutil.Process(pid).cmdline())
    assert not m.running()
    assert not psutil.pid_exists(pid)
    assert not workdir.exists()
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        assert not ("mooncake_master" in cmd and f"--rpc_port={port}" in cmd), p
    m.stop()  # idempotent


def test_master_start_failure_reports_log(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(RuntimeError, match="already in use"):
            MooncakeMaster(rpc_port=busy.getsockname()[1]).start()
    m = MooncakeMaster(extra_args=["--memory_allocator=no-such-allocator"], start_timeout_s=10)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as ei:
            m.start()
        assert time.monotonic() - t0 < 15
        assert "mooncake_master" in str(ei.value)
    finally:
        m.stop()
    assert not m.running()
    assert m.workdir is None  # a failed start leaves no temp dir behind


def test_no_threads_left_after_close(mooncake_master, pool):
    before = {t for t in threading.enumerate() if not t.daemon}
    natives = []
    for i in range(3):
        t = MooncakeTier(C, FP, mooncake_master.master_address, mooncake_master.metadata_server)
        t.register_staging(pool.buffer)
        keys = keys_for(2, seed=30 + i)
        t.put(keys, payloads(2, seed=30 + i))
        lease = pool.acquire(2)
        t.fetch(keys, [lease.chunk(j) for j in range(2)], deadline()).wait()
        pool.release(lease)
        t.close()
        t.close()  # idempotent
        natives.append(native_threads())
        with pytest.raises(TierUnavailableError):
            t.probe(keys)
    after = {t for t in threading.enumerate() if not t.daemon}
    assert after <= before, after - before
    assert natives[-1] <= natives[0] + 2, natives  # native client threads do not pile up


def test_close_fails_queued_fetches(mooncake_tier_factory, pool):
    t = mooncake_tier_factory(C, FP, fetch_workers=1)
    keys = keys_for(1, seed=40)
    t.put(keys, payloads(1, seed=40))
    real = t._fetch_now

    def slow(ks, views, dl, headroom=0):  # the first fetch holds the only worker until close() begins
        if t._closing.wait(5.0):
            raise TierUnavailableError("closed during the fetch")
        return real(ks, views, dl, headroom)

    t._fetch_now = slow
    lease = pool.acquire(2)
    h1 = t.fetch(keys, [lease.chunk(0)], deadline(30))
    h2 = t.fetch(keys, [lease.chunk(1)], deadline(30))
    t0 = time.monotonic()
    t.close()  # ends the running fetch, fails the queued one
    assert time.monotonic() - t0 < 4
    for h in (h1, h2):
        with pytest.raises(TierUnavailableError):
            h.wait()
    pool.release(lease)


def test_a_stopped_store_host_is_forgotten_before_stop_returns(mooncake_master, tier):
    """A store host that exits does not unmount its segment: the master keeps it until the client TTL
    passes, and a put placed there meanwhile fails (TRANSFER_FAIL). stop() returns once the master
    forgot it, so the puts of a client of the same master made right after all land."""
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    host = MooncakeStoreHost(mooncake_master, 64 << 20).start()
    mine = set(host.segments)
    assert mine and mine <= mooncake_master.segments()  # the host's segment, learnt at start
    host.stop()
    assert not mine & mooncake_master.segments()
    keys = keys_for(24, salt="after-host")
    tier.put(keys, payloads(24, seed=5))
    assert tier.probe(keys) == [True] * 24


def test_a_store_host_stopped_before_its_master_need_not_wait():
    """wait_forgotten=False (the master stops right after the host): stop() returns at once, while the
    master still lists the dead segment. A master of the test's own: the shared one must not keep it."""
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    with MooncakeMaster() as m:
        host = MooncakeStoreHost(m, 64 << 20, wait_forgotten=False).start()
        mine = set(host.segments)
        assert mine and mine <= m.segments()
        host.stop()
        assert mine <= m.segments()  # not waited for: the master forgets it only after its client TTL
        assert host.segments == set()


def test_a_store_host_refuses_bad_arguments(mooncake_master):
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    with pytest.raises(ValueError, match="wait_forgotten must be True or False"):
        MooncakeStoreHost(mooncake_master, 64 << 20, wait_forgotten="no")
    with pytest.raises(ValueError, match="segment_bytes must be an integer of at least 1 MiB"):
        MooncakeStoreHost(mooncake_master, 1000)
