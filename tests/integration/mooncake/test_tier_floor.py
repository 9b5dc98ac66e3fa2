"""The tier's own floor (bsr_harness/tier_floor.py: what `bsr wlaw` and `bsr sweep --baseline` print beside
BSR's seconds) against a real mooncake_master: it times a read of every object at every W asked for, and
raises, instead of reporting a time, when an object is missing or lands damaged."""

from __future__ import annotations

import pytest
from mooncake_util import flipped, payloads, segment_address

from bsr_harness.tier_floor import tier_floor
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers.filesystem import FilesystemTier
from bsr_runtime.tiers.mooncake_object import HEADER_SIZE

CHUNK = 4096
FP = "tier-floor-test"
CT = 4  # tokens a chunk: the keys of a prefix of 4-token chunks


def prefix(num_chunks: int) -> PrefixKeys:
    return PrefixKeys(KeySpace(FP, salt="tier-floor"), list(range(100, 100 + CT * num_chunks)), CT)


@pytest.fixture(scope="module")
def holder(mooncake_module_tier_factory):
    """A client whose segment holds six objects (the floor reads them through a client of its own)."""
    tier = mooncake_module_tier_factory(CHUNK, FP)
    keys = prefix(6).window(0, 6)
    tier.put(keys, payloads(len(keys), 0, CHUNK))
    return tier, keys


def test_every_w_is_timed(holder):
    tier, keys = holder
    out = tier_floor(tier, prefix(6), 6, [2, 4, 0], repeat=2)
    assert sorted(out) == [0, 2, 4]
    assert all(s > 0 for s in out.values())


def test_a_missing_object_raises(holder):
    tier, keys = holder
    never_put = prefix(7).window(6, 1)[0]
    with pytest.raises(RuntimeError, match=never_put):
        tier_floor(tier, prefix(7), 7, [7], repeat=1)


def test_a_damaged_payload_raises(holder):
    tier, keys = holder
    at = segment_address(tier, keys[3], CHUNK)
    with flipped(at + HEADER_SIZE + 100, 0x10), pytest.raises(RuntimeError, match="landed wrong"):
        tier_floor(tier, prefix(6), 6, [2], repeat=1)


def test_a_tier_without_a_floor_gives_none(tmp_path):
    with FilesystemTier(tmp_path, CHUNK, FP) as fs:
        assert tier_floor(fs, prefix(1), 1, [1], repeat=1) is None
