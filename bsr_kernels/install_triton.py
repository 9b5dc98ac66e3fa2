"""Triton backend (placeholder until the kernel lands)."""

from __future__ import annotations

import torch


def available(device: torch.device) -> bool:
    return False
