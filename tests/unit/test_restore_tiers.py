"""The windowed retrieve against real tiers: files on disk and a real Mooncake master.

Every restore checks the acceptance criteria of the paper: committed tokens == probed prefix
(cached-token accounting), the report names the tier the objects came from (tier isolation),
registration identity (another registration probes as a miss), and the canonical state hash
of the restored blocks equals the hash of what was stored.
"""

from __future__ import annotations

import pytest
from restore_util import fresh_request, store_random_prefix

from bsr_kernels import presets
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FETCH_HEADROOM, FilesystemTier

REGS = {
    "dsv4": lambda: presets.dsv4_flash(scale=1 / 64),
    "llama": lambda: presets.llama_like(layers=2, kv_heads=2, head_dim=16, block_size=16),
}
N_STORED = 7  # W = 3 does not divide it; the restores also use N = 6 (a multiple of 3)


def _restore_and_check(tier, sp, w, depth, n, seed):
    keys = PrefixKeys(sp.keyspace, sp.tokens, sp.reg.chunk_tokens)
    probe = probe_prefix(tier, keys)
    assert probe.prefix_chunks == sp.num_chunks and probe.tier == tier.name
    req = fresh_request(sp, seed)
    with BoundedRestorer(sp.reg, RestoreConfig(window_chunks=w, pipeline_depth=depth)) as restorer:
        rep = restorer.restore(req, tier, n)
        if restorer.staging is not None:
            assert restorer.staging.live_bytes == 0
    assert rep.ok, rep.error
    assert rep.tier == tier.name
    assert rep.committed_tokens == n * sp.reg.chunk_tokens <= probe.prefix_chunks * sp.reg.chunk_tokens
    assert rep.peak_staging_bytes == (min(w, n) if w else n) * sp.reg.chunk_bytes
    assert rep.header_room_bytes == (w if w else n) * FETCH_HEADROOM  # the pool's room, beside W*c
    if n == sp.num_chunks:
        assert state_hash(sp.reg, req.kv, req.block_tables, n) == sp.state_hash
    return rep


@pytest.fixture(scope="module", params=sorted(REGS))
def fs_stored(request, tmp_path_factory):
    reg = REGS[request.param]()
    root = tmp_path_factory.mktemp(f"fs-{request.param}")
    tier = FilesystemTier(root, reg.chunk_bytes, reg.fingerprint, load_concurrency=2)
    sp = store_random_prefix(reg, tier, N_STORED, seed=21)
    yield tier, sp
    tier.close()


@pytest.mark.parametrize("w", [0, 1, 3, 32])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n", [6, N_STORED])
def test_filesystem_restore(fs_stored, w, depth, n):
    tier, sp = fs_stored
    _restore_and_check(tier, sp, w, depth, n, seed=w + 10 * depth + n)


def test_filesystem_registration_mismatch_probes_as_miss(fs_stored):
    tier, sp = fs_stored
    other = presets.dsv4_flash(mtp=True, scale=1 / 64)
    probe = probe_prefix(tier, PrefixKeys(KeySpace(other.fingerprint), sp.tokens, sp.reg.chunk_tokens))
    assert probe.prefix_chunks == 0


@pytest.fixture(scope="module")
def mooncake_stored(mooncake_master):
    from bsr_runtime.tiers.mooncake import MooncakeTier

    made = []
    out = {}
    for name, make in REGS.items():
        reg = make()
        tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, mooncake_master.master_address,
                            mooncake_master.metadata_server, global_segment_size=64 << 20)
        made.append(tier)
        out[name] = (tier, store_random_prefix(reg, tier, N_STORED, seed=31))
    yield out
    for tier in made:
        tier.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("reg_name", sorted(REGS))
@pytest.mark.parametrize("w", [0, 1, 3, 32])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n", [6, N_STORED])
def test_mooncake_restore(mooncake_stored, reg_name, w, depth, n):
    tier, sp = mooncake_stored[reg_name]
    _restore_and_check(tier, sp, w, depth, n, seed=w + 10 * depth + n)


@pytest.mark.mooncake
def test_mooncake_registration_mismatch_probes_as_miss(mooncake_stored):
    tier, sp = mooncake_stored["dsv4"]
    other = presets.dsv4_flash(mtp=True, scale=1 / 64)
    probe = probe_prefix(tier, PrefixKeys(KeySpace(other.fingerprint), sp.tokens, sp.reg.chunk_tokens))
    assert probe.prefix_chunks == 0


@pytest.mark.mooncake
def test_objects_come_from_the_named_tier(mooncake_stored, tmp_path):
    """Tier isolation: a prefix stored only in Mooncake is a miss on an empty filesystem tier."""
    tier, sp = mooncake_stored["llama"]
    with FilesystemTier(tmp_path, sp.reg.chunk_bytes, sp.reg.fingerprint) as fs:
        keys = PrefixKeys(sp.keyspace, sp.tokens, sp.reg.chunk_tokens)
        assert probe_prefix(fs, keys).prefix_chunks == 0
        assert probe_prefix(tier, keys).prefix_chunks == sp.num_chunks


@pytest.mark.mooncake
@pytest.mark.parametrize("w, depth", [(0, 1), (3, 1), (3, 2), (32, 2)])
def test_mooncake_restore_from_a_store_host_lands_each_window_in_one_get(mooncake_stored, mooncake_master, w, depth):
    """A pure client (no segment) restoring what another client holds: every object crosses tcp
    and lands whole in the slot, its header in the room before its chunk: one get per fetched
    window (at depth 2 the plan's windows are slot-sized), no landing copy."""
    from bsr_runtime.tiers.mooncake import MooncakeTier

    holder, sp = mooncake_stored["dsv4"]
    reader = MooncakeTier(sp.reg.chunk_bytes, sp.reg.fingerprint, mooncake_master.master_address,
                          mooncake_master.metadata_server, global_segment_size=0)
    try:
        rep = _restore_and_check(reader, sp, w, depth, sp.num_chunks, seed=40 + w + depth)
        assert reader.stats["get_calls"] == reader.stats["fetches"] == rep.windows
        assert not reader._reads.landing._free and not reader._registrations.temp
    finally:
        reader.close()
