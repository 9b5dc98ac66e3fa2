"""Checks that run before any byte moves: every problem is a ValueError naming what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .descriptors import MAX_ROW_DIMS, geometry
from .overlap import find_overlap
from .registration import SEGMENT_ALIGN, Registration


@dataclass(frozen=True)
class RunOptions:
    """How a window runs beside its arguments: the CUDA stream, whether the CUDA kernel reads pinned host
    staging in place (zero copy), and the CPU library's thread count (0: by the window's bytes)."""

    stream: torch.cuda.Stream | None = None
    zero_copy: bool = True
    cpu_threads: int = 0


@dataclass(frozen=True)
class WindowArgs:
    """Validated, normalised arguments of one install/gather call."""

    staging: torch.Tensor
    kv: tuple[torch.Tensor, ...]
    block_tables: tuple[torch.Tensor, ...]  # int64, contiguous, on the block tables' device
    first_chunk: int
    num_chunks: int
    chunk_stride: int  # bytes from one staged chunk to the next (check_staging's result)


def check_window(
    staging: torch.Tensor,
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    fingerprint: str | None = None,
    staging_name: str = "staging",
    gather: bool = False,
) -> WindowArgs:
    check_fingerprint(reg, fingerprint)
    first_chunk, num_chunks = check_chunk_range(first_chunk, num_chunks)
    stride = check_staging(staging, reg, num_chunks, staging_name)
    kv, tables = check_destinations(reg, kv, block_tables, first_chunk, num_chunks, gather=gather)
    return WindowArgs(staging, kv, tables, first_chunk, num_chunks, stride)


def check_chunk_range(first_chunk: int, num_chunks: int) -> tuple[int, int]:
    if isinstance(first_chunk, bool) or int(first_chunk) != first_chunk or first_chunk < 0:
        raise ValueError(f"first_chunk must be a non-negative integer, got {first_chunk!r}")
    if isinstance(num_chunks, bool) or int(num_chunks) != num_chunks or num_chunks < 0:
        raise ValueError(f"num_chunks must be a non-negative integer, got {num_chunks!r}")
    return int(first_chunk), int(num_chunks)


def check_destinations(
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    gather: bool = False,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Destination tensors and block tables for chunks first_chunk.. of a request; returns
    them normalised (block tables as contiguous int64, narrowed as the kernels read them)."""
    kv, layout = check_destination_tensors(reg, kv)
    return kv, check_block_tables(reg, block_tables, first_chunk, num_chunks, layout, gather=gather)


@dataclass(frozen=True)
class DestinationLayout:
    """What `check_destination_tensors` proved that the block tables are then checked against."""

    group_blocks: dict[int, tuple[int, str]]  # group -> (block count of its tensors, one tensor's name)
    aliases: tuple[tuple[int, int], ...]  # overlap.Verdict.aliases: groups whose tensors share memory


def check_destination_tensors(reg: Registration, kv: Sequence[torch.Tensor]
                              ) -> tuple[tuple[torch.Tensor, ...], DestinationLayout]:
    """The destination tensors alone: count, dtype, shape, device, strides, no shared bytes. The
    result depends only on their layout (addresses, shapes, strides, dtypes, devices)."""
    kv = tuple(kv)
    if len(kv) != reg.num_tensors:
        raise ValueError(f"expected {reg.num_tensors} destination tensors for {reg.name}, got {len(kv)}")
    group_blocks: dict[int, tuple[int, str]] = {}
    device = kv[0].device if kv and isinstance(kv[0], torch.Tensor) else None
    for spec, t in zip(reg.specs, kv):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {spec.name!r}: destination is not a tensor ({type(t).__name__})")
        if t.dtype != spec.dtype:
            raise ValueError(f"tensor {spec.name!r}: dtype {t.dtype}, registration says {spec.dtype}")
        if tuple(t.shape[1:]) != (spec.block_size, *spec.entry_shape) or t.dim() != 2 + len(spec.entry_shape):
            raise ValueError(
                f"tensor {spec.name!r}: shape {tuple(t.shape)}, registration says "
                f"(num_blocks, {spec.block_size}, {', '.join(map(str, spec.entry_shape))})"
            )
        if t.device != device:
            raise ValueError(f"tensor {spec.name!r}: on {t.device}, other destinations on {device}")
        _check_strides(spec.name, t)
        nb = t.shape[0]
        prev = group_blocks.setdefault(spec.group, (nb, spec.name))
        if prev[0] != nb:
            raise ValueError(
                f"tensor {spec.name!r}: {nb} blocks, but {prev[1]!r} of the same group {spec.group} has {prev[0]}"
            )
    verdict = find_overlap([s.name for s in reg.specs], [s.group for s in reg.specs], kv)
    if verdict.error:
        raise ValueError(verdict.error)
    return kv, DestinationLayout(group_blocks, verdict.aliases)


def check_block_tables(
    reg: Registration,
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    layout: DestinationLayout,
    local_tokens: int = 0,
    end_tokens: int | None = None,
    *,
    gather: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The block tables for chunks first_chunk.. against destinations `layout` describes; returns
    them as contiguous int64 on their device, as the kernels read them. Only the entries of those
    chunks are read: ids in range, -1 only in groups with a sliding window, in the blocks of the
    first `local_tokens` tokens (the engine's own: not written) or in those from `end_tokens` on
    (past a prefix that ends inside its last chunk: not written), no id twice in a group, and no id
    resident in two groups whose destinations are the same memory.

    A group whose objects hold only each chunk's tail (Registration.tail_groups) is returned narrowed
    to the tail blocks of every chunk from chunk 0 (the kernels' entry e of a chunk is entry e of its
    tail). For an install (`gather` False) none of its blocks before a chunk's tail may be resident:
    the objects do not hold them, so the engine would read blocks nothing wrote."""
    block_tables = tuple(block_tables)
    if len(block_tables) != reg.num_groups:
        raise ValueError(f"expected {reg.num_groups} block tables (one per group), got {len(block_tables)}")
    out = []
    resident_ids: dict[int, list[int]] = {}
    first_tok = first_chunk * reg.chunk_tokens
    end_tok = (first_chunk + num_chunks) * reg.chunk_tokens
    last = first_chunk + num_chunks - 1
    for g, table in enumerate(block_tables):
        if not isinstance(table, torch.Tensor) or table.dim() != 1:
            raise ValueError(f"block table of group {g} must be a 1-D tensor")
        if table.dtype is not torch.int64:
            if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
                raise ValueError(f"block table of group {g} must hold integers, got {table.dtype}")
            table = table.to(torch.int64)
        if not table.is_contiguous():
            table = table.contiguous()
        need = reg.blocks_needed(g, end_tok)
        if table.numel() < need:
            raise ValueError(
                f"block table of group {g} too short: {table.numel()} blocks, chunks {first_chunk}..{last} need {need}"
            )
        lo = first_tok // reg.group_tokens_per_block(g)
        if need > lo:
            tpb = reg.group_tokens_per_block(g)
            written = (max(0, min(need, local_tokens // tpb) - lo),
                       need - lo if end_tokens is None else max(0, min(need, -(-end_tokens // tpb)) - lo))
            window = _window_ids(table, lo, need)
            resident_ids[g] = _check_window_ids(reg, g, window, layout, first_chunk, last, written)
            if g in reg.tail_groups and not gather:
                _check_heads_empty(reg, g, window, first_chunk, last)
        if g in reg.tail_groups:
            table = _tail_table(reg, g, table, first_chunk + num_chunks)
        out.append(table)
    _check_aliased_groups(reg, layout.aliases, resident_ids, first_chunk, last)
    return tuple(out)


def _tail_geometry(reg: Registration, g: int) -> tuple[int, int]:
    """(blocks per chunk, tail blocks per chunk) of a tail group."""
    tpb = reg.group_tokens_per_block(g)
    return reg.chunk_tokens // tpb, reg.group_tail_tokens(g) // tpb


def _check_heads_empty(reg: Registration, g: int, window: list[int], first_chunk: int, last: int) -> None:
    """In a tail group, the blocks of each chunk before its tail are not resident (-1)."""
    per_chunk, tail = _tail_geometry(reg, g)
    for k in range(last - first_chunk + 1):
        head = window[k * per_chunk: (k + 1) * per_chunk - tail]
        bad = next((b for b in head if b >= 0), None)
        if bad is not None:
            raise ValueError(
                f"block table of group {g}: block id {bad} is resident in chunk {first_chunk + k} before the "
                f"last {reg.group_tail_tokens(g)} tokens, which are all its objects hold (a sliding window "
                f"that reaches further back than the registration says)")


def _tail_table(reg: Registration, g: int, table: torch.Tensor, end_chunk: int) -> torch.Tensor:
    """Group g's table for chunks 0..end_chunk-1 narrowed to each chunk's tail blocks (contiguous)."""
    per_chunk, tail = _tail_geometry(reg, g)
    return table[: end_chunk * per_chunk].view(end_chunk, per_chunk)[:, per_chunk - tail:].reshape(-1).contiguous()


def _window_ids(table: torch.Tensor, lo: int, hi: int) -> list[int]:
    """Entries lo..hi-1 of a contiguous int64 table (a window's entries: Python ints beat numpy or
    torch reductions at these sizes)."""
    if table.is_cpu:
        return table.numpy()[lo:hi].tolist()
    return table[lo:hi].tolist()


def _check_window_ids(reg: Registration, g: int, window: list[int], layout: DestinationLayout,
                      first_chunk: int, last: int, written: tuple[int, int] | None = None) -> list[int]:
    """The resident (>= 0) block ids of group g's window, after checking range, -1 (outside the
    entries `written` = (start, stop): the engine's local hit before, the blocks past a prefix ending
    inside its last chunk after) and duplicates."""
    nb, tname = layout.group_blocks[g]
    low, high = min(window), max(window)
    if low < -1 or high >= nb:
        bad = next(b for b in window if b < -1 or b >= nb)
        raise ValueError(f"block table of group {g}: block id {bad} out of range [-1, {nb}) for tensor {tname!r}")
    start, stop = written or (0, len(window))
    if low == -1 and g not in reg.sliding_window_groups and -1 in window[start:stop]:
        raise ValueError(
            f"block table of group {g}: block id -1 in chunks {first_chunk}..{last}, but no tensor of the group "
            f"has a sliding window (nothing would be installed there, yet the restore would commit)")
    resident = [b for b in window if b >= 0] if low == -1 else window
    if len(set(resident)) != len(resident):
        raise ValueError(f"block table of group {g}: duplicated block ids in chunks {first_chunk}..{last}")
    return resident


def _check_aliased_groups(reg: Registration, aliases: tuple[tuple[int, int], ...], resident: dict[int, list[int]],
                          first_chunk: int, last: int) -> None:
    """Groups whose destinations share memory block for block (vLLM's hybrid allocator: one tensor
    per layer position, one block pool) are safe only if no block id is resident in both: one set
    intersection per aliased pair of groups, over the chunks being installed or gathered."""
    for i, j in aliases:
        a, b = reg.specs[i], reg.specs[j]
        ids_a, ids_b = resident.get(a.group), resident.get(b.group)
        if not ids_a or not ids_b:
            continue
        in_b = set(ids_b)
        shared = next((x for x in ids_a if x in in_b), None)
        if shared is not None:
            raise ValueError(
                f"tensors {a.name!r} (group {a.group}) and {b.name!r} (group {b.group}) are the same memory, and "
                f"both groups' block tables name block id {shared} in chunks {first_chunk}.."
                f"{last}: the groups would write each other's entries")


def _check_strides(name: str, t: torch.Tensor) -> None:
    """Any strided view whose innermost dim is one contiguous row (aliasing is checked later)."""
    if t.stride(-1) != 1:
        raise ValueError(f"tensor {name!r}: innermost stride is {t.stride(-1)}, destinations need a contiguous "
                         f"innermost dim (stride 1); strides {t.stride()}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"tensor {name!r}: negative strides {t.stride()} are not supported")
    dims = geometry(t).dims
    if len(dims) > MAX_ROW_DIMS:
        raise ValueError(f"tensor {name!r}: an entry spans {len(dims)} non-contiguous dims (strides {t.stride()}), "
                         f"at most {MAX_ROW_DIMS} are supported")


def check_fingerprint(reg: Registration, fingerprint: str | None) -> None:
    if fingerprint is not None and fingerprint != reg.fingerprint:
        raise ValueError(
            f"registration fingerprint mismatch: staged objects have {fingerprint}, "
            f"destination registration {reg.name} has {reg.fingerprint}"
        )


def check_staging(staging: torch.Tensor, reg: Registration, num_chunks: int, name: str = "staging") -> int:
    """The staged window, chunk-major; returns its chunk stride (bytes from chunk c to chunk c + 1).

    Either 1-D contiguous uint8 (chunk c at byte c * chunk_bytes, the stride is chunk_bytes), or
    2-D uint8 of shape (>= num_chunks, chunk_bytes), one row per chunk, rows `stride(0)` bytes
    apart: a multiple of SEGMENT_ALIGN, at least chunk_bytes (a staging pool's per-chunk scratch
    lies in the gaps, which install never reads into destinations and gather never writes). The
    first chunk's address must be SEGMENT_ALIGN-byte aligned either way."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(staging).__name__}")
    cb = reg.chunk_bytes
    if staging.dtype == torch.uint8 and staging.dim() == 1:
        if not staging.is_contiguous():
            raise ValueError(f"{name} is not contiguous")
        need = num_chunks * cb
        if staging.numel() < need:
            raise ValueError(
                f"{name} too small: {staging.numel():,} B for {num_chunks} chunks of {cb:,} B "
                f"({need:,} B needed)"
            )
        stride = cb
    elif staging.dtype == torch.uint8 and staging.dim() == 2:
        rows, width = staging.shape
        stride = staging.stride(0)
        if width != cb:
            raise ValueError(f"{name}: 2-D staging must have one row of chunk_bytes = {cb:,} B per chunk, "
                             f"got shape {tuple(staging.shape)}")
        if staging.stride(1) != 1:
            raise ValueError(f"{name}: 2-D staging rows must be contiguous (stride(1) == 1), "
                             f"got strides {staging.stride()}")
        if stride < cb:
            raise ValueError(f"{name}: chunk stride {stride:,} B (stride(0)) is less than chunk_bytes {cb:,} B: "
                             f"chunks would overlap")
        if stride % SEGMENT_ALIGN:
            raise ValueError(f"{name}: chunk stride {stride:,} B (stride(0)) is not a multiple of {SEGMENT_ALIGN}")
        if rows < num_chunks:
            raise ValueError(f"{name} too small: {rows} rows (chunks) of {cb:,} B, {num_chunks} chunks needed")
    else:
        raise ValueError(f"{name} must be a 1-D uint8 tensor, or 2-D uint8 (chunks, chunk_bytes) with a chunk "
                         f"stride; got {staging.dtype} with shape {tuple(staging.shape)}")
    if staging.numel() and staging.data_ptr() % SEGMENT_ALIGN:
        raise ValueError(f"{name} misaligned: address {staging.data_ptr():#x} is not {SEGMENT_ALIGN}-byte aligned")
    return stride
