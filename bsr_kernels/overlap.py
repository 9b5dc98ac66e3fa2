"""Aliasing check for destination tensors: no byte may belong to two entries.

Two destinations that share bytes (kv[1] is kv[0], overlapping views of one buffer) or one
destination that covers a byte twice (an expanded, stride-0 view) would commit a state other
than the staged one. Interleaved but disjoint views (vLLM CPU K and V of one layer) are fine.

The check is exact and cheap: destinations whose address ranges are disjoint need nothing more;
a destination whose dims, sorted by stride, each step over everything inside them cannot cover a
byte twice. Only what remains is counted on a mask of their common range at the granularity of
the gcd of row bytes, strides and offsets (as_strided views over an int32 owner mask). Verdicts
are cached by the destinations' addresses, shapes, strides and dtypes: engines register once.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .descriptors import dest_key, geometry

_VERDICTS: OrderedDict[tuple, str | None] = OrderedDict()
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


def find_overlap(names: list[str], kv: tuple[torch.Tensor, ...]) -> str | None:
    """A one-line description of the first overlap among the destinations, or None."""
    key = dest_key(kv)
    if key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    verdict = _find(names, kv)
    _VERDICTS[key] = verdict
    if len(_VERDICTS) > _VERDICTS_MAX:
        _VERDICTS.popitem(last=False)
    return verdict


def _find(names: list[str], kv: tuple[torch.Tensor, ...]) -> str | None:
    spans = []  # (device, lo, hi, index, dims, row)
    for i, t in enumerate(kv):
        if t.numel() == 0:
            continue
        dims, row = _extent(t)
        if _self_overlap(dims, row):
            return f"destination {names[i]!r} overlaps itself (a stride-0 or overlapping view): " \
                   f"its entries would share bytes"
        lo = t.data_ptr()
        spans.append((str(t.device), lo, lo + _span(dims, row), i, dims, row))
    spans.sort(key=lambda s: (s[0], s[1]))
    cluster: list[tuple] = []
    for s in [*spans, None]:  # clusters of destinations whose address ranges intersect
        if s is not None and cluster and s[0] == cluster[0][0] and s[1] < max(c[2] for c in cluster):
            cluster.append(s)
            continue
        if len(cluster) > 1:
            found = _cluster_overlap(names, cluster)
            if found:
                return found
        cluster = [s] if s is not None else []
    return None


def _cluster_overlap(names: list[str], cluster: list[tuple]) -> str | None:
    lo, hi = cluster[0][1], max(c[2] for c in cluster)
    g = math.gcd(*(c[5] for c in cluster), *(s for c in cluster for _, s in c[4]), *(c[1] - lo for c in cluster))
    owner = torch.full(((hi - lo) // g,), -1, dtype=torch.int32)
    for _, start, _, i, dims, row in cluster:
        view = _units_view(owner, start - lo, dims, row, g)
        taken = view[view >= 0]
        if taken.numel():
            return f"destinations {names[int(taken[0])]!r} and {names[i]!r} overlap in memory: " \
                   f"each destination byte must belong to one tensor"
        view.fill_(i)
    return None
