"""Registration model and presets."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bsr_kernels import Registration, TensorSpec, presets
from bsr_kernels.registration import SEGMENT_ALIGN


def test_dsv4_tensor_counts_and_chunk_bytes():
    off, on = presets.dsv4_flash(), presets.dsv4_flash(mtp=True)
    assert off.num_tensors == 167 and on.num_tensors == 170
    assert off.num_groups == on.num_groups == 5
    # c: what a chunk ending a prefix needs (vLLM's registration of the Flash layout; checked against vLLM's
    # own objects in test_dsv4_registration.py), within 0.02% of the paper's 16,408,576 B
    assert off.chunk_bytes == presets.DSV4_CHUNK_BYTES == 16_406_080
    assert abs(off.chunk_bytes / presets.PAPER_DSV4_CHUNK_BYTES - 1) < 2e-4
    every = sum(off.chunk_tokens // s.token_ratio * s.entry_bytes for s in off.specs)
    assert every == presets.DSV4_EVERY_ENTRY_BYTES == 83_436_096
    kinds = {s.name.split(".attn")[-1] for s in off.specs}
    assert kinds == {".swa_cache", "", ".indexer.k_cache", ".compressor.state_cache",
                     ".indexer.compressor.state_cache"}
    assert {s.token_ratio for s in off.specs} == {1, 4, 128}
    assert sum(s.name.endswith("swa_cache") for s in off.specs) == 43
    assert all(s.entry_bytes == 584 for s in off.specs if s.dtype == torch.uint8 and "indexer" not in s.name)
    assert all(s.entry_bytes == 132 for s in off.specs if s.name.endswith("indexer.k_cache"))
    assert {s.dtype for s in off.specs} == {torch.uint8, torch.float32}
    assert {g: off.group_tail_tokens(g) for g in range(5)} == {0: 128, 1: 128, 2: None, 3: 8, 4: 128}


def test_segments_are_aligned_and_disjoint():
    reg = presets.dsv4_flash(scale=1 / 16)
    offs = reg.segment_offsets
    for i in range(reg.num_tensors):
        assert offs[i] % SEGMENT_ALIGN == 0
        end = offs[i] + reg.segment_bytes(i)
        nxt = offs[i + 1] if i + 1 < reg.num_tensors else reg.chunk_bytes
        assert end <= nxt
    assert reg.chunk_bytes % SEGMENT_ALIGN == 0


@pytest.mark.parametrize("scale", [1 / 2, 1 / 16, 1 / 64, 1 / 256])
def test_scale_keeps_structure(scale):
    full, small = presets.dsv4_flash(), presets.dsv4_flash(scale=scale)
    assert small.num_tensors == full.num_tensors
    assert small.chunk_bytes < full.chunk_bytes
    for a, b in zip(full.specs, small.specs):
        assert (a.dtype, a.token_ratio, a.block_size, a.group) == (b.dtype, b.token_ratio, b.block_size, b.group)
        assert b.entry_bytes % 8 == 0 and b.entry_bytes >= 8
        if a.entry_bytes % 16:  # 584-byte rows stay narrow-access rows when scaled
            assert b.entry_bytes % 16 == 8


def test_scale_out_of_range():
    with pytest.raises(ValueError, match="scale"):
        presets.dsv4_flash(scale=0)
    with pytest.raises(ValueError, match="scale"):
        presets.dsv4_flash(scale=2)


def test_fingerprint_is_stable_and_sensitive():
    reg = presets.dsv4_flash(scale=1 / 64)
    assert reg.fingerprint == presets.dsv4_flash(scale=1 / 64).fingerprint
    assert reg.fingerprint != presets.dsv4_flash(mtp=True, scale=1 / 64).fingerprint
    assert reg.fingerprint != presets.dsv4_flash(scale=1 / 32).fingerprint
    base = presets.llama_like()
    fps = {base.fingerprint, Registration(tuple(dataclasses.replace(s, block_size=32) for s in base.specs)).fingerprint}
    variants = [
        dataclasses.replace(base.specs[0], dtype=torch.float16),
        dataclasses.replace(base.specs[0], entry_shape=(2, 32)),
        dataclasses.replace(base.specs[0], name="other"),
    ]
    for v in variants:
        fps.add(Registration((v, *base.specs[1:])).fingerprint)
    fps.add(Registration(base.specs[::-1]).fingerprint)
    fps.add(Registration(base.specs, chunk_tokens=512).fingerprint)
    assert len(fps) == len(variants) + 4


def test_round_trip_through_dict():
    reg = presets.dsv4_flash(mtp=True, scale=1 / 64)
    again = Registration.from_dict(json.loads(json.dumps(reg.to_dict())))
    assert again.fingerprint == reg.fingerprint
    assert again.chunk_bytes == reg.chunk_bytes


def test_allocate_shapes():
    reg = presets.dsv4_flash(scale=1 / 64)
    kv = reg.allocate([10, 20, 30, 40, 50])
    for spec, t in zip(reg.specs, kv):
        assert t.shape == (10 + 10 * spec.group, spec.block_size, *spec.entry_shape)
        assert t.dtype == spec.dtype


@pytest.mark.parametrize("bad,match", [
    (dict(specs=()), "at least one tensor"),
    (dict(specs=(TensorSpec("a", torch.uint8, (8,), 16, token_ratio=3),)), "not a multiple of token_ratio"),
    (dict(specs=(TensorSpec("a", torch.uint8, (8,), 16), TensorSpec("a", torch.uint8, (8,), 16))), "duplicate"),
    (dict(specs=(TensorSpec("a", torch.uint8, (8,), 16, group=1),)), "without gaps"),
    (dict(specs=(TensorSpec("a", torch.uint8, (8,), 16), TensorSpec("b", torch.uint8, (8,), 64, 4))),
     "tokens per block"),
])
def test_bad_registrations(bad, match):
    with pytest.raises(ValueError, match=match):
        Registration(**bad)


@pytest.mark.parametrize("kw,match", [
    (dict(entry_shape=(0,)), "non-positive"),
    (dict(block_size=0), "block_size"),
    (dict(token_ratio=0), "token_ratio"),
    (dict(dtype=torch.complex64), "unsupported dtype"),
])
def test_bad_specs(kw, match):
    args = dict(name="x", dtype=torch.uint8, entry_shape=(8,), block_size=16) | kw
    with pytest.raises(ValueError, match=match):
        TensorSpec(**args)


def test_tail_tokens_shrink_the_segment_and_keep_other_fingerprints():
    """A group whose objects hold only each chunk's tail: its segments are the tail's entries, the rest
    unchanged; a registration without tails keeps its fingerprint (tail_tokens appears only when set)."""
    plain = (TensorSpec("swa", torch.uint8, (584,), 64, sliding_window=128),
             TensorSpec("kv", torch.uint8, (584,), 64, 4, 1))
    tailed = (dataclasses.replace(plain[0], tail_tokens=128), plain[1])
    a, b = Registration(plain), Registration(tailed)
    assert "tail_tokens" not in json.dumps(a.to_dict())
    assert a.fingerprint != b.fingerprint
    assert b.segment_bytes(0) == 128 * 584 and a.segment_bytes(0) == 256 * 584
    assert b.segment_bytes(1) == a.segment_bytes(1) == 64 * 584
    assert b.tail_groups == {0} and a.tail_groups == frozenset()
    assert b.chunk_blocks(0, 3) == (14, 16) and b.chunk_blocks(1, 3) == (3, 4) and a.chunk_blocks(0, 3) == (12, 16)
    assert Registration.from_dict(b.to_dict()).fingerprint == b.fingerprint


@pytest.mark.parametrize("specs,match", [
    (lambda: (TensorSpec("a", torch.uint8, (8,), 64, tail_tokens=100),), "whole number of 64-token blocks"),
    (lambda: (TensorSpec("a", torch.uint8, (8,), 64, tail_tokens=512),), "inside a chunk of 256"),
    (lambda: (TensorSpec("a", torch.uint8, (8,), 64, tail_tokens=128), TensorSpec("b", torch.uint8, (8,), 64)),
     "disagree on tail_tokens"),
])
def test_bad_tails(specs, match):
    with pytest.raises(ValueError, match=match):
        Registration(specs())
