"""A directory nothing can be created in, for whoever runs the tests: permission bits stop an ordinary
user, not root, so as root the directory is made immutable (chattr +i: even root gets EPERM there).
Where neither works (root on a filesystem without the attribute, no chattr) the test is skipped."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _can_create_in(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def _chattr(flag: str, path: Path) -> bool:
    chattr = shutil.which("chattr")
    return chattr is not None and subprocess.run([chattr, flag, str(path)], capture_output=True).returncode == 0


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """`path` created, then made read-only for this process until the block ends."""
    path.mkdir(parents=True, exist_ok=True)
    immutable = os.geteuid() == 0 and _chattr("+i", path)
    if not immutable:
        path.chmod(0o555)
    try:
        if _can_create_in(path):
            pytest.skip(f"cannot make {path} read-only for this user (root without chattr +i here)")
        yield path
    finally:
        if immutable:
            _chattr("-i", path)
        path.chmod(0o755)
