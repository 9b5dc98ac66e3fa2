"""Shared fixtures. Mooncake: a real `mooncake_master` on 127.0.0.1 and real store clients. The CPU
library's copies with normal or non-temporal stores (`nt_stores`). Markers from where a test lives
(ARCHITECTURE.md, "Tests")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# tests/integration/<part>/ holds the tests that start a real <part>: a mooncake_master, the LMCache
# storage stack, a vLLM engine, a TP process group.
INTEGRATION_PARTS = ("mooncake", "lmcache", "vllm", "tp")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`integration` and the part's marker on every test under tests/integration/<part>/, and
    `integration` on every `mooncake` test elsewhere (a unit file's cases against a real master), so
    `-m "not integration"` runs what needs no real Mooncake, LMCache, vLLM or process group."""
    for item in items:
        try:
            where = item.path.resolve().relative_to(TESTS).parts
        except ValueError:  # a test file outside tests/, named on the command line
            continue
        if where[0] == "integration" and len(where) > 2 and where[1] in INTEGRATION_PARTS:
            item.add_marker(pytest.mark.integration)
            item.add_marker(getattr(pytest.mark, where[1]))
        elif where[0] != "unit":
            raise pytest.UsageError(f"{'/'.join(where)}: a test file belongs under tests/unit/ or "
                                    f"tests/integration/{{{','.join(INTEGRATION_PARTS)}}}/ (ARCHITECTURE.md, Tests)")
        if item.get_closest_marker("mooncake"):
            item.add_marker(pytest.mark.integration)

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
def mooncake_closer():
    """Where the Mooncake fixtures hand their clients to be closed (mooncake_util.BackgroundCloser)."""
    from mooncake_util import BackgroundCloser

    closer = BackgroundCloser()
    yield closer
    closer.wait()


@pytest.fixture(scope="module")
def mooncake_master(mooncake_closer):
    """One mooncake_master per test module, stopped (and reaped) after the module, once every
    client the module's fixtures made is closed; in the background, so the next module starts
    meanwhile (with a master of its own); the test run ends when every master has stopped."""
    _require_mooncake()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        mooncake_closer.stop_later(master)


def _tier_maker(default_master, made: list):
    """make(chunk_bytes, fingerprint, *, master=None, **kw): a MooncakeTier, appended to `made`
    with its master."""
    from bsr_runtime.tiers.mooncake import MooncakeTier

    def make(chunk_bytes: int, fingerprint: str, *, master=None, **kw) -> MooncakeTier:
        m = master or default_master
        kw.setdefault("global_segment_size", 128 << 20)
        tier = MooncakeTier(chunk_bytes, fingerprint, m.master_address, m.metadata_server, **kw)
        made.append((tier, m))
        return tier

    return make


@pytest.fixture
def mooncake_tier_factory(mooncake_master, mooncake_closer):
    """make(chunk_bytes, fingerprint, **kw) -> MooncakeTier against the module's master
    (or `master=` another MooncakeMaster); every tier made is closed after the test. A client
    with a segment on the module's master is closed before the next test starts (the master
    places an object in any mounted segment: the next test's objects must not land in it); the
    others close in the background (before the module's master stops)."""
    made: list = []
    yield _tier_maker(mooncake_master, made)
    hosts = [t for t, m in made if m is mooncake_master and t.options.global_segment_size > 0]
    mooncake_closer.close_later([t for t, _ in made if not any(t is h for h in hosts)])
    mooncake_closer.close_now(hosts)


@pytest.fixture(scope="module")
def mooncake_module_tier_factory(mooncake_master, mooncake_closer):
    """mooncake_tier_factory for clients the module's tests share (e.g. a holder that only puts:
    its segment hosts every test's objects, so each test keeps to keys of its own)."""
    made: list = []
    yield _tier_maker(mooncake_master, made)
    mooncake_closer.close_later([t for t, _ in made])
