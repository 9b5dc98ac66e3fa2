"""A toy tier type, registered in code as a new tier would be (bsr_runtime/tiers/registry.py): objects
in a named in-process store, so every tier opened on the same `store` sees the same objects. The
contract suite (tests/unit/test_tier_contract.py) and the connector's config tests open it only by
its registered name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from bsr_harness.memory_tier import MemoryTier
from bsr_runtime.config_schema import Name, Schema
from bsr_runtime.tiers.registry import TierType, register_tier_type, unregister_tier_type

STORES: dict[str, dict] = {}


class ToyTierSpec(Schema):
    type: Literal["toy"] = "toy"
    store: Name  # the in-process store's name


def open_toy_tier(reg, spec: ToyTierSpec) -> MemoryTier:
    return MemoryTier(reg.chunk_bytes, reg.fingerprint, store=STORES.setdefault(spec.store, {}))


TOY = TierType("toy", ToyTierSpec, open_toy_tier)


@contextlib.contextmanager
def registered() -> Iterator[TierType]:
    """The toy type registered (its one registration) for the block, then forgotten: other tests list the types."""
    register_tier_type(TOY)
    try:
        yield TOY
    finally:
        unregister_tier_type(TOY.name)
