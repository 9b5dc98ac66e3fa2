"""The filesystem tier's read path (tiers/fs_open.py and FilesystemTier.fetch): the one-openat2
open and its component-by-component fallback refuse the same things, a fan-out directory swapped
for a symlink (or a file) after earlier fetches succeeded fails the next fetch closed, and a
fetch's workers stop taking objects on the first error. Also: object keys never change."""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers import CorruptObjectError, FilesystemTier, MissingObjectError, TierError, fs_open

FP = "0123456789abcdef0123456789abcdef"
SMALL = 4096 + 16 * 3


def _openat2_here(tmp_path) -> bool:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return fs_open.openat2_works(fd)
    finally:
        os.close(fd)


@pytest.fixture(params=["batched", "openat2", "walk"])
def tier(request, tmp_path):
    """The three read paths: a window's objects as one job of the native reader (openat2 in C), one
    openat2 per object from Python, and the component-by-component walk."""
    root = tmp_path / "store"
    root.mkdir()
    t = FilesystemTier(root, SMALL, FP, load_concurrency=2)
    if request.param != "walk" and not t._openat2:
        t.close()
        pytest.skip("openat2 is not available here")
    if request.param == "batched" and not t.batched:
        t.close()
        pytest.skip("the CPU library is not built")
    if request.param != "batched":
        t._native = False
    if request.param == "walk":
        t._openat2 = False
    yield t
    t.close()


def _data(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (SMALL,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _fetch(t, keys):
    out = [torch.full((SMALL,), 7, dtype=torch.uint8) for _ in keys]
    h = t.fetch(keys, out, time.monotonic() + 10)
    try:
        h.wait()
        err = None
    except TierError as e:
        err = e
    assert h.quiesce(5)
    return err, out


def _parts(t, key):
    return os.path.relpath(t.path_of(key), t.root).split("/")


@pytest.mark.parametrize("level", [1, 2])
def test_fanout_dir_swapped_for_symlink_after_warm_fetches(tier, tmp_path, level):
    data = _data(1)
    tier.put(["k"], data)
    for _ in range(3):  # warm: whatever could be cached is cached now
        err, out = _fetch(tier, ["k"])
        assert err is None and torch.equal(out[0], data[0])
    parts = _parts(tier, "k")
    victim = os.path.join(tier.root, *parts[:level])
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = outside / "moved"
    shutil.move(victim, moved)  # a still-open descriptor of it would now point outside the root
    os.symlink(moved, victim)
    target = os.path.join(moved, *parts[level:])
    assert os.path.isfile(target)  # a valid object for this key, reachable through the symlink
    err, out = _fetch(tier, ["k"])
    assert isinstance(err, CorruptObjectError)
    assert bool((out[0] == 7).all()), "nothing may land from outside the root"
    assert tier.probe(["k"]) == [False]


@pytest.mark.parametrize("level", [1, 2])
def test_fanout_dir_renamed_away_after_warm_fetches(tier, tmp_path, level):
    tier.put(["k"], _data(1))
    assert _fetch(tier, ["k"])[0] is None
    victim = os.path.join(tier.root, *_parts(tier, "k")[:level])
    shutil.move(victim, tmp_path / "gone")
    err, out = _fetch(tier, ["k"])
    assert isinstance(err, MissingObjectError)
    assert bool((out[0] == 7).all())


@pytest.mark.parametrize("level", [1, 2])
def test_file_in_place_of_fanout_dir(tier, level):
    tier.put(["k"], _data(1))
    victim = os.path.join(tier.root, *_parts(tier, "k")[:level])
    shutil.rmtree(victim)
    with open(victim, "wb") as f:
        f.write(b"x" * 200)
    err, out = _fetch(tier, ["k"])
    assert isinstance(err, CorruptObjectError)
    assert bool((out[0] == 7).all())


def test_symlinked_root_component_is_not_followed_below_root(tier, tmp_path):
    """An object file symlinked to another valid object *inside* the root is refused too."""
    data = _data(2)
    tier.put(["a", "b"], data)
    pa = tier.path_of("a")
    os.unlink(pa)
    os.symlink(tier.path_of("b"), pa)
    err, out = _fetch(tier, ["a"])
    assert isinstance(err, CorruptObjectError) and "symlink" in str(err)
    assert bool((out[0] == 7).all())


def test_fallback_when_openat2_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_open, "_SYSCALL", None)
    root = tmp_path / "store"
    root.mkdir()
    with FilesystemTier(root, SMALL, FP) as t:
        assert t._openat2 is False
        data = _data(3)
        t.put(["a", "b", "c"], data)
        err, out = _fetch(t, ["a", "b", "c"])
        assert err is None and all(torch.equal(o, d) for o, d in zip(out, data, strict=True))


def test_openat2_used_where_the_kernel_has_it(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    with FilesystemTier(root, SMALL, FP) as t:
        assert t._openat2 == _openat2_here(root)


@pytest.mark.parametrize("conc", [1, 3])
def test_workers_stop_taking_objects_after_an_error(tmp_path, conc):
    root = tmp_path / "store"
    root.mkdir()
    keys = [f"k{i}" for i in range(12)]
    with FilesystemTier(root, SMALL, FP, load_concurrency=conc) as t:
        t._native = False  # objects one at a time (the batched path: test_fs_native.py)
        t.put(keys, _data(len(keys)))
        with open(t.path_of("k4"), "r+b") as f:  # damage one payload byte
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 1]))
        started, lock = [], threading.Lock()
        real = t._read_into

        def slow(key, dst):  # k4 fails at once, every other read takes 50 ms
            with lock:
                started.append(key)
            if key != "k4":
                time.sleep(0.05)
            return real(key, dst)

        t._read_into = slow
        err, out = _fetch(t, keys)
        assert isinstance(err, CorruptObjectError) and "checksum" in str(err)
        # objects are taken in order (the workers may log them out of order); after k4 fails,
        # the conc - 1 reads then running end, and no new one starts
        assert sorted(started, key=keys.index) == keys[: len(started)]
        assert len(started) <= 5 + (conc - 1)
        assert all(bool((o == 7).all()) for o in out[len(started):])


def test_one_pool_task_per_worker_per_fetch(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    keys = [f"k{i}" for i in range(10)]
    with FilesystemTier(root, SMALL, FP, load_concurrency=3) as t:
        t._native = False  # objects one at a time through the pool (the native reader: test_fs_native.py)
        data = _data(len(keys))
        t.put(keys, data)
        submits = []
        real_submit = t._pool.submit
        t._pool.submit = lambda fn, *a: (submits.append(fn), real_submit(fn, *a))[1]
        err, out = _fetch(t, keys)
        assert err is None and all(torch.equal(o, d) for o, d in zip(out, data, strict=True))
        assert len(submits) == 3
        submits.clear()
        assert _fetch(t, keys[:2])[0] is None
        assert len(submits) == 2


# Keys are the names of stored objects: a change would orphan every object already stored.
# (Computed with the per-chunk implementation that preceded the blockwise one.)
GOLDEN_KEYS = [
    "bsr1-3d1ae49a7ce07e34-0123456789abcdef-md050ca7289b943f5-r1of2-f934beea728adc0e871404dc18492ba5",
    "bsr1-3d1ae49a7ce07e34-0123456789abcdef-md050ca7289b943f5-r1of2-87e5ac20e052eb67bba74fe29b1caeb8",
    "bsr1-3d1ae49a7ce07e34-0123456789abcdef-md050ca7289b943f5-r1of2-2d3fe416627850bd99cfd812ca816837",
]


def test_keys_are_stable():
    space = KeySpace(FP, tp_rank=1, tp_world=2, salt="t", model="m")
    tokens = list(range(-5, 3 * 16 - 5))
    for variant in (tokens, tuple(tokens), torch.tensor(tokens), np.asarray(tokens)):
        assert PrefixKeys(space, variant, 16).window(0, 3) == GOLDEN_KEYS
    pk = PrefixKeys(space, tokens, 16)
    assert pk.window(1, 2) == GOLDEN_KEYS[1:]
    assert pk.window(0, 1) == GOLDEN_KEYS[:1]  # out of order: the walk restarts
    assert pk.window(2, 1) == GOLDEN_KEYS[2:]


def test_keys_walk_in_blocks_matches_one_chunk_at_a_time():
    space = KeySpace(FP)
    tokens = list(range(200 * 4))
    whole = PrefixKeys(space, tokens, 4).window(0, 200)  # several blocks in one call
    pk = PrefixKeys(space, tokens, 4)
    assert [pk.window(i, 1)[0] for i in range(200)] == whole
