"""Shared fixtures. Mooncake: a real `mooncake_master` on 127.0.0.1 and real store clients."""

from __future__ import annotations

import importlib.util

import pytest

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


@pytest.fixture(scope="module")
def mooncake_master():
    """One mooncake_master per test module, stopped (and reaped) at teardown."""
    _require_mooncake()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_tier_factory(mooncake_master):
    """make(chunk_bytes, fingerprint, **kw) -> MooncakeTier against the module's master
    (or `master=` another MooncakeMaster); every tier made is closed at teardown."""
    from bsr_runtime.tiers.mooncake import MooncakeTier

    made: list[MooncakeTier] = []

    def make(chunk_bytes: int, fingerprint: str, *, master=None, **kw) -> MooncakeTier:
        m = master or mooncake_master
        kw.setdefault("global_segment_size", 128 << 20)
        tier = MooncakeTier(chunk_bytes, fingerprint, m.master_address, m.metadata_server, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
