"""MooncakeTier against a real mooncake_master and real Mooncake clients over tcp on 127.0.0.1.

No mocks. Skipped only when `mooncake.store` cannot be imported.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from bsr_kernels.staging_pool import StagingPool
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
from bsr_runtime.tiers.mooncake import MooncakeTier, encode_meta, meta_key  # noqa: E402

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
    return StagingPool(C, capacity_chunks=8, num_slots=2)


@pytest.fixture(scope="module")
def shared_tier(mooncake_master):
    # One client for the module: closing a Mooncake client takes 1-2 s.
    t = MooncakeTier(C, FP, mooncake_master.master_address, mooncake_master.metadata_server)
    yield t
    t.close()


@pytest.fixture
def tier(shared_tier, pool):
    shared_tier.faults.clear()
    shared_tier.register_staging(pool.buffer)
    yield shared_tier
    shared_tier.faults.clear()
    shared_tier.unregister_staging(pool.buffer)
    assert not shared_tier._temp_regs


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
    assert not tier._temp_regs
    pool.release(lease)


def test_metadata_is_one_batch_op_per_window(tier, pool):
    n = 8
    keys = keys_for(n, seed=2)
    before = tier.stats["meta_ops"]
    tier.put(keys, payloads(n, seed=2))
    lease = pool.acquire(4)
    tier.fetch(keys[:4], [lease.chunk(i) for i in range(4)], deadline()).wait()
    assert tier.stats["meta_ops"] - before == 2
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
    assert not tier._temp_regs


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


def test_missing_integrity_record_is_a_miss(tier, pool):
    keys = keys_for(1, seed=7)
    tier.put(keys, payloads(1, seed=7))
    assert tier._store.remove(meta_key(keys[0]), True) == 0
    assert tier.probe(keys) == [False]
    lease = pool.acquire(1)
    with pytest.raises(MissingObjectError):
        tier.fetch(keys, [lease.chunk(0)], deadline()).wait()
    pool.release(lease)


def test_corrupt_keys_fault(tier, pool):
    n = 3
    data = payloads(n, seed=8)
    keys = keys_for(n, seed=8)
    tier.put(keys, data)
    lease = pool.acquire(n)
    views = [lease.chunk(i) for i in range(n)]
    tier.fetch(keys, views, deadline()).wait()  # clean first: the fault is what fails it
    tier.faults.corrupt_keys = {keys[1]}
    with pytest.raises(CorruptObjectError, match="crc32"):
        tier.fetch(keys, views, deadline()).wait()
    tier.faults.clear()
    tier.fetch(keys, views, deadline()).wait()
    assert torch.equal(views[1], data[1])
    pool.release(lease)


@pytest.mark.parametrize("size", [C // 2, C + 16])
def test_wrong_size_object_is_corrupt(tier, pool, size):
    key = keys_for(1, seed=9 + size)[0]
    blob = os.urandom(size)
    assert tier._store.upsert(key, blob) == 0
    assert tier._store.upsert(meta_key(key), encode_meta(FP, C, 0)) == 0
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


def test_delay_past_deadline_times_out_without_late_writes(tier, pool):
    keys = keys_for(2, seed=11)
    tier.put(keys, payloads(2, seed=11))
    lease = pool.acquire(2)
    lease.view.zero_()
    tier.faults.delay_s = 1.0
    t0 = time.monotonic()
    h = tier.fetch(keys, [lease.chunk(i) for i in range(2)], time.monotonic() + 0.2)
    with pytest.raises(FetchTimeoutError):
        h.wait()
    assert time.monotonic() - t0 < 0.9
    time.sleep(1.3)  # the delayed worker saw the deadline passed and did not transfer
    assert int(lease.view.count_nonzero()) == 0
    tier.faults.delay_s = 0.3  # delayed but inside the deadline: completes
    tier.fetch(keys, [lease.chunk(i) for i in range(2)], deadline()).wait()
    assert int(lease.view.count_nonzero()) > 0
    pool.release(lease)


def test_unavailable_fault(tier, pool):
    keys = keys_for(1, seed=12)
    data = payloads(1, seed=12)
    tier.faults.unavailable = True
    lease = pool.acquire(1)
    for op in (
        lambda: tier.probe(keys),
        lambda: tier.put(keys, data),
        lambda: tier.fetch(keys, [lease.chunk(0)], deadline()),
        lambda: tier.delete(keys),
        lambda: tier.register_staging(torch.zeros(C, dtype=torch.uint8)),
    ):
        with pytest.raises(TierUnavailableError):
            op()
    tier.faults.clear()
    tier.put(keys, data)
    assert tier.probe(keys) == [True]
    pool.release(lease)


def test_fail_fetch_hook(tier, pool):
    keys = keys_for(1, seed=13)
    tier.put(keys, payloads(1, seed=13))

    def boom(ks):
        raise MissingObjectError(f"injected for {len(ks)}")

    tier.faults.fail_fetch = boom
    lease = pool.acquire(1)
    with pytest.raises(MissingObjectError, match="injected"):
        tier.fetch(keys, [lease.chunk(0)], deadline()).wait()
    pool.release(lease)


def test_drop_after_probe_is_an_eviction_race(tier, pool):
    keys = keys_for(2, seed=14)
    tier.put(keys, payloads(2, seed=14))
    tier.fetch(keys, [torch.zeros(C, dtype=torch.uint8) for _ in keys], deadline()).wait()  # leaves a lease
    tier.faults.drop_after_probe = {keys[0]}
    assert tier.probe(keys) == [True, True]
    assert tier.probe(keys) == [False, True]
    lease = pool.acquire(2)
    with pytest.raises(MissingObjectError):
        tier.fetch(keys, [lease.chunk(i) for i in range(2)], deadline()).wait()
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
        t = mooncake_tier_factory(C, FP, master=m, rpc_timeout_s=3)
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
    t.faults.delay_s = 5.0
    lease = pool.acquire(2)
    h1 = t.fetch(keys, [lease.chunk(0)], deadline(30))
    h2 = t.fetch(keys, [lease.chunk(1)], deadline(30))
    t0 = time.monotonic()
    t.close()  # interrupts the delay, fails the queued fetch
    assert time.monotonic() - t0 < 4
    for h in (h1, h2):
        with pytest.raises(TierUnavailableError):
            h.wait()
    pool.release(lease)
