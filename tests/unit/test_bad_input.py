"""Issue 7's bad input and damaged data at the restore level, on real files.

Bad input: a clear ValueError before any byte moves (no fetch is even submitted, destinations
stay poisoned). Damaged data: the restore fails closed (nothing committed, staging released),
and nothing outside the tier root is read.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from restore_util import fresh_request, store_random_prefix

from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.testdata import POISON
from bsr_kernels import presets
from bsr_runtime.keys import PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers.filesystem import pack_header

REG = presets.dsv4_flash(scale=1 / 64)
MTP = presets.dsv4_flash(mtp=True, scale=1 / 64)
N = 6


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    tier = FaultyTier(FilesystemTier(root, REG.chunk_bytes, REG.fingerprint))
    sp = store_random_prefix(REG, tier, N, seed=41)
    yield tier, sp
    tier.close()


def _no_fetch(tier):
    calls = []
    tier.plan.fail_fetch = calls.append
    return calls


def _untouched(req) -> bool:
    return all(bool((t.view(torch.uint8) == POISON).all()) for t in req.kv)


def _poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(POISON)
    return t


def _mutate_dtype(req):
    req.kv[0] = _poisoned(req.kv[0].shape, torch.float32)


def _mutate_noncontig(req):
    t = req.kv[5]
    req.kv[5] = _poisoned((*t.shape[:-1], t.shape[-1] * 2), t.dtype)[..., ::2]


def _mutate_alias(req):
    req.kv[1] = req.kv[0]


def _mutate_duplicate(req):
    req.block_tables[2][1] = req.block_tables[2][0]


def _mutate_range(req):
    req.block_tables[2][0] = 10_000


def _mutate_short(req):
    req.block_tables[1] = req.block_tables[1][:1]


@pytest.mark.parametrize("mutate,match", [
    (_mutate_dtype, "dtype"),
    (_mutate_noncontig, "innermost stride is 2"),
    (_mutate_alias, "overlap in memory"),
    (_mutate_duplicate, "duplicated block ids"),
    (_mutate_range, "out of range"),
    (_mutate_short, "too short"),
])
def test_bad_destinations_rejected_before_any_byte_moves(stored, mutate, match):
    tier, sp = stored
    req = fresh_request(sp, seed=1)
    mutate(req)
    calls = _no_fetch(tier)
    try:
        with BoundedRestorer(REG, RestoreConfig(window_chunks=2)) as r, pytest.raises(ValueError, match=match):
            r.restore(req, tier, N)
    finally:
        tier.clear()
    assert calls == [] and _untouched(req)


def test_registration_mismatch_between_store_and_engine(stored, tmp_path):
    """A 170-tensor engine against a tier of 167-tensor objects: refused before any byte moves."""
    tier, sp = stored
    calls = _no_fetch(tier)
    try:
        with BoundedRestorer(MTP, RestoreConfig(window_chunks=2)) as r:
            req = fresh_request(sp, seed=2)
            with pytest.raises(ValueError, match="another registration"):
                r.restore(req, tier, N)  # the request's keys are the 167-tensor ones
            with FilesystemTier(tmp_path, MTP.chunk_bytes, REG.fingerprint) as odd:
                from bsr_runtime.keys import KeySpace

                req.keyspace = KeySpace(MTP.fingerprint)
                with pytest.raises(ValueError, match="was opened for registration"):
                    r.restore(req, odd, N)
    finally:
        tier.clear()
    assert calls == []


def test_chunk_size_other_than_the_registrations(stored, tmp_path):
    _, sp = stored
    with FilesystemTier(tmp_path, REG.chunk_bytes + 16, REG.fingerprint) as odd:
        with BoundedRestorer(REG, RestoreConfig(window_chunks=2)) as r:
            req = fresh_request(sp, seed=3)
            with pytest.raises(ValueError, match="holds objects of"):
                r.restore(req, odd, N)
    assert _untouched(req)


def test_staging_smaller_than_one_window():
    with pytest.raises(ValueError, match="exceeds the staging capacity"):
        BoundedRestorer(REG, RestoreConfig(window_chunks=4, max_staging_bytes=3 * REG.chunk_bytes))


# -- damaged data: fail closed, nothing outside the root ---------------------------------------

def _damage_truncate(path, outside):
    os.truncate(path, os.path.getsize(path) // 2)


def _damage_flip(path, outside):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _damage_foreign_header(path, outside):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
    head = pack_header(MTP.fingerprint[:32].encode(), bytes(data[64:96]), REG.chunk_bytes,
                       int.from_bytes(data[6:8], "little"), int.from_bytes(data[24:28], "little"))
    data[: len(head)] = head
    with open(path, "wb") as f:
        f.write(data)


def _damage_directory(path, outside):
    os.remove(path)
    os.mkdir(path)


def _damage_symlink(path, outside):
    shutil.copyfile(path, outside)  # valid-looking content outside the root
    os.remove(path)
    os.symlink(outside, path)


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_foreign_header, _damage_directory,
                                    _damage_symlink], ids=lambda f: f.__name__[8:])
@pytest.mark.parametrize("depth", [1, 2])
def test_damaged_object_fails_closed(tmp_path, damage, depth):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside.bsr"
    with FilesystemTier(root, REG.chunk_bytes, REG.fingerprint) as tier:
        sp = store_random_prefix(REG, tier, N, seed=43)
        victim = PrefixKeys(sp.keyspace, sp.tokens, REG.chunk_tokens).window(3, 1)[0]
        damage(tier.path_of(victim), str(outside))
        before = os.stat(outside).st_atime_ns if outside.exists() else None
        with BoundedRestorer(REG, RestoreConfig(window_chunks=2, pipeline_depth=depth)) as r:
            req = fresh_request(sp, seed=4)
            rep = r.restore(req, tier, N)
            assert not rep.ok and rep.committed_tokens == 0
            assert "CorruptObjectError" in rep.error or "MissingObjectError" in rep.error, rep.error
            assert r.staging.live_bytes == 0
        if before is not None:  # the symlink target outside the root was never opened
            assert os.stat(outside).st_atime_ns == before
        # the undamaged tier still restores a healthy prefix
        sp2 = store_random_prefix(REG, tier, 3, seed=44, salt="healthy")
        with BoundedRestorer(REG, RestoreConfig(window_chunks=2, pipeline_depth=depth)) as r:
            req2 = fresh_request(sp2, seed=5)
            rep2 = r.restore(req2, tier, 3)
        assert rep2.ok and state_hash(REG, req2.kv, req2.block_tables, 3) == sp2.state_hash
