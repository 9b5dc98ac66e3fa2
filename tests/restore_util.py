"""Helpers for runtime tests: a stored source state and fresh destinations for a restore."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_util import random_kv

from bsr_harness.testdata import poisoned, request_tables
from bsr_kernels import Registration
from bsr_runtime.keys import KeySpace
from bsr_runtime.restore import RestoreRequest
from bsr_runtime.store import store_prefix


@dataclass
class StoredPrefix:
    reg: Registration
    tokens: list[int]
    keyspace: KeySpace
    num_chunks: int
    state_hash: str


def random_tables(reg: Registration, num_chunks: int, seed: int, spare: int = 2,
                  sliding_holes: bool = True) -> tuple[list[int], list[torch.Tensor]]:
    """Shuffled block tables covering the prefix (bsr_harness.testdata.request_tables)."""
    return request_tables(reg, num_chunks, seed, spare=spare, holes="third" if sliding_holes else "none")


def store_random_prefix(reg: Registration, tier, num_chunks: int, seed: int = 0, salt: str = "",
                        tp_rank: int = 0, tp_world: int = 1, window_chunks: int = 4) -> StoredPrefix:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_chunks * reg.chunk_tokens,), generator=gen).tolist()
    blocks, tables = random_tables(reg, num_chunks, seed + 1)
    kv = random_kv(reg, blocks, seed + 2)
    space = KeySpace(reg.fingerprint, tp_rank, tp_world, salt)
    rep = store_prefix(reg, tier, space, tokens, kv, tables, window_chunks=window_chunks)
    assert rep.num_chunks == num_chunks
    return StoredPrefix(reg, tokens, space, num_chunks, rep.state_hash)


def fresh_request(stored: StoredPrefix, seed: int, request_id: str = "req-0") -> RestoreRequest:
    """Destinations for a restore of `stored`: other block ids than the source, poisoned."""
    blocks, tables = random_tables(stored.reg, stored.num_chunks, seed + 100)
    kv = poisoned(stored.reg, blocks)
    return RestoreRequest(request_id, stored.tokens, stored.keyspace, kv, tables)
