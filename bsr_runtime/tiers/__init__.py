"""Storage tiers: where restored objects come from.

`FilesystemTier` (one file per object) and `MooncakeTier`
(Mooncake store; imported lazily, so importing this package never needs the Mooncake wheel).
"""

from .base import (
    FETCH_HEADROOM,
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)
from .filesystem import FilesystemTier

__all__ = [
    "FETCH_HEADROOM",
    "CorruptObjectError",
    "FetchHandle",
    "FetchTimeoutError",
    "FilesystemTier",
    "MissingObjectError",
    "MooncakeTier",
    "Tier",
    "TierError",
    "TierUnavailableError",
]


def __getattr__(name: str):
    if name == "MooncakeTier":
        from .mooncake import MooncakeTier

        return MooncakeTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
