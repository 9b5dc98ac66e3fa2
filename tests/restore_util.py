"""Helpers for runtime tests: a stored source state and fresh destinations for a restore."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_util import POISON, random_kv

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
    """Shuffled block tables covering the prefix; group 0 of a windowed registration gets -1
    blocks before its window, as an engine marks blocks outside a sliding window."""
    gen = torch.Generator().manual_seed(seed)
    blocks, tables = [], []
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, num_chunks * reg.chunk_tokens)
        blocks.append(need + spare)
        table = torch.randperm(need + spare, generator=gen)[:need]
        windowed = any(s.sliding_window for s in reg.specs if s.group == g)
        if sliding_holes and windowed and need > 4:
            table[: need // 3] = -1
        tables.append(table)
    return blocks, tables


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
    kv = stored.reg.allocate(blocks)
    for t in kv:
        t.view(torch.uint8).fill_(POISON)
    return RestoreRequest(request_id, stored.tokens, stored.keyspace, kv, tables)
