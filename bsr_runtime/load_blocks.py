"""Which blocks of a request a load (or a save of a partial chunk) may touch: decided once, from the
engine's block lists, as per-group block ids with -1 where nothing is written (install and gather skip
-1; a failed load reports only the others). Engine-neutral."""

from __future__ import annotations

import math

from bsr_kernels import Registration


def block_align(reg: Registration) -> int:
    """Tokens a prefix ending inside a chunk is a multiple of: whole blocks of every group."""
    return math.lcm(*(reg.group_tokens_per_block(g) for g in range(reg.num_groups)))


def without_local_blocks(reg: Registration, blocks: list[list[int]], local_tokens: int) -> list[list[int]]:
    """Per group, the block ids with those wholly inside the engine's local hit (tokens
    0..local_tokens-1) set to -1: install skips them and a failure never reports them."""
    out = []
    for g, ids in enumerate(blocks):
        n = min(len(ids), local_tokens // reg.group_tokens_per_block(g))
        out.append([-1] * n + list(ids[n:]))
    return out


def only_blocks_of(reg: Registration, blocks: list[list[int]], start: int, end: int, num_chunks: int
                   ) -> list[list[int]]:
    """Per group, the block ids of tokens start..end-1 (a load's), -1 elsewhere, for `num_chunks` whole
    chunks: the local hit before and the blocks past a prefix ending inside its last chunk are
    neither written nor reported."""
    out = []
    for g, ids in enumerate(without_local_blocks(reg, blocks, start)):
        tpb = reg.group_tokens_per_block(g)
        stop, need = -(-end // tpb), reg.blocks_needed(g, num_chunks * reg.chunk_tokens)
        out.append(list(ids[:stop]) + [-1] * max(0, need - min(stop, len(ids))))
    return out
