"""Work of microseconds on a restore's or a probe's thread keeps the GIL: beside a thread running Python (an
engine's step), every give-up and take-back of the GIL can wait a whole switch interval
(benchmarks/restore_beside_busy_thread.py measures what that costs). Checked where the GIL is given up: hashlib
gives it up for an update of HASHLIB_GIL_MINSIZE (2048) bytes or more (and for every later update of that hash
object), a ctypes.CDLL call always, a ctypes.PyDLL call never."""

from __future__ import annotations

import ctypes
import hashlib
import time

import pytest
import torch

from bsr_runtime import keys as keys_module
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers import FilesystemTier, fs_native
from bsr_runtime.tiers.fs_format import FILE_FLAGS, HEADER_SIZE, key_digest

FP = "0123456789abcdef0123456789abcdef"
HASHLIB_GIL_MINSIZE = 2048  # CPython's Modules/hashlib.h


def test_the_key_chain_never_feeds_hashlib_enough_to_give_the_gil_up(monkeypatch):
    """A chunk's ids are 2048 bytes at 256 tokens: fed whole, each chunk's hash would give the GIL up. Fed in
    pieces, the digests are the ones of the whole parts (the chain is unchanged)."""
    sizes: list[int] = []
    real = hashlib.blake2b

    class Recording:
        def __init__(self, **kw):
            self._h = real(**kw)

        def update(self, data):
            sizes.append(memoryview(data).nbytes)
            self._h.update(data)

        def digest(self):
            return self._h.digest()

    tokens = list(range(4 * 256)) + [7] * 100  # whole chunks and a partial one
    space = KeySpace(FP)
    expected = PrefixKeys(space, tokens, 256, partial_tokens=100).window(0, 5)
    monkeypatch.setattr(keys_module.hashlib, "blake2b", Recording)
    got = PrefixKeys(space, tokens, 256, partial_tokens=100).window(0, 5)
    assert got == expected
    assert sizes and max(sizes) < HASHLIB_GIL_MINSIZE
    assert sum(s for s in sizes if s > 8) >= 4 * 256 * 8  # every id went through the recorder


class _Calls:
    """A library whose calls are recorded (by name) and passed on."""

    def __init__(self, lib, log: list[str], tag: str) -> None:
        self._lib, self._log, self._tag = lib, log, tag

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*a):
            self._log.append(f"{self._tag}:{name}")
            return fn(*a)

        return call


def test_queueing_a_read_and_seeing_it_ended_keep_the_gil(tmp_path):
    """Submitting a window's read and asking whether it ended (it had) are PyDLL calls; only a wait that has
    to block gives the GIL up."""
    tier = FilesystemTier(tmp_path, 4096, FP, load_concurrency=1)
    try:
        if not tier.batched:
            pytest.skip("no native reader here (openat2 or the CPU library missing)")
        reader = tier._reader
        assert isinstance(reader._quick, ctypes.PyDLL) and not isinstance(reader._lib, ctypes.PyDLL)
        keys = [f"k{i}" for i in range(4)]
        tier.put(keys, [torch.full((4096,), i, dtype=torch.uint8) for i in range(4)])
        out = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        digests, addrs = [key_digest(k) for k in keys], [o.data_ptr() for o in out]
        log: list[str] = []
        reader._lib, reader._quick = _Calls(reader._lib, log, "released"), _Calls(reader._quick, log, "kept")
        reader.hold(True)
        job = reader.submit(digests, FILE_FLAGS, tier.object_size, HEADER_SIZE, addrs,
                            fs_native.deadline_ns(time.monotonic() + 60))
        assert not job.wait(0)  # not read yet: asked, not waited for
        assert all(c.startswith("kept:") for c in log), log
        reader.hold(False)
        log.clear()
        assert job.wait(30)  # this wait may block: it gives the GIL up
        assert "released:bsr_fs_reader_wait" in log
        job2 = reader.submit(digests, FILE_FLAGS, tier.object_size, HEADER_SIZE, addrs,
                             fs_native.deadline_ns(time.monotonic() + 60))
        assert reader._lib._lib.bsr_fs_reader_wait(reader._ptr, job2.id, 30 * 10**9) == 1  # ended, not yet seen
        log.clear()
        assert job2.wait(5)  # it had ended: seen and let go with the GIL kept
        assert log == ["kept:bsr_fs_reader_wait", "kept:bsr_fs_reader_forget"], log
        assert all(torch.equal(o, torch.full((4096,), i, dtype=torch.uint8)) for i, o in enumerate(out))
    finally:
        tier._reader.hold(False)
        tier.close()
