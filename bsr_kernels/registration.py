"""Registration model: the destination tensors a model registers and the staged chunk layout.

A staged chunk (one object of the external tier, per TP rank) is the concatenation of every
registered tensor's entries for `chunk_tokens` tokens. Each tensor's segment starts at a
16-byte aligned offset so kernels can use wide accesses where entry widths allow.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property

import torch

SEGMENT_ALIGN = 16
DEFAULT_CHUNK_TOKENS = 256
# sanity bounds of a registration (far above any real model; a registration outside them is a
# configuration error, refused before any allocation is attempted)
MAX_DIM = 1 << 31
MAX_ENTRY_BYTES = 1 << 30
MAX_BLOCK_SIZE = 1 << 20
MAX_CHUNK_TOKENS = 1 << 20
MAX_GROUPS = 1 << 10
MAX_TENSORS = 1 << 16
MAX_CHUNK_BYTES = 1 << 40

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.float64: "float64",
    torch.int64: "int64",
}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported dtype name {name!r}; known: {sorted(_DTYPES_BY_NAME)}") from None


def align_up(n: int, a: int = SEGMENT_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    """One destination tensor of shape (num_blocks, block_size, *entry_shape).

    One entry covers `token_ratio` tokens (compressed caches: 4, 128). Tensors of one group
    share a block table, so they must agree on tokens per block (block_size * token_ratio).
    `sliding_window` (tokens) is descriptive: the engine marks blocks outside it as -1.

    `tail_tokens` (None: the whole chunk): a chunk's object holds only this tensor's entries of the
    chunk's last `tail_tokens` tokens, what a prefix ending at that chunk needs of a sliding window
    (the engine keeps no block before them resident). Whole blocks (a multiple of tokens per block),
    one value per group; the kernels see per-chunk segments of the tail only and the group's block
    tables narrowed to the tail blocks of each chunk (validate.check_block_tables).
    """

    name: str
    dtype: torch.dtype
    entry_shape: tuple[int, ...]
    block_size: int
    token_ratio: int = 1
    group: int = 0
    sliding_window: int | None = None
    tail_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec needs a non-empty string name, got {self.name!r}")
        _check_text(self.name, "tensor name")
        if not isinstance(self.entry_shape, (tuple, list)):
            raise ValueError(f"tensor {self.name!r}: entry_shape must be a list of integers, got {self.entry_shape!r}")
        object.__setattr__(self, "entry_shape", tuple(
            _int(f"tensor {self.name!r}: entry_shape dim", d, None, MAX_DIM) for d in self.entry_shape))
        if any(d <= 0 for d in self.entry_shape):
            raise ValueError(f"tensor {self.name!r}: entry_shape {self.entry_shape} has a non-positive dim")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"tensor {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)  # raises on unsupported dtypes
        _int(f"tensor {self.name!r}: block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _int(f"tensor {self.name!r}: token_ratio", self.token_ratio, 1, MAX_CHUNK_TOKENS)
        _int(f"tensor {self.name!r}: group", self.group, 0, MAX_GROUPS - 1)
        if self.sliding_window is not None:
            _int(f"tensor {self.name!r}: sliding_window", self.sliding_window, 1, None)
        if self.tail_tokens is not None:
            _int(f"tensor {self.name!r}: tail_tokens", self.tail_tokens, 1, MAX_CHUNK_TOKENS)
            if self.tail_tokens % self.tokens_per_block:
                raise ValueError(f"tensor {self.name!r}: tail_tokens {self.tail_tokens} is not a whole number of "
                                 f"{self.tokens_per_block}-token blocks")
        if self.entry_bytes > MAX_ENTRY_BYTES:
            raise ValueError(f"tensor {self.name!r}: an entry of {self.entry_bytes:,} B exceeds "
                             f"{MAX_ENTRY_BYTES:,} B (entry_shape {self.entry_shape})")

    @property
    def entry_bytes(self) -> int:
        return math.prod(self.entry_shape) * self.dtype.itemsize

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.token_ratio

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, *self.entry_shape)

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "dtype": dtype_name(self.dtype),
            "entry_shape": list(self.entry_shape),
            "block_size": self.block_size,
            "token_ratio": self.token_ratio,
            "group": self.group,
        }
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        if self.tail_tokens is not None:
            d["tail_tokens"] = self.tail_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        """A spec from a registration file's entry; every field is checked (type and range) and a
        bad one raises ValueError naming the tensor and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"each tensor must be a mapping of fields, got {type(d).__name__}")
        known = {"name", "dtype", "entry_shape", "block_size", "token_ratio", "group", "sliding_window", "tail_tokens"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"tensor spec {d.get('name', '?')!r}: unknown fields {sorted(map(str, unknown))}")
        missing = [f for f in ("name", "dtype", "entry_shape", "block_size") if f not in d]
        if missing:
            raise ValueError(f"tensor spec {d.get('name', '?')!r}: missing fields {missing}")
        name = d["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if not isinstance(d["dtype"], str):
            raise ValueError(f"tensor {name!r}: dtype must be a name such as 'uint8', got {d['dtype']!r}")
        shape = d["entry_shape"]
        if not isinstance(shape, list):
            raise ValueError(f"tensor {name!r}: entry_shape must be a list of integers, got {shape!r}")
        return cls(
            name=name,
            dtype=dtype_from_name(d["dtype"]),
            entry_shape=tuple(shape),
            block_size=d["block_size"],
            token_ratio=d.get("token_ratio", 1),
            group=d.get("group", 0),
            sliding_window=d.get("sliding_window"),
            tail_tokens=d.get("tail_tokens"),
        )


@dataclass(frozen=True)
class Registration:
    """The ordered destination tensors of a model and the chunk layout derived from them."""

    specs: tuple[TensorSpec, ...]
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        if not self.specs:
            raise ValueError("a registration needs at least one tensor")
        if len(self.specs) > MAX_TENSORS:
            raise ValueError(f"{len(self.specs)} tensors exceed the maximum of {MAX_TENSORS}")
        if not all(isinstance(s, TensorSpec) for s in self.specs):
            raise ValueError("a registration's specs must be TensorSpec objects")
        _int("chunk_tokens", self.chunk_tokens, 1, MAX_CHUNK_TOKENS)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate tensor names in registration: {dup}")
        for s in self.specs:
            if self.chunk_tokens % s.token_ratio:
                raise ValueError(
                    f"tensor {s.name!r}: chunk_tokens {self.chunk_tokens} is not a multiple of "
                    f"token_ratio {s.token_ratio}"
                )
        groups = sorted({s.group for s in self.specs})
        if groups != list(range(len(groups))):
            raise ValueError(f"groups must be numbered 0..G-1 without gaps, got {groups}")
        for g in groups:
            tpb = {s.tokens_per_block for s in self.specs if s.group == g}
            if len(tpb) != 1:
                raise ValueError(
                    f"group {g}: tensors disagree on tokens per block (block_size*token_ratio): {sorted(tpb)}"
                )
            tails = {s.tail_tokens for s in self.specs if s.group == g}
            if len(tails) != 1:
                raise ValueError(f"group {g}: tensors disagree on tail_tokens: {sorted(tails, key=str)} (one "
                                 "block table: the objects hold the same blocks of every tensor of a group)")
            tail = tails.pop()
            if tail is not None and (tail > self.chunk_tokens or self.chunk_tokens % next(iter(tpb))):
                raise ValueError(f"group {g}: tail_tokens {tail} needs whole blocks of {next(iter(tpb))} tokens "
                                 f"inside a chunk of {self.chunk_tokens}")
        if self.chunk_bytes > MAX_CHUNK_BYTES:
            raise ValueError(f"a chunk of {self.chunk_bytes:,} B exceeds {MAX_CHUNK_BYTES:,} B")

    # -- layout ----------------------------------------------------------------------------
    @property
    def num_tensors(self) -> int:
        return len(self.specs)

    @cached_property
    def num_groups(self) -> int:  # cached: read on every window launch (167 specs at DeepSeek-V4-Flash)
        return max(s.group for s in self.specs) + 1

    def stored_tokens(self, i: int) -> int:
        """Tokens of each chunk whose entries of tensor i an object holds (the tail, or the chunk)."""
        tail = self.specs[i].tail_tokens
        return self.chunk_tokens if tail is None else tail

    def entries_per_chunk(self, i: int) -> int:
        """Entries of tensor i staged per chunk (its segment): those of `stored_tokens(i)`."""
        return self.stored_tokens(i) // self.specs[i].token_ratio

    def segment_bytes(self, i: int) -> int:
        return self.entries_per_chunk(i) * self.specs[i].entry_bytes

    @cached_property
    def segment_offsets(self) -> tuple[int, ...]:
        offsets, off = [], 0
        for i in range(self.num_tensors):
            offsets.append(off)
            off = align_up(off + self.segment_bytes(i))
        return tuple(offsets)

    @cached_property
    def chunk_bytes(self) -> int:
        """c: bytes of one staged chunk (per TP rank), segments 16-byte aligned."""
        last = self.num_tensors - 1
        return align_up(self.segment_offsets[last] + self.segment_bytes(last))

    @cached_property
    def _group_tokens(self) -> tuple[int, ...]:  # cached: read per group on every one-shot call
        return tuple(next(s.tokens_per_block for s in self.specs if s.group == g) for g in range(self.num_groups))

    def group_tokens_per_block(self, g: int) -> int:
        return self._group_tokens[g]

    @cached_property
    def sliding_window_groups(self) -> frozenset[int]:
        """Groups with a tensor that has a sliding window: the only groups where block id -1 is legal."""
        return frozenset(s.group for s in self.specs if s.sliding_window)

    def blocks_needed(self, g: int, num_tokens: int) -> int:
        """Block-table length group g needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.group_tokens_per_block(g))

    @cached_property
    def _group_tails(self) -> tuple[int | None, ...]:
        return tuple(next(s.tail_tokens for s in self.specs if s.group == g) for g in range(self.num_groups))

    def group_tail_tokens(self, g: int) -> int | None:
        """The tail (tokens) group g's objects hold of each chunk; None when they hold the whole chunk."""
        tail = self._group_tails[g]
        return None if tail is None or tail >= self.chunk_tokens else tail

    @cached_property
    def tail_groups(self) -> frozenset[int]:
        """Groups whose objects hold only each chunk's tail."""
        return frozenset(g for g in range(self.num_groups) if self.group_tail_tokens(g) is not None)

    def without_heads(self, tables: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Whole-request block tables (from chunk 0) as an engine's sliding windows leave them at a prefix
        end: in a tail group, every chunk's blocks before its tail -1 (copies; other groups as given)."""
        out = []
        for g, table in enumerate(tables):
            table = table.clone()
            tail = self.group_tail_tokens(g)
            if tail is not None:
                tpb = self.group_tokens_per_block(g)
                per_chunk, keep = self.chunk_tokens // tpb, tail // tpb
                whole = table.numel() // per_chunk * per_chunk
                table[:whole].view(-1, per_chunk)[:, : per_chunk - keep] = -1
            out.append(table)
        return out

    def chunk_blocks(self, g: int, k: int) -> tuple[int, int]:
        """Block-table entries lo..hi-1 of group g whose entries chunk k's object holds (its tail
        blocks in a tail group, else every block the chunk touches)."""
        tpb, ct = self.group_tokens_per_block(g), self.chunk_tokens
        tail = self.group_tail_tokens(g)
        lo = (k * ct + (0 if tail is None else ct - tail)) // tpb
        return lo, -(-(k + 1) * ct // tpb)

    # -- identity --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"chunk_tokens": self.chunk_tokens, "tensors": [s.to_dict() for s in self.specs]}

    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> Registration:
        """A registration from a file's mapping {'chunk_tokens': int, 'tensors': [...]}; any bad
        field raises ValueError (never TypeError/AttributeError), before anything is allocated."""
        if not isinstance(d, dict):
            raise ValueError(f"a registration must be a mapping with a 'tensors' list, got {type(d).__name__}")
        tensors = d.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            raise ValueError(f"a registration needs a non-empty 'tensors' list, got {tensors!r:.80}")
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"{len(tensors)} tensors exceed the maximum of {MAX_TENSORS}")
        return cls(
            specs=tuple(TensorSpec.from_dict(t) for t in tensors),
            chunk_tokens=d.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
            name=name,
        )

    @cached_property
    def fingerprint(self) -> str:
        """Stable hex digest of the geometry (names, dtypes, shapes, ratios, blocks, groups, chunk)."""
        blob = json.dumps({"layout_version": 1, **self.to_dict()}, sort_keys=True).encode()  # tail_tokens only when set
        return hashlib.sha256(blob).hexdigest()[:32]

    # -- destinations ----------------------------------------------------------------------
    def allocate(
        self, num_blocks: int | list[int] | tuple[int, ...], device: str | torch.device = "cpu"
    ) -> list[torch.Tensor]:
        """Destination tensors in registration order; num_blocks may be given per group."""
        per_group = _per_group(num_blocks, self.num_groups)
        return [
            torch.empty(s.shape(per_group[s.group]), dtype=s.dtype, device=device) for s in self.specs
        ]

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_tensors} tensors, {self.num_groups} groups, "
            f"c = {self.chunk_bytes:,} B per {self.chunk_tokens}-token chunk"
        )


def _int(what: str, value: object, lo: int | None, hi: int | None) -> int:
    """`value` as an int in [lo, hi]; bools, floats (1e20, 16.0) and other types are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r:.80}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"<= {hi:,}" if lo is None else f"in {lo}..{hi:,}"
        raise ValueError(f"{what} must be {bound}, got {v:,}")
    return v


def _check_text(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {value!r} is not valid Unicode text") from None


def _per_group(num_blocks: int | list[int] | tuple[int, ...], num_groups: int) -> list[int]:
    if isinstance(num_blocks, int):
        return [num_blocks] * num_groups
    if len(num_blocks) != num_groups:
        raise ValueError(f"num_blocks has {len(num_blocks)} entries for {num_groups} groups")
    return [int(n) for n in num_blocks]
