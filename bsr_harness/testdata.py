"""Test data shared by tests, benchmarks and the harness: the poison byte, poisoned destinations
and random block tables.

Two table builders cover every use:
- `block_tables`: whole-prefix tables of one or several requests sharing one set of destination
  tensors (disjoint shuffled block ids, sliding-window groups with -1 blocks as an engine marks
  them); what restores and the fault matrix use.
- `window_tables`: tables for the window of chunks first..first+num-1 with random holes and
  sentinel ids before (and optionally after) the window; what kernel tests use.
Both draw from a torch.Generator (or a seed) in a fixed order, so a seed names one data set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from bsr_kernels import Registration

POISON = 0xA5  # destination bytes before a restore: anything still POISON was never written

HOLES = ("none", "third", "window")


def poison(kv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fill every tensor's bytes with POISON (in place); returns them."""
    for t in kv:
        t.view(torch.uint8).fill_(POISON)
    return list(kv)


def poisoned(reg: Registration, num_blocks: Sequence[int], device: torch.device | str | None = None
             ) -> list[torch.Tensor]:
    """Freshly allocated destination tensors of `reg`, every byte POISON."""
    kv = reg.allocate(list(num_blocks)) if device is None else reg.allocate(list(num_blocks), device)
    return poison(kv)


def _generator(gen: torch.Generator | int) -> torch.Generator:
    return torch.Generator().manual_seed(gen) if isinstance(gen, int) else gen


def _heads(reg: Registration, group: int, table: torch.Tensor) -> None:
    """In a group whose objects hold only each chunk's tail, the blocks of every chunk before its tail
    are -1 (in place), as the engine's sliding window leaves them (`table` starts at a chunk boundary)."""
    if reg.group_tail_tokens(group) is not None:
        tables = [torch.empty(0, dtype=torch.int64)] * reg.num_groups
        tables[group] = table
        table.copy_(reg.without_heads(tables)[group])


def without_heads(reg: Registration, tables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Whole-request tables (from chunk 0) as an engine holds them after a restore: in a group whose
    objects hold only each chunk's tail, the blocks before every chunk's tail -1 (copies)."""
    return reg.without_heads(list(tables))


def _holes(reg: Registration, group: int, table: torch.Tensor, mode: str) -> None:
    """Mark blocks a sliding window no longer holds as -1 (in place)."""
    window = max((s.sliding_window or 0) for s in reg.specs if s.group == group)
    need = len(table)
    _heads(reg, group, table)
    if not window or mode == "none":
        return
    if mode == "third" and need > 4:
        table[: need // 3] = -1
    elif mode == "window":
        keep_blocks = -(-window // reg.group_tokens_per_block(group)) + 1
        table[: max(0, need - keep_blocks)] = -1


def block_tables(reg: Registration, num_chunks_per_request: Sequence[int], gen: torch.Generator | int,
                 spare: int = 1, holes: str = "third") -> tuple[list[int], list[list[torch.Tensor]]]:
    """Disjoint shuffled block tables for requests sharing one set of destination tensors:
    (blocks per group, per request the per-group tables). `spare` unused blocks per group. In a group
    whose objects hold only each chunk's tail, the blocks before every chunk's tail are -1.
    `holes` for sliding-window groups: "third" (the first third of a table longer than 4 blocks
    is -1), "window" (every block before the ones the window keeps is -1) or "none"."""
    if holes not in HOLES:
        raise ValueError(f"holes must be one of {HOLES}, got {holes!r}")
    gen = _generator(gen)
    per_req: list[list[torch.Tensor]] = [[] for _ in num_chunks_per_request]
    blocks = []
    for g in range(reg.num_groups):
        needs = [reg.blocks_needed(g, n * reg.chunk_tokens) for n in num_chunks_per_request]
        total = sum(needs) + spare
        blocks.append(total)
        perm = torch.randperm(total, generator=gen)
        at = 0
        for i, need in enumerate(needs):
            table = perm[at : at + need].clone()
            at += need
            _holes(reg, g, table, holes)
            per_req[i].append(table)
    return blocks, per_req


def request_tables(reg: Registration, num_chunks: int, gen: torch.Generator | int, spare: int = 2,
                   holes: str = "third") -> tuple[list[int], list[torch.Tensor]]:
    """`block_tables` of one request: (blocks per group, per-group tables)."""
    blocks, (tables,) = block_tables(reg, [num_chunks], gen, spare=spare, holes=holes)
    return blocks, tables


def window_tables(reg: Registration, first: int, num: int, gen: torch.Generator | int, hole_frac: float,
                  spare: int | Callable[[], int] = 2, before: int = -1, tail: int | Callable[[], int] = 0,
                  tail_id: int = -9) -> tuple[list[torch.Tensor], list[int]]:
    """Per group, a table for the window of chunks first..first+num-1: a shuffled subset of the
    destination's blocks with a `hole_frac` share of -1 (and, in a group whose objects hold only each
    chunk's tail, -1 before every tail), after one `before` id per block before the
    window and `tail` `tail_id`s after it (ids no kernel may read). Holes only in groups with a
    sliding window (elsewhere -1 is refused). Returns (tables, blocks per
    group). `spare` and `tail` may be callables, drawn per group (before and after the shuffle)."""
    gen = _generator(gen)
    tables, nblocks = [], []
    first_tok, end_tok = first * reg.chunk_tokens, (first + num) * reg.chunk_tokens
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, end_tok)
        lo = first_tok // reg.group_tokens_per_block(g)
        nb = need - lo + (spare() if callable(spare) else spare)
        ids = torch.randperm(nb, generator=gen)[: need - lo]
        holes = torch.rand(need - lo, generator=gen) < hole_frac
        if any(s.sliding_window for s in reg.specs if s.group == g):  # -1 is legal only there
            ids[holes] = -1
        _heads(reg, g, ids)  # the window starts at chunk `first`: whole chunks
        n_tail = tail() if callable(tail) else tail
        tables.append(torch.cat([torch.full((lo,), before), ids, torch.full((n_tail,), tail_id)]).to(torch.int64))
        nblocks.append(nb)
    return tables, nblocks


def prefix_block_ids(reg: Registration, tables: Sequence[Sequence[int] | torch.Tensor], num_chunks: int
                     ) -> tuple[frozenset[int], ...]:
    """Test oracle of the blocks a restore of chunks 0..num_chunks-1 writes (and a failed one reports
    invalid), written apart from bsr_runtime.retrieve.request_block_ids, the code it checks: per group,
    the non-negative ids among the first ceil(num_chunks * chunk_tokens / tokens per block) entries of
    its table, tokens per block read off the group's tensor specs (block_size * token_ratio)."""
    out = []
    for g, table in enumerate(tables):
        spec = next(s for s in reg.specs if s.group == g)
        tokens_per_block = spec.block_size * spec.token_ratio
        n_blocks = -(-(num_chunks * reg.chunk_tokens) // tokens_per_block)
        ids = [int(b) for b in (table.tolist() if isinstance(table, torch.Tensor) else table)][:n_blocks]
        out.append(frozenset(b for b in ids if b >= 0))
    return tuple(out)


__all__ = ["HOLES", "POISON", "block_tables", "poison", "poisoned", "prefix_block_ids", "request_tables",
           "window_tables", "without_heads"]
