"""The plan of a load: what the scheduler ships to a worker (LoadSpec), and the confirmed prefix of N chunks
cut into windows of at most W chunks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class LoadSpec:
    """One recorded load: N chunks of the request's prefix into its per-group block ids (what the
    scheduler side ships to the workers)."""

    request_id: str
    tokens: list[int]
    num_chunks: int
    plan_tier: int | None
    block_ids: list[list[int]]
    salt: str | None = None  # the request's tenant salt (None: the connector's)
    probe_s: float = 0.0  # the scheduler's probe for this request (keys and tier lookups)
    local_tokens: int = 0  # the engine's local hit: its whole chunks are not loaded, its blocks not written
    num_tokens: int = 0  # where the loaded prefix ends (0: num_chunks whole chunks); blocks past it not written
    partial_tokens: int = 0  # chunk num_chunks-1 is the prompt's partial chunk (PrefixKeys') of this many tokens
    features: tuple[tuple[int, int, str], ...] = ()  # KeySpace.features of the request


@dataclass(frozen=True)
class Window:
    """One window G_j: `num_chunks` chunks of the plan from `first_chunk`, fetched and installed together."""

    index: int
    first_chunk: int
    num_chunks: int


def window_sizes(window_chunks: int, depth: int) -> list[int]:
    """The most chunks a window holds, in turn: [W] at depth 1; at depth 2 (two windows in flight)
    [ceil(W/2), floor(W/2)], so two live windows never hold more than W, the staging of one restore."""
    if depth not in (1, 2):
        raise ValueError(f"pipeline_depth must be 1 or 2, got {depth}")
    if depth == 1 or window_chunks < 2:
        return [window_chunks]
    return [-(-window_chunks // 2), window_chunks // 2]


def plan_windows(num_chunks: int, window_chunks: int, depth: int = 1, first_chunk: int = 0) -> Iterator[Window]:
    """Windows G_1..G_K over chunks first_chunk..N-1, generated lazily (no per-plan list).

    `first_chunk` > 0: the chunks before it are the engine's own (a local prefix-cache hit), not
    restored. W = 0 is the whole-plan path: one window of every chunk restored. At depth 2 the windows
    alternate between window_sizes' two, so two live windows never exceed W chunks.
    """
    if num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
    if window_chunks < 0:
        raise ValueError(f"window_chunks (W) must be >= 0, got {window_chunks}")
    if not 0 <= first_chunk <= num_chunks:
        raise ValueError(f"first_chunk must be in 0..{num_chunks}, got {first_chunk}")
    if num_chunks == first_chunk:
        return
    if window_chunks == 0:
        yield Window(0, first_chunk, num_chunks - first_chunk)
        return
    sizes = window_sizes(window_chunks, depth)
    first, index = first_chunk, 0
    while first < num_chunks:
        n = min(sizes[index % len(sizes)], num_chunks - first)
        yield Window(index, first, n)
        first += n
        index += 1


def count_windows(num_chunks: int, window_chunks: int, depth: int = 1) -> int:
    if num_chunks == 0:
        return 0
    if window_chunks == 0:
        return 1
    sizes = window_sizes(window_chunks, depth)
    pair = sum(sizes)
    full, rest = divmod(num_chunks, pair)
    extra = 0 if rest == 0 else (1 if rest <= sizes[0] else 2)
    return full * len(sizes) + extra
