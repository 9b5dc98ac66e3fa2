"""Test data shared by tests, benchmarks and the harness: the poison byte and block tables."""

from __future__ import annotations

POISON = 0xA5  # destination bytes before a restore: anything still POISON was never written

__all__ = ["POISON"]
