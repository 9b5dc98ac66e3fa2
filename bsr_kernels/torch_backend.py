"""Pure-torch install/gather: the reference every other backend is compared with.

Entry e of a tensor lands in block `table[e // block_size]`, slot `e % block_size`; block -1 is
skipped. Entries move in pieces of p = gcd(entries_per_chunk, block_size) consecutive entries:
a piece never straddles a chunk or a block, so it is one contiguous row of the staging and one
(block, slot range) of the destination, and one `index_copy_` (contiguous destinations) or
`index_put_` (any other strided view) per tensor moves all of its pieces. The piece map depends
only on the group and the geometry, so tensors that share both share it. Works on CPU and GPU tensors alike.
"""

from __future__ import annotations

import math

import torch

from .registration import Registration
from .validate import WindowArgs

# Rows are copied as the widest integer unit their size and alignment allow: indexed copies cost
# per element, so int64 rows move several times faster than byte rows. Bytes are copied, never converted.
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _piece_map(reg: Registration, i: int, table: torch.Tensor, first_chunk: int, num_chunks: int):
    """Tensor i's window in pieces: (p, destination row of each resident piece, keep mask or None).

    Destination rows index the tensor viewed as (num_blocks * block_size / p) rows of p entries;
    `keep` (num_chunks, pieces per chunk) marks resident pieces, None when all are."""
    per_chunk, bs = reg.entries_per_chunk(i), reg.specs[i].block_size
    p = math.gcd(per_chunk, bs)
    e = torch.arange(first_chunk * per_chunk, (first_chunk + num_chunks) * per_chunk, p, device=table.device)
    blocks = table[e // bs]
    rows = blocks * (bs // p) + e % bs // p
    keep = blocks >= 0
    if bool(keep.all()):  # one host sync per piece map on GPUs
        return p, rows, None
    return p, rows[keep], keep.view(num_chunks, per_chunk // p)


def _piece_maps(reg: Registration, a: WindowArgs, device: torch.device) -> list[tuple]:
    maps: dict[tuple, tuple] = {}
    keys = [(s.group, reg.entries_per_chunk(i), s.block_size) for i, s in enumerate(reg.specs)]
    for i, key in enumerate(keys):
        if key not in maps:
            maps[key] = _piece_map(reg, i, a.block_tables[key[0]].to(device), a.first_chunk, a.num_chunks)
    return [maps[k] for k in keys]


class DestinationRows:
    """Per tensor: piece size p, copy unit and the destination viewed in pieces of p entries.

    A destination whose pieces are contiguous rows in a flat view (contiguous tensors) is kept as
    rows for one `index_copy_`; any other strided view as (num_blocks, block_size // p, p,
    *entry dims) for an `index_put_` by (block, piece). Depends only on the destination tensors
    (staging is 16-byte aligned, validate.py), so it is made once per set of destinations and
    reused by every window of a restore."""

    def __init__(self, reg: Registration, kv: tuple[torch.Tensor, ...]) -> None:
        self.rows = []
        for i, (spec, t) in enumerate(zip(reg.specs, kv)):
            p = math.gcd(reg.entries_per_chunk(i), spec.block_size)
            row = p * spec.entry_bytes
            size = t.element_size()
            unit = _UNITS[math.gcd(8, t.data_ptr(), t.storage_offset() * size, t.shape[-1] * size,
                                  *(s * size for s in t.stride()[:-1]))]
            # bytes, then units: the innermost dim is contiguous (validate.py), the rest keeps its strides
            pieces = t.view(torch.uint8).view(unit).unflatten(1, (spec.block_size // p, p))
            try:
                flat = pieces.view(-1, row // unit.itemsize)  # (num_blocks * block_size // p, row)
            except RuntimeError:
                flat = None
            self.rows.append((flat, pieces, unit, row, reg.segment_offsets[i], reg.segment_bytes(i)))


def _views(chunks: torch.Tensor, dest: DestinationRows, i: int):
    """(flat destination rows or None, destination pieces, staged pieces (num_chunks, pieces per
    chunk, row)) in one unit dtype.

    `chunks` is the staged window viewed as (num_chunks, chunk_bytes); segment offsets and chunk
    bytes are 16-byte aligned, so the row size and the destination address decide the unit."""
    flat, pieces, unit, row, off, nbytes = dest.rows[i]
    staged = chunks.narrow(1, off, nbytes).view(chunks.shape[0], -1, row)
    return flat, pieces, staged.view(unit)


def _staged_chunks(staging: torch.Tensor, reg: Registration, num_chunks: int) -> torch.Tensor:
    """The window as (num_chunks, chunk_bytes), a view (no copy): 1-D staging cut into rows, or the
    first rows of chunk-strided 2-D staging (its gaps stay outside the view)."""
    if staging.dim() == 2:
        return staging[:num_chunks]
    return staging[: num_chunks * reg.chunk_bytes].view(num_chunks, reg.chunk_bytes)


def _split(rows: torch.Tensor, pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat piece rows -> (block, piece in block) indices of the (num_blocks, block_size // p, ...) view."""
    per_block = pieces.shape[1]
    return rows // per_block, rows % per_block


def install_torch(reg: Registration, a: WindowArgs, dest: DestinationRows | None = None) -> None:
    device = a.kv[0].device
    # one bulk copy if needed (chunk-strided host staging: the rows, made contiguous)
    chunks = _staged_chunks(a.staging, reg, a.num_chunks).to(device, non_blocking=True)
    dest = dest or DestinationRows(reg, a.kv)
    for i, (_, rows, keep) in enumerate(_piece_maps(reg, a, device)):
        flat, pieces, staged = _views(chunks, dest, i)
        src = staged.flatten(0, 1) if keep is None else staged[keep]
        if flat is not None:
            flat.index_copy_(0, rows, src)
        else:
            pieces.index_put_(_split(rows, pieces), src.view(-1, *pieces.shape[2:]))


def gather_torch(reg: Registration, a: WindowArgs, dest: DestinationRows | None = None) -> None:
    """Inverse of install: destination blocks -> staging. Padding and -1 entries read as zero."""
    device = a.kv[0].device
    out = _staged_chunks(a.staging, reg, a.num_chunks)
    chunks = out if out.device == device else torch.empty(out.shape, dtype=torch.uint8, device=device)
    chunks.zero_()
    dest = dest or DestinationRows(reg, a.kv)
    for i, (_, rows, keep) in enumerate(_piece_maps(reg, a, device)):
        flat, pieces, staged = _views(chunks, dest, i)
        got = flat.index_select(0, rows) if flat is not None else pieces[_split(rows, pieces)]
        got = got.reshape(-1, staged.shape[-1])
        if keep is None:
            staged.copy_(got.view(staged.shape))
        else:
            staged[keep] = got
    if chunks is not out:
        out.copy_(chunks, non_blocking=True)  # one bulk copy back to the host (rows only when strided)
