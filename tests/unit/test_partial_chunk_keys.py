"""The prompt's partial chunk (issue 40): its key is never a whole chunk's nor another partial chunk's, the planner
exposes it only where every TP rank holds it, a load writes and reports only the blocks up to where
the prefix ends, and the dead partial chunks a whole chunk makes are the ones a shorter prompt stored."""

from __future__ import annotations

import torch

from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import Registration, TensorSpec
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.load_blocks import block_align, only_blocks_of
from bsr_runtime.planner import Planner

CT = 256
SPACE = KeySpace("f" * 16)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 for i in range(n)]


def test_a_tail_key_is_apart_from_chunks_and_other_tails():
    t = _tokens(3 * CT + 200)
    whole = PrefixKeys(SPACE, t[: 4 * CT] + [0] * 56, CT).window(0, 3)
    partial = PrefixKeys(SPACE, t, CT, 192).window(0, 4)
    assert partial[:3] == whole[:3]  # the whole chunks keep their keys
    assert partial[3] not in whole
    assert PrefixKeys(SPACE, t, CT, 128).window(3, 1)[0] != partial[3]  # another length
    other = t[:-200] + _tokens(200, seed=9)
    assert PrefixKeys(SPACE, other, CT, 192).window(3, 1)[0] != partial[3]  # other tokens
    padded = t[: 3 * CT + 192] + [5] * 60
    assert PrefixKeys(SPACE, padded, CT, 192).window(3, 1)[0] == partial[3]  # later tokens do not count


def test_the_dead_tails_of_a_whole_chunk_are_the_shorter_prompts_tails():
    longer = _tokens(3 * CT + 10)
    candidates = PrefixKeys(SPACE, longer, CT).partial_candidates(2, 64)
    for n in (64, 128, 192):
        shorter = longer[: 2 * CT + n + 7]
        assert PrefixKeys(SPACE, shorter, CT, n).window(2, 1)[0] in candidates
    assert len(candidates) == 3


def _reg() -> Registration:
    return Registration((TensorSpec("k", torch.float32, (8,), 64, group=0),
                         TensorSpec("w", torch.float32, (8,), 32, group=1, sliding_window=128)), chunk_tokens=CT)


def test_a_load_writes_only_the_blocks_of_its_tokens():
    reg = _reg()
    assert block_align(reg) == 64
    blocks = [list(range(100, 116)), list(range(200, 230))]  # 1024 and 960 tokens' worth
    out = only_blocks_of(reg, blocks, 320, 960, 4)
    assert out[0] == [-1] * 5 + list(range(105, 115)) + [-1]  # tokens 320..959 of 1024
    assert out[1] == [-1] * 10 + list(range(210, 230)) + [-1] * 2


class _Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.prompt_token_ids, self.num_prompt_tokens = rid, tokens, len(tokens)


def _put(tier: MemoryTier, keys: list[str]) -> None:
    tier.put(keys, [torch.zeros(tier.chunk_bytes, dtype=torch.uint8)] * len(keys))


def test_the_tail_is_exposed_only_where_every_rank_holds_it():
    reg = _reg()
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    t = _tokens(2 * CT + 200)
    planner = Planner(reg, [tier], tp_world=2, restore_partial_chunk=True)
    for r in (0, 1):
        space = KeySpace(reg.fingerprint, r, 2)
        _put(tier, PrefixKeys(space, t, CT).window(0, 2))
    assert planner.match(_Req("a", t), 0) == 2 * CT  # no partial chunk: whole chunks
    _put(tier, PrefixKeys(KeySpace(reg.fingerprint, 0, 2), t, CT, 192).window(2, 1))
    assert planner.match(_Req("b", t), 0) == 2 * CT  # rank 1 lacks it
    _put(tier, PrefixKeys(KeySpace(reg.fingerprint, 1, 2), t, CT, 192).window(2, 1))
    assert planner.match(_Req("c", t), 0) == 2 * CT + 192  # (2*256+199)//64*64
    spec = planner.allocated(_Req("c", t), [list(range(20)), list(range(40))], 2 * CT + 192)
    assert (spec.num_chunks, spec.num_tokens, spec.partial_tokens) == (3, 2 * CT + 192, 192)
    aligned = _tokens(3 * CT, seed=4)
    for r in (0, 1):
        _put(tier, PrefixKeys(KeySpace(reg.fingerprint, r, 2), aligned, CT).window(0, 3))
    assert planner.match(_Req("d", aligned), 0) == 3 * CT - 64  # the last chunk in part, no partial chunk needed
    assert Planner(reg, [tier], tp_world=2).match(_Req("e", aligned), 0) == 2 * CT  # restore_partial_chunk off
    tier.close()


def _ref_h(*parts: bytes) -> bytes:
    """The key chain's hash, written out here from its definition (keys.py): blake2b-128 over each part
    framed by its length (8 bytes, little-endian)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


def test_keys_follow_the_chain_definition_for_every_kind_of_id_container():
    """Known answers, computed apart from keys.py: chunk k's hash chains chunk k-1's over its ids as int64
    little-endian bytes; the partial chunk's chains the last whole chunk's under a marker and its count. The
    stored objects of every earlier version stay reachable only while this holds."""
    import numpy as np

    t = [1, 0, 5, 2**40, 29999] + _tokens(2 * CT + 64 - 5, seed=3)
    h, want = b"\0" * 16, []
    for k in range(2):
        h = _ref_h(h, b"".join(x.to_bytes(8, "little", signed=True) for x in t[k * CT : (k + 1) * CT]))
        want.append(h.hex())
    tail = b"".join(x.to_bytes(8, "little", signed=True) for x in t[2 * CT :])
    want.append(_ref_h(h, b"partial chunk", b"64", tail, b"").hex())
    for ids in (t, tuple(t), torch.tensor(t), np.asarray(t, dtype=np.int64)):
        got = PrefixKeys(SPACE, ids, CT, 64).window(0, 3)
        assert [k.rsplit("-", 1)[1] for k in got] == want
    assert [k.rsplit("-", 1)[1] for k in PrefixKeys(SPACE, t, CT).partial_candidates(1, 64)][0] == \
        _ref_h(bytes.fromhex(want[0]), b"partial chunk", b"64",
               b"".join(x.to_bytes(8, "little", signed=True) for x in t[CT : CT + 64]), b"").hex()
