"""The native CPU backend: thread counts, the library's own checks, auto selection and fallback.

Correctness across registrations and layouts is covered by the parametrized suites
(test_install.py, test_strided_destinations.py), which include "cpu" when the library loads.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_util import (
    POISON,
    kv_pair_layout,
    kv_registration,
    make_case,
    naive_gather,
    naive_install,
    poisoned,
    same_bytes,
    untouched_outside_window,
)

from bsr_kernels import WindowInstaller, backends, gather_window, install_window, presets
from bsr_kernels.install import available_backends, resolve_backend

cpu_backend = pytest.importorskip("bsr_kernels.cpu_backend")
pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason=f"no CPU library: {cpu_backend.load_error()}")


def test_stream_thresholds_default_by_destination_and_can_be_set():
    """Staging (read right after it is written) streams from the last-level cache size up; the
    install's destinations stream always; each is set on its own."""
    was = {into: cpu_backend.stream_bytes(into=into) for into in cpu_backend.STREAM_INTO}
    assert was["staging"] > 0  # the last-level cache size, or 32 MiB where the system does not say
    if "BSR_CPU_STREAM_DEST_BYTES" not in os.environ:
        assert was["destinations"] == 0
    try:
        assert cpu_backend.stream_bytes(12345, into="staging") == was["staging"]
        assert cpu_backend.stream_bytes(into="staging") == 12345
        assert cpu_backend.stream_bytes(into="destinations") == was["destinations"]
        assert cpu_backend.stream_bytes(777, into="destinations") == was["destinations"]
        assert cpu_backend.stream_bytes(into="destinations") == 777
        assert cpu_backend.stream_bytes(into="staging") == 12345
        with pytest.raises(ValueError, match=">= 0"):
            cpu_backend.stream_bytes(-1)
        with pytest.raises(ValueError, match="into must be"):
            cpu_backend.stream_bytes(into="kv")
    finally:
        for into, nbytes in was.items():
            cpu_backend.stream_bytes(nbytes, into=into)


def test_listed_and_picked_by_auto():
    assert "cpu" in available_backends("cpu")
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("layout", ["contiguous", "vllm_cpu"])
def test_forced_threads_match_oracle(threads, layout, nt_stores):
    reg = kv_registration(layers=3, heads=2, head_dim=8, block_size=16)
    case = make_case(reg, 1, 3, seed=threads, hole_frac=0.2)
    views, bufs = kv_pair_layout(layout, reg, case.num_blocks[0])
    install_window(case.staging, reg, views, case.tables, 1, 3, backend="cpu", cpu_threads=threads)
    ev, expect = kv_pair_layout(layout, reg, case.num_blocks[0])
    naive_install(case, ev)
    same_bytes(bufs, expect, f"cpu x{threads}")
    out = torch.full((3 * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    gather_window(out, reg, views, case.tables, 1, 3, backend="cpu", cpu_threads=threads)
    assert torch.equal(out, naive_gather(case, views))


@pytest.fixture(scope="module")
def large_window():
    """A 4 MB window of 167-tensor chunks on fresh random data, and what the entry-by-entry oracle
    makes of it (computed once: the oracle is Python, seconds per window; each thread count and
    store kind below runs the library against it)."""
    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 2, 16, seed=int(torch.randint(0, 1 << 30, ())), hole_frac=0.2)
    ref = poisoned(reg, case.num_blocks)
    naive_install(case, ref)
    untouched_outside_window(case, ref)
    return case, ref, naive_gather(case, ref)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_threads_on_a_large_window_match_oracle(threads, nt_stores, large_window):
    """A 4 MB window of 167-tensor chunks split over several threads, against the entry-by-entry
    oracle, on poisoned destinations with holes; blocks outside the window stay poisoned; gather of
    the same window gives the staged bytes back."""
    case, ref, ref_gathered = large_window
    reg = case.reg
    kv = poisoned(reg, case.num_blocks)
    install_window(case.staging, reg, kv, case.tables, 2, 16, backend="cpu", cpu_threads=threads)
    same_bytes(kv, ref, f"cpu x{threads}, many grabs")  # ref is poisoned outside the window
    out = torch.full((16 * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    gather_window(out, reg, kv, case.tables, 2, 16, backend="cpu", cpu_threads=threads)
    assert torch.equal(out, ref_gathered)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bad_block_in_the_last_chunk_is_reported(threads):
    """An out-of-range block id in the window's last chunk (another thread's slice when split) is the
    call's error, whichever thread met it, and the call returns."""
    from bsr_kernels.validate import WindowArgs

    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 0, 16, seed=7, hole_frac=0.0)
    tables = [t.clone() for t in case.tables]
    tables[2][-1] = 10_000_000  # bypasses validation on purpose (group 2: every block of a chunk staged)
    kv = tuple(poisoned(reg, case.num_blocks))
    args = WindowArgs(case.staging, kv, tuple(tables), 0, 16, reg.chunk_bytes)
    with pytest.raises(RuntimeError, match="block id 10000000 outside"):
        cpu_backend.install(reg, args, threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_first_bad_block_is_the_error_whichever_thread_meets_it(threads):
    """Two out-of-range block ids, chunk 3's and the last chunk's: the call reports chunk 3's (the
    first in item order), however the threads shared the items."""
    from bsr_kernels.validate import WindowArgs

    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 0, 16, seed=8, hole_frac=0.0)
    tables = [t.clone() for t in case.tables]
    assert tables[2].numel() == 16  # group 2: one block per chunk
    tables[2][3], tables[2][-1] = 10_000_003, 10_000_015  # bypass validation on purpose
    args = WindowArgs(case.staging, tuple(poisoned(reg, case.num_blocks)), tuple(tables), 0, 16, reg.chunk_bytes)
    for _ in range(5):
        with pytest.raises(RuntimeError, match="chunk 3: block id 10000003 outside"):
            cpu_backend.install(reg, args, threads)


def test_a_worker_that_never_starts_does_not_hold_the_call(large_window):
    """While the pool's workers start nothing (held, as a worker the scheduler does not run), a
    two-thread install, gather and checksumming copy return with every byte moved by the caller alone;
    released, the workers take tasks again. A call that waited for its worker's share would hang here."""
    import threading

    import google_crc32c
    import numpy as np

    from bsr_kernels import host_crc

    case, ref, ref_gathered = large_window
    reg = case.reg
    kv = poisoned(reg, case.num_blocks)
    out = torch.full((16 * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    n, body = 8, 1 << 20
    src = np.random.default_rng(3).integers(0, 256, n * body, dtype=np.uint8)
    dst = np.zeros(n * body, dtype=np.uint8)
    results = {}

    def calls():
        install_window(case.staging, reg, kv, case.tables, 2, 16, backend="cpu", cpu_threads=2)
        gather_window(out, reg, kv, case.tables, 2, 16, backend="cpu", cpu_threads=2)
        results["crcs"] = host_crc.copy_crc32c([src.ctypes.data + i * body for i in range(n)], None,
                                               [dst.ctypes.data + i * body for i in range(n)], 0, body, threads=2)

    was = cpu_backend.pool_hold(True)
    try:
        assert cpu_backend.pool_hold() is True
        t = threading.Thread(target=calls, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "a two-thread call waited for a worker that never started"
    finally:
        cpu_backend.pool_hold(was)
    same_bytes(kv, ref, "install by the caller alone")
    assert torch.equal(out, ref_gathered)
    assert np.array_equal(dst, src)
    assert results["crcs"].tolist() == [google_crc32c.value(src[i * body : (i + 1) * body].tobytes()) for i in range(n)]
    kv2 = poisoned(reg, case.num_blocks)  # released: the workers run again
    install_window(case.staging, reg, kv2, case.tables, 2, 16, backend="cpu", cpu_threads=2)
    same_bytes(kv2, ref, "install with the workers released")


def test_auto_threads_above_threshold_match_oracle():
    """A window larger than the library's parallel threshold (two threads under auto)."""
    reg = presets.dsv4_flash(scale=1 / 16)
    n = -(-cpu_backend.parallel_bytes() // reg.chunk_bytes) + 1
    case = make_case(reg, 0, n, seed=2)
    kv = poisoned(reg, case.num_blocks)
    install_window(case.staging, reg, kv, case.tables, 0, n, backend="cpu")
    ref = poisoned(reg, case.num_blocks)
    install_window(case.staging, reg, ref, case.tables, 0, n, backend="torch")
    same_bytes(kv, ref, "cpu auto threads vs torch")


def test_window_installer_gather_and_install():
    reg = kv_registration(layers=2)
    case = make_case(reg, 0, 4, seed=9, hole_frac=0.2)
    views, bufs = kv_pair_layout("flashinfer_hnd", reg, case.num_blocks[0])
    inst = WindowInstaller(reg, views, case.tables, 4, backend="cpu", cpu_threads=2)
    c = reg.chunk_bytes
    for first in (0, 2):
        assert inst.install(case.staging[first * c : (first + 2) * c].clone(), first, 2) == "cpu"
    ev, expect = kv_pair_layout("flashinfer_hnd", reg, case.num_blocks[0])
    naive_install(case, ev)
    same_bytes(bufs, expect, "WindowInstaller cpu")
    out = torch.empty(4 * c, dtype=torch.uint8)
    inst.gather(out, 0, 4)
    assert torch.equal(out, naive_gather(case, views))


def test_bad_thread_count_is_a_value_error():
    reg = kv_registration(layers=1)
    case = make_case(reg, 0, 1, seed=1)
    views, _ = kv_pair_layout("contiguous", reg, case.num_blocks[0])
    with pytest.raises(ValueError, match="cpu_threads"):
        install_window(case.staging, reg, views, case.tables, 0, 1, backend="cpu", cpu_threads=-1)


def test_library_rejects_out_of_range_block():
    from bsr_kernels.validate import WindowArgs

    reg = kv_registration(layers=1)
    kv = tuple(poisoned(reg, [4]))
    tables = (torch.tensor([0, 1, 99, 3] * 8, dtype=torch.int64),)  # bypasses validation on purpose
    args = WindowArgs(torch.zeros(reg.chunk_bytes, dtype=torch.uint8), kv, tables, 0, 1, reg.chunk_bytes)
    with pytest.raises(RuntimeError, match="block id 99 outside"):
        cpu_backend.install(reg, args)


def test_auto_falls_back_to_torch_with_one_notice(monkeypatch, capsys):
    monkeypatch.setattr(cpu_backend, "available", lambda: False)
    monkeypatch.setattr(backends, "_NOTICED", set())
    reg = kv_registration(layers=1)
    case = make_case(reg, 0, 1, seed=1)
    views, _ = kv_pair_layout("contiguous", reg, case.num_blocks[0])
    for _ in range(2):
        assert install_window(case.staging, reg, views, case.tables, 0, 1) == "torch"
    err = capsys.readouterr().err
    assert err.count("native cpu backend unavailable") == 1 and err.count("\n") == 1


def _two_thread_case(seed: int):
    reg = kv_registration(layers=2)
    case = make_case(reg, 0, 4, seed=seed, hole_frac=0.2)
    views, bufs = kv_pair_layout("vllm_cpu", reg, case.num_blocks[0])
    ev, expect = kv_pair_layout("vllm_cpu", reg, case.num_blocks[0])
    naive_install(case, ev)
    return reg, case, views, bufs, expect


def test_concurrent_callers_share_the_pool():
    """Windows installed from several Python threads at once (ctypes drops the GIL): a caller
    that finds the worker pool busy runs its slices itself."""
    import threading

    cases = [_two_thread_case(s) for s in range(4)]
    errors = []

    def work(reg, case, views):
        try:
            for _ in range(20):
                install_window(case.staging, reg, views, case.tables, 0, 4, backend="cpu", cpu_threads=2)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(reg, case, views)) for reg, case, views, _, _ in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for _, _, _, bufs, expect in cases:
        same_bytes(bufs, expect, "concurrent cpu installs")


def _pool_workers() -> list[int]:
    """Thread ids of the library's pool workers (named bsr-cpu-pool by csrc/bsr_cpu_pool.c)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "bsr-cpu-pool":
                    out.append(int(tid))
        except OSError:  # the thread ended
            continue
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_spread_keeps_the_pool_workers_off_the_callers_cpu():
    """With spread on, a two-thread call leaves every worker allowed on all the caller's CPUs but
    one (the one the caller ran on); off, the workers get the caller's whole affinity back; a
    caller bound to one CPU changes nothing. The installs stay exact throughout."""
    mine = os.sched_getaffinity(0)
    reg, case, views, bufs, expect = _two_thread_case(11)
    was = cpu_backend.pool_spread(True)
    try:
        install_window(case.staging, reg, views, case.tables, 0, 4, backend="cpu", cpu_threads=2)
        workers = _pool_workers()
        assert workers, "no bsr-cpu-pool thread after a two-thread install"
        for tid in workers:
            allowed = os.sched_getaffinity(tid)
            assert allowed < mine and len(allowed) == len(mine) - 1, (tid, allowed, mine)
        assert cpu_backend.pool_spread(False) is True
        assert all(os.sched_getaffinity(tid) == mine for tid in workers)
        one = {min(mine)}
        os.sched_setaffinity(0, one)
        try:
            cpu_backend.pool_spread(True)
            reg2, case2, views2, bufs2, expect2 = _two_thread_case(12)
            install_window(case2.staging, reg2, views2, case2.tables, 0, 4, backend="cpu", cpu_threads=2)
            assert all(os.sched_getaffinity(tid) == mine for tid in workers)  # nothing to keep them off
        finally:
            os.sched_setaffinity(0, mine)
        same_bytes(bufs, expect, "two-thread install with spread on")
        same_bytes(bufs2, expect2, "two-thread install from a caller bound to one CPU")
    finally:
        cpu_backend.pool_spread(was)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_fork_child_gets_a_fresh_pool():
    reg, case, views, bufs, expect = _two_thread_case(7)
    install_window(case.staging, reg, views, case.tables, 0, 4, backend="cpu", cpu_threads=2)  # pool started
    pid = os.fork()
    if pid == 0:  # child: the parent's workers do not exist here
        # no torch kernels in the child: torch's OpenMP team does not survive a fork either
        import ctypes

        try:
            sizes = [b.numel() * b.element_size() for b in bufs]
            for b, n in zip(bufs, sizes):
                ctypes.memset(b.data_ptr(), POISON, n)
            install_window(case.staging, reg, views, case.tables, 0, 4, backend="cpu", cpu_threads=2)
            ok = all(ctypes.string_at(b.data_ptr(), n) == ctypes.string_at(e.data_ptr(), n)
                     for b, e, n in zip(bufs, expect, sizes))
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        __import__("time").sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the fork child hung in install_window")
    assert os.waitstatus_to_exitcode(status) == 0


def test_first_use_build_compiles_every_source(monkeypatch, tmp_path):
    """Without an installed library, csrc/*.c (install, pool, CRC-32C) is compiled into the cache."""
    if cpu_backend.find_cc() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("BSR_CACHE_DIR", str(tmp_path))
    src = cpu_backend.source_dir()
    names = {p.rsplit("/", 1)[-1] for p in cpu_backend.c_sources(src)}
    assert {"bsr_install_cpu.c", "bsr_cpu_pool.c", "bsr_crc32c.c"} <= names
    built = cpu_backend._cached_build(src)
    assert str(built).startswith(str(tmp_path))
    lib = cpu_backend.load(built)
    assert lib.bsr_cpu_abi_version() == cpu_backend.abi().versions["cpu"]
    data = b"123456789"
    assert lib.bsr_crc32c(0, data, len(data)) == 0xE3069283  # the CRC-32C check value


# A library as a build from before chunk-strided staging left it: ABI 2002, window functions
# without the chunk_stride argument (their old names).
_STALE_SOURCE = """
#include <stdint.h>
int bsr_cpu_abi_version(void) { return 2002; }
const char* bsr_cpu_last_error(void) { return ""; }
int bsr_cpu_install(void* s, int64_t cb, int64_t f, int64_t n, const int64_t* d, int64_t nt, const int64_t* p,
                    int64_t ng, int64_t th) { return 0; }
int bsr_cpu_gather(void* s, int64_t cb, int64_t f, int64_t n, const int64_t* d, int64_t nt, const int64_t* p,
                   int64_t ng, int64_t th) { return 0; }
"""


def test_stale_library_is_refused_and_rebuilt(monkeypatch, tmp_path):
    """A stale libbsr_cpu.so (older ABI) is never called: load() refuses it naming both versions,
    an explicit $BSR_CPU_LIB fails with that message, and an installed copy that looks fresh by
    its date is replaced by a first-use build of the current sources."""
    from bsr_kernels.native_library import LibraryNotLoaded

    cc = cpu_backend.find_cc()
    if cc is None:
        pytest.skip("no C compiler")
    pkg = tmp_path / "pkg"
    (pkg / "lib").mkdir(parents=True)
    (tmp_path / "csrc").symlink_to(cpu_backend.source_dir(), target_is_directory=True)
    src = tmp_path / "stale.c"
    src.write_text(_STALE_SOURCE)
    stale = pkg / "lib" / cpu_backend.LIB_NAME
    import subprocess

    subprocess.run([cc, "-shared", "-fPIC", "-o", str(stale), str(src)], check=True)
    with pytest.raises(RuntimeError, match=f"ABI version 2002, this package needs {cpu_backend.abi().versions['cpu']}"):
        cpu_backend.load(stale)
    monkeypatch.setenv("BSR_CPU_LIB", str(stale))
    with pytest.raises(LibraryNotLoaded, match="ABI version 2002"):
        cpu_backend._find()
    monkeypatch.delenv("BSR_CPU_LIB")
    monkeypatch.setattr(cpu_backend, "_PKG", pkg)
    monkeypatch.setenv("BSR_CACHE_DIR", str(tmp_path / "cache"))
    assert not cpu_backend._stale(stale)  # newer than the sources: only the ABI check catches it
    lib, path = cpu_backend._find()
    assert path.startswith(str(tmp_path / "cache"))
    assert lib.bsr_cpu_abi_version() == cpu_backend.abi().versions["cpu"]
    assert all(hasattr(lib, p.name) for p in cpu_backend.abi().of("cpu"))
    assert not hasattr(lib, "bsr_cpu_install")
