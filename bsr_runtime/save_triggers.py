"""Which prompt chunks an engine saves, and in which step: the save triggers of a connector's scheduler
side. Engine-neutral (imports no engine): an engine's adapter tells it what its scheduler did, and ships
the ranges it answers to the workers, whose Saver gathers them after the step's forward (saver.py).

    triggers = SaveTriggers(chunk_tokens)
    triggers.track(rid, tokens, salt, features, partial_tokens)   the request's whole prompt chunks (and
                                                                  its partial chunk) are to be saved
    triggers.loaded(rid, num_chunks, partial)     a load restores them: the tier holds them already
    triggers.scheduled(rid, num_computed_tokens, first=...)      the engine scheduled the request; at
                                                  its first schedule the chunks the engine already held
                                                  were saved by whoever computed them
    triggers.due({rid: num_scheduled_tokens}) -> [SaveRange]      what this step's forward completes
    triggers.load_failed(rid)     saved again as it is recomputed, every chunk rewritten
    triggers.forget(rid) / triggers.clear()

A range holds only whole chunks of the prompt, plus, once every whole chunk went out and the prompt's
last token was computed, the prompt's partial chunk (whole blocks past its last whole chunk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SaveRange:
    """Chunks first_chunk..num_chunks-1 of a request to save (chunk num_chunks-1 its partial chunk of
    `partial_tokens` tokens when that is > 0)."""

    request_id: str
    tokens: list[int]  # the tokens of chunks 0..num_chunks-1 (the key chain starts at chunk 0)
    first_chunk: int
    num_chunks: int
    salt: str
    features: tuple[tuple[int, int, str], ...]
    overwrite: bool = False  # the request's load failed: rewrite the chunks (repairs damaged objects)
    partial_tokens: int = 0


@dataclass
class _Tracked:
    tokens: list[int]
    num_chunks: int  # complete prompt chunks
    salt: str
    features: tuple[tuple[int, int, str], ...]
    partial_tokens: int = 0  # the prompt's partial chunk saved after its whole chunks (whole blocks; 0: none)
    partial_saved: bool = False
    computed: int = 0
    saved_chunks: int = 0  # chunks 0..saved_chunks-1 went out in ranges (or were loaded from a tier)
    overwrite: bool = False


class SaveTriggers:
    """See the module docstring."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._tracked: dict[str, _Tracked] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._tracked

    def track(self, rid: str, tokens: Sequence[int], salt: str, features: tuple[tuple[int, int, str], ...] = (),
              partial_tokens: int = 0) -> bool:
        """Track the request's prompt (once; False when it has no whole chunk: nothing to save)."""
        if rid in self._tracked:
            return True
        n = len(tokens) // self.chunk_tokens
        if n == 0:
            return False
        self._tracked[rid] = _Tracked(list(tokens[: n * self.chunk_tokens + partial_tokens]), n, salt, features,
                                      partial_tokens)
        return True

    def loaded(self, rid: str, num_chunks: int, partial: bool) -> None:
        """A load restores chunks 0..num_chunks-1 (the last one the partial chunk when `partial`): the tier
        holds them; a failed load resets this (load_failed)."""
        t = self._tracked.get(rid)
        if t is not None:
            t.saved_chunks = max(t.saved_chunks, min(num_chunks, t.num_chunks))
            t.partial_saved = t.partial_saved or partial

    def scheduled(self, rid: str, num_computed_tokens: int, *, first: bool) -> None:
        """The engine scheduled the request with this many tokens computed. At its first schedule the chunks
        the engine's own cache (or a load) held were computed by a request that saved them: not gathered
        again (one that could not save them is a future miss, not an error)."""
        t = self._tracked.get(rid)
        if t is None:
            return
        t.computed = num_computed_tokens
        if first and not t.overwrite:
            t.saved_chunks = max(t.saved_chunks, min(t.num_chunks, num_computed_tokens // self.chunk_tokens))

    def due(self, num_scheduled_tokens: Mapping[str, int]) -> list[SaveRange]:
        """The ranges this step's forward completes (`num_scheduled_tokens`: the step's tokens per request), in
        the order the requests were tracked."""
        out = []
        for rid, t in self._tracked.items():
            n = num_scheduled_tokens.get(rid)
            if n is not None:
                out += self._due(rid, t, n)
        return out

    def _due(self, rid: str, t: _Tracked, num_scheduled_tokens: int) -> list[SaveRange]:
        """One request's: its whole chunks, then its partial one."""
        out = []
        upto = t.computed + num_scheduled_tokens
        done = min(t.num_chunks, upto // self.chunk_tokens)
        if done > t.saved_chunks:
            out.append(SaveRange(rid, t.tokens, t.saved_chunks, done, t.salt, t.features, t.overwrite))
            t.saved_chunks = done
        if t.partial_tokens and not t.partial_saved and done == t.num_chunks and upto >= len(t.tokens):
            out.append(SaveRange(rid, t.tokens, t.num_chunks, t.num_chunks + 1, t.salt, t.features, t.overwrite,
                                 t.partial_tokens))
            t.partial_saved = True
        return out

    def load_failed(self, rid: str) -> None:
        """The request's load failed: it is recomputed, and saved again as that goes, every chunk rewritten."""
        t = self._tracked.get(rid)
        if t is not None:
            t.saved_chunks, t.overwrite, t.partial_saved = 0, True, False

    def forget(self, rid: str) -> None:
        self._tracked.pop(rid, None)

    def clear(self) -> None:
        """Forget every request (their KV may predate a change of the engine's weights)."""
        self._tracked.clear()
