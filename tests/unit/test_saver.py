"""Saves off the engine's step (bsr_runtime/saver.py): the gather runs in save() on the caller's thread,
the puts on the saver's thread. Real files, real gathers; expected objects from the source blocks.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bsr_harness.experiments import make_source
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.testdata import block_tables, poison, without_heads
from bsr_kernels import presets
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.saver import Saver, resident_chunks_end
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier


def _reg():
    return presets.dsv4_flash(scale=1 / 64)


@pytest.fixture
def scene(tmp_path):
    reg = _reg()
    inner = FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint)
    tier = FaultyTier(inner, close_inner=False)
    src = make_source(reg, 6, seed=3)
    # every block resident (make_source leaves the sliding-window groups' early blocks out: -1)
    blocks, (tables,) = block_tables(reg, [6], 5, spare=0, holes="none")
    src.kv = reg.allocate(blocks)
    for t in src.kv:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8))
    src.block_tables = tables
    yield reg, inner, tier, src
    tier.close()
    inner.close()


def _saver(reg, tier, src, chunks: int) -> Saver:
    saver = Saver(reg, [tier], staging_chunks=chunks, keyspace=KeySpace(reg.fingerprint), backend="cpu")
    saver.kv = src.kv
    return saver


def _tables(src) -> list[list[int]]:
    return [t.tolist() for t in src.block_tables]


def _restored_hash(reg, tier, src, n: int) -> str:
    kv = poison(reg.allocate([t.numel() + 1 for t in src.block_tables]))
    tables = without_heads(reg, [torch.arange(t.numel(), dtype=torch.int64) for t in src.block_tables])
    with BoundedRestorer(reg, RestoreConfig(window_chunks=2, backend="torch")) as r:
        rep = r.restore(RequestOf(src, kv, tables), tier, n)
    assert rep.ok, rep.error
    return state_hash(reg, kv, tables, n)


def RequestOf(src, kv, tables) -> RestoreRequest:  # noqa: N802 - reads like the type it builds
    return RestoreRequest("check", src.tokens, src.keyspace, kv, tables)


def test_blocks_may_be_reused_as_soon_as_save_returns(scene):
    """The gather happens in save(): poisoning the source blocks right after it (a finished request's
    blocks handed to another one) changes nothing the puts write, even with the puts held in flight."""
    reg, inner, tier, src = scene
    expected = state_hash(reg, src.kv, src.block_tables, 6)
    gate = tier.plan.put_gate = threading.Event()
    saver = _saver(reg, tier, src, 8)
    try:
        assert saver.save("r", src.tokens, 0, 6, _tables(src), "") is None
        poison(src.kv)  # the engine reused the blocks
        saver.forget("r")  # and the request is gone
        gate.set()
        assert saver.wait_idle(30)
        (rec,) = saver.take_finished()
        assert rec["ok"] and rec["stored"] == 6 and rec["already_held"] == 0
        assert _restored_hash(reg, inner, src, 6) == expected
    finally:
        assert saver.close(10)


def test_a_save_without_staging_is_skipped_never_waited_for(scene):
    reg, inner, tier, src = scene
    gate = tier.plan.put_gate = threading.Event()
    saver = _saver(reg, tier, src, 3)
    try:
        assert saver.save("a", src.tokens, 0, 3, _tables(src), "") is None  # takes all 3 chunks of staging
        rec = saver.save("b", src.tokens, 0, 2, _tables(src), "other")  # nothing left: skipped at once
        assert rec is not None and rec["stored"] == 0 and "no save staging" in rec["skipped"]
        later = saver.save("b", src.tokens, 2, 4, _tables(src), "other")  # past the gap: never saved
        assert later is not None and "gap" in later["skipped"]
        gate.set()
        assert saver.wait_idle(30)
        assert inner.probe(PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens).window(0, 3)) == [True] * 3
        other = KeySpace(reg.fingerprint, salt="other")
        assert inner.probe(PrefixKeys(other, src.tokens, reg.chunk_tokens).window(0, 4)) == [False] * 4
    finally:
        assert saver.close(10)


def test_chunks_the_tier_holds_are_not_put_again_unless_overwritten(scene):
    reg, inner, tier, src = scene
    saver = _saver(reg, tier, src, 8)
    try:
        saver.save("a", src.tokens, 0, 4, _tables(src), "")
        saver.wait_idle(30)
        saver.save("b", src.tokens, 0, 6, _tables(src), "")
        saver.wait_idle(30)
        saver.save("c", src.tokens, 0, 6, _tables(src), "", overwrite=True)
        saver.wait_idle(30)
        recs = {r["request_id"]: r for r in saver.take_finished()}
        assert (recs["a"]["stored"], recs["b"]["stored"], recs["b"]["already_held"]) == (4, 2, 4)
        assert recs["c"]["stored"] == 6  # a rewrite puts every chunk
    finally:
        assert saver.close(10)


def _hybrid():
    """A full-attention group and a sliding-window group, 64-token blocks: 4 blocks per chunk each."""
    from bsr_kernels import Registration, TensorSpec

    specs = (TensorSpec("full.k", torch.float32, (2, 16), 64, group=0),
             TensorSpec("swa.k", torch.float32, (2, 16), 64, group=1, sliding_window=320))
    return Registration(specs, chunk_tokens=256, name="hybrid")


def test_a_chunk_whose_sliding_window_blocks_were_freed_is_not_saved():
    """Written out: chunk k covers blocks 4k..4k+3 of each group; a -1 (vLLM's null block: freed from
    the window) among a chunk's sliding-window blocks ends the run of savable chunks there."""
    reg = _hybrid()
    full = list(range(100, 124))  # 6 chunks, every block resident
    swa = list(range(200, 224))
    assert resident_chunks_end(reg, [full, swa], 0, 6) == 6
    freed = swa.copy()
    freed[9] = -1  # a block of chunk 2 left the window
    assert resident_chunks_end(reg, [full, freed], 0, 6) == 2
    assert resident_chunks_end(reg, [full, freed], 3, 6) == 6  # later chunks are whole again
    assert resident_chunks_end(reg, [full, swa[:15]], 0, 6) == 3  # the table ends inside chunk 3
    freed_all = [-1] * 16 + swa[16:]  # the window moved past chunks 0-3
    assert resident_chunks_end(reg, [full, freed_all], 0, 6) == 0


def test_freed_sliding_window_blocks_are_never_gathered_into_an_object(tmp_path):
    """A save over a freed block stores the chunks before it and stops; nothing with a zeroed part goes
    out under a valid checksum."""
    reg = _hybrid()
    kv = reg.allocate([300, 300])
    for t in kv:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8))
    full = list(range(100, 124))
    swa = list(range(200, 224))
    swa[13] = -1  # chunk 3
    tokens = list(range(6 * 256))
    with FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint) as tier:
        saver = Saver(reg, [tier], staging_chunks=8, keyspace=KeySpace(reg.fingerprint), backend="torch")
        saver.kv = kv
        try:
            saver.save("r", tokens, 0, 6, [full, swa], "")
            assert saver.wait_idle(30)
            (rec,) = saver.take_finished()
            assert rec["stored"] == 3 and rec["resident_chunks"] == 3
            keys = PrefixKeys(KeySpace(reg.fingerprint), tokens, 256).window(0, 6)
            assert tier.probe(keys) == [True, True, True, False, False, False]
            rec = saver.save("r", tokens, 4, 6, [full, swa], "")  # after the gap: never saved
            assert rec is not None and rec["stored"] == 0
        finally:
            assert saver.close(10)


def test_a_save_larger_than_the_staging_takes_what_fits_and_skips_the_rest(scene):
    """6 chunks, 4 of staging: the first 4 are gathered and put; the rest, finding no staging at once
    (the first piece's put is held), is skipped, never waited for."""
    reg, inner, tier, src = scene
    gate = tier.plan.put_gate = threading.Event()
    saver = _saver(reg, tier, src, 4)
    try:
        rec = saver.save("r", src.tokens, 0, 6, _tables(src), "")
        assert rec is not None and rec["first_chunk"] == 4 and "no save staging" in rec["skipped"]
        gate.set()
        assert saver.wait_idle(30)
        recs = saver.take_finished()
        assert sorted((r["first_chunk"], r["stored"]) for r in recs) == [(0, 4), (4, 0)]
        keys = PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens).window(0, 6)
        assert inner.probe(keys) == [True] * 4 + [False] * 2
    finally:
        assert saver.close(10)


class _LateHostStream:
    """A host stream whose work lands only when it is synchronized (a GPU gather into pinned host staging has
    not landed when its launch returns)."""

    def __init__(self) -> None:
        self.pending: list = []
        self.synchronized_on = set()

    def submit(self, fn) -> None:
        self.pending.append(fn)

    def synchronize(self) -> None:
        self.synchronized_on.add(threading.current_thread().name)
        while self.pending:
            self.pending.pop(0)()


def test_a_put_waits_for_its_gather_to_land_off_the_step_thread(scene, monkeypatch):
    """The gather runs on a stream and lands later (on a GPU it does): the put thread waits for it before it
    reads the staging, so the stored objects are the gathered bytes, never what the staging held before; the
    step thread (save) does not wait. Fails if the put reads at once (it stores the poisoned staging)."""
    import bsr_runtime.saver as saver_mod
    from bsr_kernels import gather_window

    reg, inner, tier, src = scene
    expected = state_hash(reg, src.kv, src.block_tables, 6)
    stream = _LateHostStream()

    def late_gather(out, reg_, kv, tables, first, n, *, backend="auto", stream=None, end_tokens=None):
        out.fill_(0xA5)  # what the staging holds until the gather lands
        stream.submit(lambda: gather_window(out, reg_, kv, tables, first, n, backend="torch", end_tokens=end_tokens))
        return "late"

    monkeypatch.setattr(saver_mod, "gather_window", late_gather)
    saver = Saver(reg, [tier], staging_chunks=8, keyspace=KeySpace(reg.fingerprint), backend="cpu", stream=stream)
    saver.kv = src.kv
    try:
        assert saver.save("r", src.tokens, 0, 6, _tables(src), "") is None
        assert threading.current_thread().name not in stream.synchronized_on  # the step did not wait
        assert saver.wait_idle(30)
        (rec,) = saver.take_finished()
        assert rec["ok"] and rec["stored"] == 6, rec
        assert stream.synchronized_on == {"bsr-save"}
    finally:
        saver.close(10)
    assert saver.arena.live_bytes == 0
    assert _restored_hash(reg, inner, src, 6) == expected
