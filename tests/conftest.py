"""Shared fixtures. Mooncake: a real `mooncake_master` on 127.0.0.1 (one per test process) and real
store clients. The CPU library's copies with normal or non-temporal stores (`nt_stores`). The CUDA
library compiled once per run (`cuda_first_use_build`). Markers from where a test lives
(ARCHITECTURE.md, "Tests")."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# tests/integration/<part>/ holds the tests that start a real <part>: a mooncake_master, the LMCache
# storage stack, a vLLM engine, a TP process group.
INTEGRATION_PARTS = ("mooncake", "lmcache", "vllm", "tp")


def _layout_problems() -> list[str]:
    """Test files outside tests/unit/ and tests/integration/<part>/ (`make test` would not collect them)."""
    out = []
    for path in sorted(TESTS.rglob("test_*.py")):
        where = path.relative_to(TESTS).parts
        if not (where[0] == "unit" or (where[0] == "integration" and len(where) > 2
                                        and where[1] in INTEGRATION_PARTS)):
            out.append("/".join(where))
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`integration` and the part's marker on every test under tests/integration/<part>/, and
    `integration` on every test marked with a part elsewhere (a unit file's cases against a real
    master, say), so `-m "not integration"` runs what needs no real Mooncake, LMCache, vLLM or
    process group. A test file elsewhere under tests/ is an error."""
    stray = _layout_problems()
    if stray:
        raise pytest.UsageError(f"tests/{', tests/'.join(stray)}: a test file belongs under tests/unit/ or "
                                f"tests/integration/{{{','.join(INTEGRATION_PARTS)}}}/ (ARCHITECTURE.md, Tests)")
    for item in items:
        try:
            where = item.path.resolve().relative_to(TESTS).parts
        except ValueError:  # a test file outside tests/, named on the command line
            continue
        if where[0] == "integration":
            item.add_marker(pytest.mark.integration)
            item.add_marker(getattr(pytest.mark, where[1]))
        if any(item.get_closest_marker(part) for part in INTEGRATION_PARTS):
            item.add_marker(pytest.mark.integration)


def pytest_configure(config: pytest.Config) -> None:
    """LMCache's storage managers close without waiting out an eviction tick (lmcache_ticks.py): in each
    process that runs tests (not in pytest-xdist's controller, which would import LMCache for nothing)."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import lmcache_ticks

    lmcache_ticks.install()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules are imported (vLLM, torch, transformers: ~700K objects): leave them out of every later
    garbage collection: vLLM collects on every engine start and shutdown, and each pass would walk them
    all again."""
    gc.collect()
    gc.freeze()


HAVE_MOONCAKE = (
    importlib.util.find_spec("mooncake") is not None and importlib.util.find_spec("mooncake.store") is not None
)


def _require_mooncake() -> None:
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake.store cannot be imported (install mooncake-transfer-engine-non-cuda)")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # e.g. libibverbs missing
        pytest.skip(f"mooncake.store cannot be imported: {e}")


@pytest.fixture(params=[False, True], ids=["cached", "streamed"])
def nt_stores(request):
    """Every copy of the CPU library with normal stores, or with non-temporal ones (stream_bytes 0 for
    both kinds of destination: every call streams; csrc/bsr_stream.h); the thresholds are put back."""
    from bsr_kernels import cpu_backend

    if not cpu_backend.available():
        pytest.skip(f"no CPU library: {cpu_backend.load_error()}")
    was = {into: cpu_backend.stream_bytes(0 if request.param else 1 << 62, into=into)
           for into in cpu_backend.STREAM_INTO}
    yield request.param
    for into, nbytes in was.items():
        cpu_backend.stream_bytes(nbytes, into=into)


@pytest.fixture(scope="session")
def cuda_first_use_build(tmp_path_factory) -> tuple[Path, float, Path]:
    """(library, seconds, cache dir): csrc/ compiled by the CUDA backend's first-use build for sm_90
    (kernel_util.first_use_on_sm90), once per test run: the cache dir is shared by the run's xdist
    workers (the build is atomic: a worker finding it there loads it). Skips without nvcc."""
    import time

    from kernel_util import first_use_on_sm90

    from bsr_kernels import cuda_backend

    if cuda_backend.find_nvcc() is None:
        pytest.skip("nvcc not found")
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is <run dir>/popen-gwN
        run_dir = run_dir.parent
    cache = run_dir / "bsr-cuda-first-use"
    t0 = time.monotonic()
    with first_use_on_sm90(cache):
        path = cuda_backend._cached_build(cuda_backend.source_dir())
    return path, time.monotonic() - t0, cache


@pytest.fixture(scope="session")
def mooncake_master():
    """One mooncake_master per test process (an xdist worker), started by the first test that asks for
    it and stopped (and reaped) at the end: a start and stop take ~2 s. The modules sharing it keep
    apart as their clients do: every object lives in a client's segment (or a store host's), gone
    when that client closes (module fixtures close theirs before the session ends). A test that
    stops, restarts or breaks a master starts one of its own (MooncakeMaster)."""
    _require_mooncake()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="module")
def module_mooncake_master():
    """A master of the module's own, for a module with a standalone store host: the master stops right
    after the host, so the host's stop need not wait until the master forgets its segment
    (MooncakeStoreHost(wait_forgotten=False))."""
    _require_mooncake()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    with MooncakeMaster() as master:
        yield master


def _tier_maker(default_master, made: list):
    """make(chunk_bytes, fingerprint, *, master=None, **kw): a MooncakeTier, appended to `made`."""
    from bsr_runtime.tiers.mooncake import MooncakeTier

    def make(chunk_bytes: int, fingerprint: str, *, master=None, **kw) -> MooncakeTier:
        m = master or default_master
        kw.setdefault("global_segment_size", 128 << 20)
        tier = MooncakeTier(chunk_bytes, fingerprint, m.master_address, m.metadata_server, **kw)
        made.append(tier)
        return tier

    return make


@pytest.fixture
def mooncake_tier_factory(mooncake_master):
    """make(chunk_bytes, fingerprint, **kw) -> MooncakeTier against the shared master
    (or `master=` another MooncakeMaster); every tier made is closed at teardown."""
    made: list = []
    yield _tier_maker(mooncake_master, made)
    for tier in made:
        tier.close()


@pytest.fixture(scope="module")
def mooncake_module_tier_factory(mooncake_master):
    """mooncake_tier_factory for clients a module's tests share, closed after the module (before
    its master stops). A close takes 1-2 s and holds the GIL throughout, so sharing is what saves
    the time: e.g. one holder whose segment hosts every test's objects (each test under keys of
    its own), or a reader reset for each test (mooncake_util.as_new)."""
    made: list = []
    yield _tier_maker(mooncake_master, made)
    for tier in made:
        tier.close()


# -- real-engine modules (tests/integration/vllm): one in-process engine at a time per module, and the
# tiny random-weight Llama (seed 0; a module needing other weights defines its own `model`)
@pytest.fixture(scope="module")
def engines():
    import vllm_util

    e = vllm_util.Engines()
    yield e
    e.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from bsr_harness.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
