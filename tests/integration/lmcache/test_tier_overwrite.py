"""Overwrite is part of the tier contract: what the store path writes (tiers.base.put_replacing, as
store_prefix does) replaces the object already under the key, intact or damaged, in every tier: memory,
filesystem (real files), Mooncake (a real mooncake_master), LMCache with the FS and with the Mooncake L2
plugin (the real LMCache StorageManager). A tier whose put cannot replace says so (`overwrites` False) and
the store path deletes first. Before: through LMCache the FS plugin skipped a key whose file existed, the
put reported success, and a damaged object failed every load forever."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from bsr_harness.faulty_tier import damage_stored, flipped
from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import presets
from bsr_runtime.tiers import CorruptObjectError, FilesystemTier, TierError
from bsr_runtime.tiers.base import put_replacing

pytestmark = pytest.mark.timeout(300)

REG = presets.dsv4_flash(scale=1 / 1024)
C = REG.chunk_bytes
_MOONCAKE = [pytest.mark.mooncake]
KINDS = ["memory", "filesystem", pytest.param("mooncake", marks=_MOONCAKE), "lmcache-filesystem",
         pytest.param("lmcache-mooncake", marks=_MOONCAKE)]


@pytest.fixture(scope="module")
def shared_mooncake_tier(mooncake_module_tier_factory):
    """One Mooncake client for the module's tests (each under keys of its own): a close takes ~2 s."""
    return mooncake_module_tier_factory(C, REG.fingerprint)


def _lmcache_tier(kind: str, options: dict):
    pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")
    from bsr_runtime.integrations.lmcache.tier import open_lmcache_tier

    return open_lmcache_tier(REG, kind, {"l1_bytes": 16 << 20, **options})


@pytest.fixture(scope="module")
def shared_lmcache_filesystem_tier(tmp_path_factory):
    """One LMCache tier (filesystem L2) for the module's tests (each under keys of its own)."""
    with _lmcache_tier("lmcache-filesystem", {"root": str(tmp_path_factory.mktemp("lmcache-fs") / "l2")}) as t:
        yield t


@pytest.fixture(scope="module")
def shared_lmcache_mooncake_tier(mooncake_master):
    """One LMCache tier (Mooncake L2) for the module's tests, closed before its master stops."""
    options = {"master_address": mooncake_master.master_address, "metadata_server": mooncake_master.metadata_server,
               "global_segment_size": 64 << 20}
    with _lmcache_tier("lmcache-mooncake", options) as t:
        yield t


@pytest.fixture(params=KINDS)
def tier(request, tmp_path):
    """A tier of each kind; the Mooncake and LMCache ones are shared by the module (closing one takes
    1-3 s), the tests keep apart by their keys (`keys`)."""
    kind = request.param
    if kind == "memory":
        t = MemoryTier(C, REG.fingerprint)
    elif kind == "filesystem":
        t = FilesystemTier(tmp_path, C, REG.fingerprint)
    else:
        yield request.getfixturevalue(f"shared_{kind.replace('-', '_')}_tier")
        return
    try:
        yield t
    finally:
        t.close()


def payloads(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (C,), dtype=torch.uint8, generator=g) for _ in range(n)]


def fetched(tier, keys: list[str]) -> list[torch.Tensor]:
    out = [torch.zeros(C, dtype=torch.uint8) for _ in keys]
    tier.fetch(keys, out, time.monotonic() + 30).wait()
    return out


def keys(n: int) -> list[str]:
    salt = uuid.uuid4().hex  # a Mooncake store is shared by the module
    return [f"{salt}-r0of1-k{i}" for i in range(n)]


def test_a_replacing_put_replaces_intact_objects(tier):
    ks = keys(3)
    old, new = payloads(3, 1), payloads(3, 2)
    put_replacing(tier, ks, old)
    assert all(torch.equal(a, b) for a, b in zip(fetched(tier, ks), old, strict=True))
    put_replacing(tier, ks, new)
    assert all(torch.equal(a, b) for a, b in zip(fetched(tier, ks), new, strict=True))


def test_a_replacing_put_repairs_a_damaged_object(tier):
    """Damaged in the tier's own storage (its header and checksum kept): every fetch fails closed; the
    rewrite (the recompute's overwrite save) repairs it; the next fetch returns the rewritten bytes."""
    ks = keys(3)
    data = payloads(3, 3)
    put_replacing(tier, ks, data)
    damage_stored(tier, ks[1], flipped(data[1]))
    for _ in range(2):
        with pytest.raises(TierError):  # CorruptObjectError; through LMCache the plugin refuses it: a miss
            fetched(tier, ks)
    put_replacing(tier, ks, data)
    assert all(torch.equal(a, b) for a, b in zip(fetched(tier, ks), data, strict=True))


def test_a_tier_that_overwrites_replaces_on_a_plain_put(tier):
    """A tier that says it overwrites (`overwrites` True) replaces on put() itself: no delete needed."""
    if not tier.overwrites:
        pytest.skip(f"{tier.name} says it cannot overwrite: the store path deletes first")
    ks = keys(2)
    data = payloads(2, 4)
    tier.put(ks, data)
    damage_stored(tier, ks[0], flipped(data[0]))
    with pytest.raises(CorruptObjectError):
        fetched(tier, ks)
    tier.put(ks, data)
    assert all(torch.equal(a, b) for a, b in zip(fetched(tier, ks), data, strict=True))


@pytest.mark.parametrize("kind", ["lmcache-filesystem", pytest.param("lmcache-mooncake", marks=_MOONCAKE)])
def test_a_put_that_cannot_write_raises(kind, request, tmp_path):
    """LMCache: a key already resident in L1 (another writer's object, kept there by LMCache's default
    store policy) cannot be reserved for the write: the put raises, never reports a success it did not
    make (before: it skipped the key, found the other writer's object in L2 and returned)."""
    pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")
    from bsr_runtime.integrations.lmcache import LMCacheTier, fs_l2_config, load_adapter_config, mooncake_l2_config

    if kind == "lmcache-filesystem":
        l2 = fs_l2_config(str(tmp_path / "l2"))
    else:
        m = request.getfixturevalue("mooncake_master")
        l2 = mooncake_l2_config(m.master_address, m.metadata_server, global_segment_size=64 << 20)
    tier = LMCacheTier.create(REG, 16 << 20, [l2], load_adapter_config(), store_policy="default")
    try:
        ks = keys(2)
        old, new = payloads(2, 5), payloads(2, 6)
        okeys = tier._object_keys(ks)
        reserved = tier.sm.reserve_write(okeys[:1], tier.layout)  # another writer, resident in L1
        reserved[okeys[0]].raw_tensor.view(torch.uint8).reshape(-1)[:C].copy_(old[0])
        tier.sm.finish_write(okeys[:1])
        with pytest.raises(TierError, match="could not be reserved"):
            tier.put(ks, new)
        put_replacing(tier, ks, new)  # deletes it from L1 and L2 first
        assert all(torch.equal(a, b) for a, b in zip(fetched(tier, ks), new, strict=True))
    finally:
        tier.close()
