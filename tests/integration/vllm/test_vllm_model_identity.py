"""The model identity in a real engine: objects are bound to the checkpoint's weights, not its path.
A copy of the checkpoint elsewhere restores what the original saved; the original rewritten in
place with other weights misses, and its output is the new weights' own cold output."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")

import vllm_util as U  # noqa: E402

CHUNKS = 6


def test_copy_hits_rewrite_in_place_misses(tmp_path):
    model = U.build_tiny_llama(tmp_path / "latest", seed=3)
    tokens = U.prompt(CHUNKS * U.CHUNK + 21, seed=41)
    kv = U.kv_transfer([{"type": "filesystem", "root": str(tmp_path / "fs")}], window_chunks=4)

    llm = U.make_llm(model, kv)  # engine A: the old weights, saved
    try:
        old = U.generate(llm, tokens)
    finally:
        U.shutdown(llm)

    copy = tmp_path / "mounted-elsewhere" / "latest"
    shutil.copytree(model, copy)
    llm = U.make_llm(str(copy), kv)  # the same weights at another path: restored
    try:
        got = U.generate(llm, tokens)
        assert U.worker_connector().worker.loads[-1]["committed"]
    finally:
        U.shutdown(llm)
    assert got[2] == CHUNKS * U.CHUNK
    assert got[:2] == old[:2]

    U.build_tiny_llama(model, seed=8)  # the checkpoint rewritten in place: same path, names and shapes
    llm = U.make_llm(model)  # the new weights' cold output, without the connector
    try:
        cold_new = U.generate(llm, tokens)
    finally:
        U.shutdown(llm)
    assert cold_new[0] != old[0]  # the two checkpoints really answer differently

    llm = U.make_llm(model, kv)  # engine B on the rewritten checkpoint: must not restore A's state
    try:
        got = U.generate(llm, tokens)
        worker = U.worker_connector().worker
        assert len(worker.loads) == 0
        assert U.scheduler_connector(llm).scheduler.planner.stats.probes >= 1  # it looked, and missed
    finally:
        U.shutdown(llm)
    assert got[2] == 0
    assert got[:2] == cold_new[:2]
