"""Aliasing check for destination tensors: no byte may belong to two entries.

Two destinations of one KV-cache group that share bytes (kv[1] is kv[0], overlapping views of one
buffer) or one destination that covers a byte twice (an expanded, stride-0 view) would commit a
state other than the staged one. Interleaved but disjoint views (vLLM CPU K and V of one layer)
are fine.

Across groups one exception: vLLM's hybrid allocator gives one layer of each group one shared
tensor and draws every group's block ids from one pool. Destinations of different groups may
therefore address the same bytes block for block: the same base address, block count and
per-block geometry (block stride, slots, slot stride, row, entry dims), i.e. block b of one is
block b of the other, byte for byte (blocks of one view are disjoint: it may not overlap itself).
Or packed block by block in one allocation (vLLM's layout for DeepSeek-V4: every layer of every
group at its own offset inside each block, groups of other entry widths and block sizes sharing
a block's bytes): the same block count and block stride S, each destination's block b inside
[O + b*S, O + (b+1)*S), so block b of one meets only block b of another; block 0 is checked.
Such pairs come back in `Verdict.aliases`; whether they are safe depends on the block tables
(no block id resident in both groups), which `validate.check_destinations` checks per request.
Any other sharing across groups (a partial or shifted overlap) is refused like one inside a group.

The check is exact and cheap: destinations whose address ranges are disjoint need nothing more;
a destination whose dims, sorted by stride, each step over everything inside them cannot cover a
byte twice. Only what remains is counted on a mask of their common range at the granularity of
the gcd of row bytes, strides and offsets (as_strided views over an int32 owner mask). Verdicts
are cached by the destinations' addresses, shapes, strides and dtypes, names and groups:
engines register once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import torch

from .descriptors import dest_key, geometry


class Verdict(NamedTuple):
    """`error`: a one-line description of the first forbidden overlap, or None. `aliases`: for each
    pair of groups (ga < gb) whose destinations share memory block for block, one such tensor pair
    (i of group ga, j of group gb): their block tables must name disjoint resident block ids."""

    error: str | None
    aliases: tuple[tuple[int, int], ...] = ()


_VERDICTS: OrderedDict[tuple, Verdict] = OrderedDict()
_VERDICTS_MAX = 64


def _extent(t: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """(count, byte stride) of every dim with count > 1 except the row, and the row bytes."""
    g = geometry(t)
    dims = [(t.shape[0], g.block_stride), (t.shape[1], g.slot_stride), *g.dims]
    return [(n, s) for n, s in dims if n > 1], g.row_bytes


def _span(dims: list[tuple[int, int]], row: int) -> int:
    return sum((n - 1) * s for n, s in dims) + row


def _provably_disjoint_rows(dims: list[tuple[int, int]], row: int) -> bool:
    """Sufficient: sorted by stride, each dim's stride clears everything inside it."""
    inside = row
    for n, s in sorted(dims, key=lambda d: d[1]):
        if s < inside:
            return False
        inside += (n - 1) * s
    return True


def _units_view(mask: torch.Tensor, base: int, dims: list[tuple[int, int]], row: int, g: int) -> torch.Tensor:
    shape = [n for n, _ in dims] + [row // g]
    strides = [s // g for _, s in dims] + [1]
    return mask.as_strided(shape, strides, base // g)


def _self_overlap(dims: list[tuple[int, int]], row: int) -> bool:
    """Exact: does one view cover a byte twice? Counts units when the cheap proof fails."""
    if any(s == 0 for _, s in dims):
        return True
    if _provably_disjoint_rows(dims, row):
        return False
    g = math.gcd(row, *(s for _, s in dims))
    index = torch.arange(_span(dims, row) // g, dtype=torch.int64)
    units = _units_view(index, 0, dims, row, g).reshape(-1)
    return torch.unique(units).numel() != units.numel()


def find_overlap(names: list[str], groups: list[int], kv: tuple[torch.Tensor, ...]) -> Verdict:
    """The verdict on the destinations' geometry (cached: it depends on the tensors alone)."""
    key = (dest_key(kv), tuple(names), tuple(groups))
    if key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    verdict = _find(names, groups, kv)
    _VERDICTS[key] = verdict
    if len(_VERDICTS) > _VERDICTS_MAX:
        _VERDICTS.popitem(last=False)
    return verdict


def _footprint(t: torch.Tensor) -> tuple:
    """Equal footprints <=> block b of one covers exactly the bytes of block b of the other."""
    g = geometry(t)
    return str(t.device), t.data_ptr(), t.shape[0], g.block_stride, t.shape[1], g.slot_stride, g.row_bytes, g.dims


def _find(names: list[str], groups: list[int], kv: tuple[torch.Tensor, ...]) -> Verdict:
    classes: dict[tuple, list[int]] = {}  # footprint -> destinations with it; the first one stands for all
    for i, t in enumerate(kv):
        if t.numel() == 0:
            continue
        dims, row = _extent(t)
        if _self_overlap(dims, row):
            return Verdict(f"destination {names[i]!r} overlaps itself (a stride-0 or overlapping view): "
                           f"its entries would share bytes")
        classes.setdefault(_footprint(t), []).append(i)
    aliases: dict[tuple[int, int], tuple[int, int]] = {}
    spans = []  # (device, lo, hi, index, dims, row) of one destination per footprint
    for members in classes.values():
        for a, i in enumerate(members):
            for j in members[a + 1:]:
                if groups[i] == groups[j]:
                    return Verdict(f"destinations {names[i]!r} and {names[j]!r} overlap in memory (the same view, "
                                   f"both in group {groups[i]}): each destination byte must belong to one tensor")
                pair = (i, j) if groups[i] < groups[j] else (j, i)
                aliases.setdefault((groups[pair[0]], groups[pair[1]]), pair)
        t = kv[members[0]]
        dims, row = _extent(t)
        lo = t.data_ptr()
        spans.append((str(t.device), lo, lo + _span(dims, row), members[0], dims, row))
    spans.sort(key=lambda s: (s[0], s[1]))
    cluster: list[tuple] = []
    for s in [*spans, None]:  # clusters of destinations whose address ranges intersect
        if s is not None and cluster and s[0] == cluster[0][0] and s[1] < max(c[2] for c in cluster):
            cluster.append(s)
            continue
        if len(cluster) > 1:
            packed = _packed_blocks([kv[c[3]] for c in cluster])
            if packed is not None:
                found = _packed_overlap(names, groups, cluster, kv, packed, aliases)
            else:
                found = _cluster_overlap(names, groups, cluster)
            if found:
                return Verdict(found)
        cluster = [s] if s is not None else []
    return Verdict(None, tuple(aliases[k] for k in sorted(aliases)))


def _block_extent(t: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """(count, byte stride) of every dim of one block with count > 1, and the row bytes."""
    g = geometry(t)
    dims = [(t.shape[1], g.slot_stride), *g.dims]
    return [(n, s) for n, s in dims if n > 1], g.row_bytes


def _packed_blocks(members: list[torch.Tensor]) -> int | None:
    """The block stride S when the destinations are laid out block by block in one allocation: the
    same block count and stride, and every destination's block b inside [O + b*S, O + (b+1)*S) for
    one origin O (vLLM's packed hybrid layout: each layer at its own offset inside a block). Then
    block b of one destination meets block b' of another only if b == b', and block 0 shows how
    every block is shared. None otherwise."""
    strides = {geometry(t).block_stride for t in members}
    counts = {t.shape[0] for t in members}
    if len(strides) != 1 or len(counts) != 1:
        return None
    stride = strides.pop()
    lo = min(t.data_ptr() for t in members)
    hi = max(t.data_ptr() + _span(*_block_extent(t)) for t in members)
    return stride if stride > 0 and hi - lo <= stride else None


def _packed_overlap(names: list[str], groups: list[int], cluster: list[tuple], kv: tuple[torch.Tensor, ...],
                    stride: int, aliases: dict[tuple[int, int], tuple[int, int]]) -> str | None:
    """Block 0 of destinations packed block by block (`_packed_blocks`): destinations of one group must
    not share a byte; destinations of different groups that do are aliases (their groups' block tables
    must name disjoint resident ids, as for identical views)."""
    members = [c[3] for c in cluster]
    lo = min(kv[i].data_ptr() for i in members)
    extents = {i: _block_extent(kv[i]) for i in members}
    g = math.gcd(stride, *(row for _, row in extents.values()), *(s for d, _ in extents.values() for _, s in d),
                 *(kv[i].data_ptr() - lo for i in members))
    owner = torch.full((stride // g,), -1, dtype=torch.int32)
    for i in members:
        dims, row = extents[i]
        view = _units_view(owner, kv[i].data_ptr() - lo, dims, row, g)
        taken = view[view >= 0]
        for j in torch.unique(taken).tolist() if taken.numel() else ():
            if groups[i] == groups[j]:
                return f"destinations {names[j]!r} and {names[i]!r} overlap in memory: " \
                       f"each destination byte must belong to one tensor"
            pair = (i, j) if groups[i] < groups[j] else (j, i)
            aliases.setdefault((groups[pair[0]], groups[pair[1]]), pair)
        view.fill_(i)
    return None


def _cluster_overlap(names: list[str], groups: list[int], cluster: list[tuple]) -> str | None:
    lo, hi = cluster[0][1], max(c[2] for c in cluster)
    g = math.gcd(*(c[5] for c in cluster), *(s for c in cluster for _, s in c[4]), *(c[1] - lo for c in cluster))
    owner = torch.full(((hi - lo) // g,), -1, dtype=torch.int32)
    for _, start, _, i, dims, row in cluster:
        view = _units_view(owner, start - lo, dims, row, g)
        taken = view[view >= 0]
        if taken.numel():
            j = int(taken[0])
            if groups[i] == groups[j]:
                return f"destinations {names[j]!r} and {names[i]!r} overlap in memory: " \
                       f"each destination byte must belong to one tensor"
            return f"destinations {names[j]!r} (group {groups[j]}) and {names[i]!r} (group {groups[i]}) overlap " \
                   f"in memory other than block for block: tensors of different groups may share memory only " \
                   f"as the same view (block b of one is block b of the other)"
        view.fill_(i)
    return None
