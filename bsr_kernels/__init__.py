"""Device layer of BSR: registrations and chunk layout, install/gather backends, staging (one arena).

Free of storage and protocol: nothing here knows about tiers, keys or requests.
"""

from . import presets
from .install import WindowInstaller, available_backends, gather_window, install_window
from .registration import Registration, TensorSpec
from .staging_arena import ArenaLease, StagingArena

__all__ = [
    "ArenaLease",
    "Registration",
    "StagingArena",
    "TensorSpec",
    "WindowInstaller",
    "available_backends",
    "gather_window",
    "install_window",
    "presets",
]
