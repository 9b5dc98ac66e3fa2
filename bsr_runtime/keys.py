"""Object keys: one object per (chunk, TP rank).

A key binds the registration fingerprint, the TP rank and world size, the chunk's position in
a prefix hash chain (the token ids of every chunk up to and including it, and the multimodal
inputs placed in each) and a tenant salt (which also carries the request's adapter identity and
the engine's cache epoch).
Keys are opaque strings of hex digits and a fixed prefix: safe as store keys; tiers that map
keys to file names hash them again and never use a key as a path.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .validation import check_int, check_text, token_id_bytes

KEY_VERSION = "bsr1"


# hashlib gives the GIL up for an update of HASHLIB_GIL_MINSIZE (2048) bytes or more, and a chunk's ids are
# 2048 bytes at 256 tokens: beside an engine's step thread every take-back could wait a switch interval, once
# per chunk of every probe and restore. Fed in smaller pieces (the same digest), the hash keeps the GIL.
_GIL_KEPT_BYTES = 2047


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        if len(p) <= _GIL_KEPT_BYTES:
            h.update(p)
            continue
        view = memoryview(p)
        for i in range(0, len(p), _GIL_KEPT_BYTES):
            h.update(view[i : i + _GIL_KEPT_BYTES])
    return h.digest()


@dataclass(frozen=True)
class KeySpace:
    """Everything a key binds except the chunk: registration, TP geometry, tenant, model.

    `model` is the model identity (name and revision, or a digest of the weights): two models
    of the same geometry (same registration fingerprint) never share objects. Empty: unbound.
    `features`: the request's non-token inputs placed in its prompt, (offset, length, identifier)
    sorted by offset (vLLM's multimodal items: placeholder tokens are the same for every image, the
    identifier is the item's content hash); each chunk they overlap hashes them, with their offset
    relative to the chunk, into the chain, as vLLM's prefix cache does per block."""

    fingerprint: str
    tp_rank: int = 0
    tp_world: int = 1
    salt: str = ""
    model: str = ""
    features: tuple[tuple[int, int, str], ...] = ()

    def __post_init__(self) -> None:
        _check_space(self)
        if not 0 <= self.tp_rank < self.tp_world:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for world size {self.tp_world}")

    @functools.cached_property  # hashed once per key space, not per window (fields are frozen)
    def _prefix(self) -> str:
        tenant = _h(b"tenant", self.salt.encode()).hex()[:16]
        model = f"-m{_h(b'model', self.model.encode()).hex()[:16]}" if self.model else ""
        return f"{KEY_VERSION}-{tenant}-{self.fingerprint[:16]}{model}-r{self.tp_rank}of{self.tp_world}"

    def key(self, chain_hash: bytes) -> str:
        return f"{self._prefix}-{chain_hash.hex()}"


@dataclass(frozen=True)
class KeyInputs:
    """What a request's keys bind beyond its token ids: its salt (tenant, `cache_salt`, adapter,
    cache epoch) and its placed features (KeySpace.features). `refused`: why BSR cannot key the
    request (it is then neither probed nor saved)."""

    salt: str
    features: tuple[tuple[int, int, str], ...] = ()
    refused: str | None = None


def request_salt(base: str, request) -> str:
    """The tenant salt of a request: the connector's salt, plus the request's own `cache_salt`
    (vLLM's per-request prefix-cache isolation) when it has one."""
    cache_salt = getattr(request, "cache_salt", None)
    return f"{base}\0{cache_salt}" if cache_salt else base


def salt_only(base_salt: str, request) -> KeyInputs:
    """The default key inputs: the connector's salt and the request's `cache_salt`."""
    return KeyInputs(request_salt(base_salt, request))


def _check_space(space: KeySpace) -> None:
    """Types of the TP geometry and the salt (a lone surrogate cannot be hashed into a key)."""
    check_int("tp_world", space.tp_world, lo=1)
    check_int("tp_rank", space.tp_rank, lo=0)
    check_text("salt", space.salt)
    if not isinstance(space.fingerprint, str) or not space.fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string, got {space.fingerprint!r}")


class PrefixKeys:
    """Keys of one request's prefix, produced window by window.

    Holds the token ids packed once (8 B a token, checked) and the running chain hash: asking for
    consecutive windows walks the chain once; asking out of order restarts the walk from chunk 0.
    """

    def __init__(self, space: KeySpace, tokens: Sequence[int], chunk_tokens: int, partial_tokens: int = 0) -> None:
        check_int("chunk_tokens", chunk_tokens, lo=1)
        self._ids = token_id_bytes(tokens)  # checked: a float id would be truncated into another token's key
        self.space = space
        self.tokens = tokens
        self.chunk_tokens = chunk_tokens
        self.full_chunks = len(tokens) // chunk_tokens
        rest = len(tokens) - self.full_chunks * chunk_tokens
        self.partial_tokens = check_int("partial_tokens", partial_tokens, lo=0, hi=min(rest, chunk_tokens - 1))
        self.num_chunks = self.full_chunks + (1 if partial_tokens else 0)
        self._cursor = 0
        self._hash = _CHAIN_START

    def window(self, first_chunk: int, num_chunks: int) -> list[str]:
        check_int("first_chunk", first_chunk)
        check_int("num_chunks", num_chunks)
        end = first_chunk + num_chunks
        if end > self.num_chunks or first_chunk < 0 or num_chunks < 0:
            raise ValueError(
                f"chunks {first_chunk}..{end - 1} outside a prefix of {self.num_chunks} chunks"
            )
        partial = end > self.full_chunks  # the last key asked for is the partial chunk's
        end = min(end, self.full_chunks)
        if first_chunk < self._cursor:
            self._cursor, self._hash = 0, _CHAIN_START
        prefix = self.space._prefix  # once per window, not per key
        ct = self.chunk_tokens
        out = []
        h, ids, features = self._hash, self._ids, self.space.features
        for k in range(self._cursor, end):
            placed = _features_in(features, k * ct, (k + 1) * ct)
            part = ids[k * ct * 8 : (k + 1) * ct * 8]
            h = _h(h, part, placed) if placed else _h(h, part)  # no feature: the plain chain's key
            if k >= first_chunk:
                out.append(f"{prefix}-{h.hex()}")
        if end > self._cursor:
            self._cursor, self._hash = end, h
        if partial:
            out.append(f"{prefix}-{self._partial_hash(self.full_chunks, self.partial_tokens).hex()}")
        return out

    def partial_candidates(self, chunk: int, align: int) -> list[str]:
        """The keys every partial chunk of whole `align`-token blocks shorter than a chunk would have after
        chunks 0..chunk-1 of these tokens (chunk `chunk` being whole here): the partial chunks of shorter
        prompts that a stored chunk `chunk` makes dead."""
        ct = self.chunk_tokens
        if not 0 <= chunk < self.full_chunks:
            raise ValueError(f"chunk {chunk} is not a whole chunk of this prefix")
        if chunk:
            self.window(chunk - 1, 1)  # the chain walked to the chunk before
        else:
            self._cursor, self._hash = 0, _CHAIN_START
        return [f"{self.space._prefix}-{self._partial_hash(chunk, n).hex()}" for n in range(align, ct, align)]

    def _partial_hash(self, chunk: int, n: int) -> bytes:
        """The partial chunk of the `n` tokens after chunks 0..chunk-1: chained after them under a marker and
        with its count, so it is never a whole chunk's key nor another partial chunk's (of other tokens or
        another length). Called with the chain walked to chunk - 1."""
        start = chunk * self.chunk_tokens
        placed = _features_in(self.space.features, start, start + n)
        return _h(self._hash, b"partial chunk", str(n).encode(), self._ids[start * 8 : (start + n) * 8], placed)


def _features_in(features: Sequence[tuple[int, int, str]], start: int, end: int) -> bytes:
    """The features overlapping tokens start..end-1, each as (identifier, offset - start), framed."""
    out = b""
    for offset, length, ident in features:
        if offset < end and offset + length > start:
            out += _h(b"feature", ident.encode("utf-8", "surrogatepass"), str(offset - start).encode())
    return out


_CHAIN_START = b"\0" * 16
