"""Mooncake objects are bound to their key, tenant and registration (a real mooncake_master).

Mooncake returns whatever bytes sit under a name. These tests move objects between names at the
store level (as a buggy or malicious client could) and check that the tier refuses them: two
objects swapped, another tenant's objects copied under this tenant's keys, objects of the old
two-key format. Restores on top fail closed. The LMCache Mooncake L2 plugin gets the same checks.
"""

from __future__ import annotations

import time

import pytest
import torch

from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.tiers.base import CorruptObjectError

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

pytest.importorskip("mooncake.store", reason="mooncake.store cannot be imported (no Mooncake wheel)")

from mooncake_util import fetch  # noqa: E402
from restore_util import fresh_request, store_random_prefix  # noqa: E402

from bsr_runtime.tiers.mooncake import MooncakeTier  # noqa: E402

FP = "0123abcd" * 4
C = 48 * 1024 + 16


def payloads(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (C,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys_for(n: int, salt: str = "", seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(500 + seed)
    tokens = torch.randint(0, 50000, (n * 16,), generator=g).tolist()
    return PrefixKeys(KeySpace(FP, salt=salt), tokens, 16).window(0, n)


def store_names(key: str) -> list[str]:
    """Every store object a chunk may occupy: itself, and the record of the old two-key format."""
    return [key, key + ".meta"]


def raw_copy(store, src: str, dst: str) -> None:
    """Copy every store object of chunk `src` to the same place under chunk `dst` (bytes as stored)."""
    for s, d in zip(store_names(src), store_names(dst), strict=True):
        blob = store.get(s)
        if blob:
            assert store.upsert(d, blob) == 0


def raw_swap(store, a: str, b: str) -> None:
    blobs = {n: store.get(n) for n in store_names(a) + store_names(b)}
    for s, d in zip(store_names(a) + store_names(b), store_names(b) + store_names(a), strict=True):
        if blobs[s]:
            assert store.upsert(d, blobs[s]) == 0


@pytest.fixture(scope="module")
def tier(mooncake_master):
    t = MooncakeTier(C, FP, mooncake_master.master_address, mooncake_master.metadata_server,
                     global_segment_size=64 << 20)
    yield t
    t.close()


def fetch_into(tier: MooncakeTier, keys: list[str]) -> list[torch.Tensor]:
    return fetch(tier, keys, StagingArena(C, len(keys)))


def test_swapped_objects_are_refused(tier):
    keys = keys_for(2, seed=1)
    data = payloads(2, seed=1)
    tier.put(keys, data)
    got = fetch_into(tier, keys)
    assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
    raw_swap(tier._store, keys[0], keys[1])
    assert tier.probe(keys) == [True, True]  # both names hold an object: only the fetch can tell
    with pytest.raises(CorruptObjectError, match="another key"):
        fetch_into(tier, keys)
    with pytest.raises(CorruptObjectError, match="another key"):
        fetch_into(tier, keys[1:])


def test_other_tenants_objects_copied_under_my_keys_are_refused(tier):
    ka, kb = keys_for(3, salt="tenant-a", seed=2), keys_for(3, salt="tenant-b", seed=2)
    tier.put(ka, payloads(3, seed=2))
    for a, b in zip(ka, kb, strict=True):
        raw_copy(tier._store, a, b)
    assert tier.probe(kb) == [True] * 3
    with pytest.raises(CorruptObjectError, match="another key"):
        fetch_into(tier, kb)


def test_restore_fails_closed_on_swapped_and_copied_objects(mooncake_master):
    reg = presets.llama_like(layers=2, kv_heads=2, head_dim=16, block_size=16)
    with MooncakeTier(reg.chunk_bytes, reg.fingerprint, mooncake_master.master_address,
                      mooncake_master.metadata_server, global_segment_size=64 << 20) as t:
        sp = store_random_prefix(reg, t, 4, seed=3, salt="tenant-a")
        keys = PrefixKeys(sp.keyspace, sp.tokens, reg.chunk_tokens).window(0, 4)
        with BoundedRestorer(reg, RestoreConfig(window_chunks=2)) as restorer:
            assert restorer.restore(fresh_request(sp, 1), t, 4).ok
            raw_swap(t._store, keys[1], keys[2])
            rep = restorer.restore(fresh_request(sp, 2), t, 4)
            assert not rep.ok and rep.committed_tokens == 0 and "CorruptObjectError" in rep.error
            raw_swap(t._store, keys[1], keys[2])  # back in place: restores again
            assert restorer.restore(fresh_request(sp, 3), t, 4).ok

            # tenant B asks for the same tokens; tenant A's objects were copied under B's keys
            sb = store_random_prefix(reg, t, 4, seed=3, salt="tenant-b")
            kb = PrefixKeys(sb.keyspace, sb.tokens, reg.chunk_tokens).window(0, 4)
            for a, b in zip(keys, kb, strict=True):
                raw_copy(t._store, a, b)
            rep = restorer.restore(fresh_request(sb, 4), t, 4)
            assert not rep.ok and rep.committed_tokens == 0 and "CorruptObjectError" in rep.error


def test_other_tenant_id_is_refused(tier, mooncake_master):
    """Without --enable_multi_tenants every client shares one namespace: the header's tenant
    keeps a client of tenant B from reading tenant A's object under the same key."""
    keys = keys_for(1, seed=5)
    tier.put(keys, payloads(1, seed=5))
    with MooncakeTier(C, FP, mooncake_master.master_address, mooncake_master.metadata_server,
                      global_segment_size=0, tenant_id="tenant-b") as other:
        with pytest.raises(CorruptObjectError, match="tenant"):
            fetch_into(other, keys)


@pytest.mark.parametrize("offset", [0, 5, 20, 30, 60, 100, 126, 128 + C // 2])
def test_damaged_header_or_payload_is_refused(tier, offset):
    keys = keys_for(1, seed=6 + offset)
    tier.put(keys, payloads(1, seed=6))
    blob = bytearray(tier._store.get(keys[0]))
    blob[offset] ^= 0x41
    assert tier._store.upsert(keys[0], bytes(blob)) == 0
    with pytest.raises(CorruptObjectError):
        fetch_into(tier, keys)


# ---------------------------------------------------------------------------------------------
# The LMCache Mooncake L2 plugin: the same object format, the same refusals (a refused object is
# a clear bit in the load bitmap, which fails the retrieve above closed)
# ---------------------------------------------------------------------------------------------
class _Obj:
    """The shape of an L1 MemoryObj as the plugin uses it (data_ptr, get_size, get_physical_size)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.data_ptr = t.data_ptr()

    def get_size(self) -> int:
        return self.t.numel()

    def get_physical_size(self) -> int:
        return self.t.numel()  # no padding: each object its own tensor


def _wait(poll, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while (r := poll()) is None:
        assert time.monotonic() < end, "plugin task did not complete"
        time.sleep(0.002)
    return r


@pytest.fixture(scope="module")
def plugin(mooncake_master):
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="lmcache 0.5.6 is not installed")
    from bsr_runtime.integrations.lmcache.mooncake_l2 import BSRMooncakeL2Adapter, BSRMooncakeL2AdapterConfig

    cfg = BSRMooncakeL2AdapterConfig(mooncake_master.master_address, mooncake_master.metadata_server,
                                     global_segment_size=64 << 20, connect_timeout_s=5.0)
    p = BSRMooncakeL2Adapter(cfg)
    yield p
    p.close()


def lmcache_keys(n: int, salt: str = "", seed: int = 0):
    from bsr_runtime.integrations.lmcache import model_name, object_keys

    g = torch.Generator().manual_seed(900 + seed)
    tokens = torch.randint(0, 50000, (n * 256,), generator=g).tolist()
    return object_keys(PrefixKeys(KeySpace(FP, salt=salt), tokens, 256).window(0, n), model_name(FP))


def plugin_store(p, keys, data) -> None:
    task = p.submit_store_task(keys, [_Obj(d) for d in data])
    res = _wait(lambda: p.pop_completed_store_tasks().get(task))
    assert int(res) >= 0


def plugin_load(p, keys) -> tuple[list[int], list[torch.Tensor]]:
    bufs = [torch.zeros(C, dtype=torch.uint8) for _ in keys]
    task = p.submit_load_task(keys, [_Obj(b) for b in bufs])
    return _wait(lambda: p.query_load_result(task)).get_indices_list(), bufs


def test_plugin_refuses_swapped_and_copied_objects(plugin):
    keys = lmcache_keys(3, seed=1)
    data = payloads(3, seed=11)
    plugin_store(plugin, keys, data)
    bits, bufs = plugin_load(plugin, keys)
    assert bits == [0, 1, 2] and all(torch.equal(b, d) for b, d in zip(bufs, data, strict=True))
    names = plugin._keys(keys)
    raw_swap(plugin._tier._store, names[0], names[1])
    bits, _ = plugin_load(plugin, keys)
    assert bits == [2]  # the swapped pair is two misses
    other = lmcache_keys(3, salt="tenant-b", seed=1)
    for a, b in zip(names, plugin._keys(other), strict=True):
        raw_copy(plugin._tier._store, a, b)
    bits, _ = plugin_load(plugin, other)
    assert bits == []


def test_plugin_refuses_damaged_and_headerless_objects(plugin):
    keys = lmcache_keys(2, seed=2)
    data = payloads(2, seed=12)
    plugin_store(plugin, keys, data)
    names = plugin._keys(keys)
    blob = bytearray(plugin._tier._store.get(names[0]))
    blob[-7] ^= 1
    assert plugin._tier._store.upsert(names[0], bytes(blob)) == 0
    assert plugin._tier._store.upsert(names[1], data[1].numpy().tobytes()) == 0  # no header
    bits, _ = plugin_load(plugin, keys)
    assert bits == []
