"""Probe-only lookup: hit discovery over the whole candidate prefix, holding nothing.

The probe result H(S) is a decision contract (how many tokens the scheduler may count as
computed), not residency: no staging is allocated and no lock is kept after it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from .keys import PrefixKeys
from .tiers.base import Tier

PROBE_BATCH_CHUNKS = 256


@dataclass(frozen=True)
class ProbeResult:
    tier: str
    bitmap: bytes  # one byte per candidate chunk: 1 = present
    prefix_chunks: int  # longest fully present prefix, in chunks

    @property
    def hits(self) -> int:
        return sum(self.bitmap)


def probe_prefix(tier: Tier, keys: PrefixKeys, num_chunks: int | None = None,
                 batch_chunks: int = PROBE_BATCH_CHUNKS) -> ProbeResult:
    """Probe chunks 0..num_chunks-1 (default: every whole chunk of the prefix) in batches."""
    total = keys.num_chunks if num_chunks is None else min(num_chunks, keys.num_chunks)
    bitmap = bytearray(total)
    for first in range(0, total, batch_chunks):
        n = min(batch_chunks, total - first)
        for i, hit in enumerate(tier.probe(keys.window(first, n))):
            bitmap[first + i] = 1 if hit else 0
    prefix = bitmap.find(0)
    return ProbeResult(tier.name, bytes(bitmap), total if prefix < 0 else prefix)
