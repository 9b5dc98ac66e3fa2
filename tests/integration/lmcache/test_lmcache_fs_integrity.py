"""The FS L2 plugin (fs_l2.ConcurrentFSL2Adapter) refuses object files that are not the key's own, intact
object: a flipped byte, two files swapped, another tenant's (cache salt's) objects copied under this
tenant's keys, a file in LMCache's headerless format. Through the real LMCache StorageManager: each
restore from the LMCache tier fails closed (ok=False, committed_tokens=0, L1 back to its baseline) instead
of restoring.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")

from kernel_util import random_kv  # noqa: E402
from lmcache_util import chunk_keys, restore, store  # noqa: E402
from restore_util import random_tables  # noqa: E402

from bsr_harness.testdata import POISON  # noqa: E402
from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.lmcache import (  # noqa: E402
    LMCacheTier,
    fs_l2_config,
    load_adapter_config,
    model_name,
    object_keys,
)
from bsr_runtime.integrations.lmcache.fs_l2_object import HEADER_SIZE  # noqa: E402
from bsr_runtime.keys import KeySpace, PrefixKeys  # noqa: E402
from bsr_runtime.restore import RestoreRequest  # noqa: E402
from bsr_runtime.state_hash import state_hash  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REG = presets.dsv4_flash(scale=1 / 1024)
C = REG.chunk_bytes
N = 8
OBJ_4K = -(-C // 4096) * 4096
FILE_BYTES = HEADER_SIZE + C  # one object file: header + payload
SPACE_A = KeySpace(REG.fingerprint, salt="tenant-a")
SPACE_B = KeySpace(REG.fingerprint, salt="tenant-b")


class Stored:
    def __init__(self, base: str) -> None:
        self.base = base
        gen = torch.Generator().manual_seed(17)
        self.tokens = torch.randint(0, 50_000, (N * REG.chunk_tokens,), generator=gen).tolist()
        blocks, self.tables = random_tables(REG, N, 21)
        self.kv = random_kv(REG, blocks, 22)
        self.hash = state_hash(REG, self.kv, self.tables, N)

    def request(self, space: KeySpace, seed: int) -> RestoreRequest:
        blocks, tables = random_tables(REG, N, 100 + seed)
        kv = REG.allocate(blocks)
        for t in kv:
            t.view(torch.uint8).fill_(POISON)
        return RestoreRequest(f"req-{seed}", self.tokens, space, kv, tables)

    def keys(self, space: KeySpace):
        """The LMCache keys of the prefix's chunks (the tier's mapping of BSR keys)."""
        return object_keys(PrefixKeys(space, self.tokens, REG.chunk_tokens).window(0, N), model_name(REG.fingerprint))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """N chunks of tenant A, written through LMCache's own store path into an FS L2 directory."""
    s = Stored(str(tmp_path_factory.mktemp("lmcache-fs-a")))
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(s.base)], load_adapter_config()) as tier:
        assert store(tier, REG, SPACE_A, s.tokens, s.kv, s.tables).state_hash == s.hash
    assert len([f for f in os.listdir(s.base) if f.endswith(".data")]) == N
    return s


def _retrieve(base: str, stored: Stored, space: KeySpace, conc: int, seed: int):
    with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(base, load_concurrency=conc)],
                            load_adapter_config()) as tier:
        baseline = tier.l1_usage()[0]
        req = stored.request(space, seed)
        rep = restore(tier, req, N, 4)
        return rep, req, baseline, tier.l1_usage()[0]


def _paths(base: str, stored: Stored, space: KeySpace) -> list[str]:
    from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2Adapter, ConcurrentFSL2AdapterConfig

    ad = ConcurrentFSL2Adapter(ConcurrentFSL2AdapterConfig(base, load_concurrency=1))
    try:
        return [str(ad._key_to_path(k)) for k in stored.keys(space)]
    finally:
        ad.close()


def _assert_fails_closed(rep, baseline: int, after: int, caplog=None, why: str = "") -> None:
    assert not rep.ok and rep.committed_tokens == 0, rep
    assert after == baseline
    if caplog is not None:
        assert any("refused" in r.getMessage() and why in r.getMessage() for r in caplog.records), why


@pytest.fixture
def copy(stored, tmp_path):
    dst = str(tmp_path / "l2")
    shutil.copytree(stored.base, dst)
    return dst


@pytest.mark.parametrize("conc", [1, 4])
def test_intact_objects_restore(stored, copy, conc):
    rep, req, baseline, after = _retrieve(copy, stored, SPACE_A, conc, seed=1)
    assert rep.ok and rep.committed_tokens == N * REG.chunk_tokens
    assert state_hash(REG, req.kv, req.block_tables, N) == stored.hash
    assert after == baseline


@pytest.mark.parametrize("conc", [1, 4])
def test_flipped_byte_fails_closed(stored, copy, conc, caplog):
    path = _paths(copy, stored, SPACE_A)[5]
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    rep, _, baseline, after = _retrieve(copy, stored, SPACE_A, conc, seed=2)
    _assert_fails_closed(rep, baseline, after, caplog, "payload checksum mismatch")


@pytest.mark.parametrize("conc", [1, 4])
def test_swapped_files_fail_closed(stored, copy, conc, caplog):
    paths = _paths(copy, stored, SPACE_A)
    tmp = paths[3] + ".swap"
    os.replace(paths[3], tmp)
    os.replace(paths[6], paths[3])
    os.replace(tmp, paths[6])
    rep, _, baseline, after = _retrieve(copy, stored, SPACE_A, conc, seed=3)
    _assert_fails_closed(rep, baseline, after, caplog, "another key's object")


@pytest.mark.parametrize("conc", [1, 4])
def test_other_tenants_objects_fail_closed(stored, copy, conc, caplog):
    for src, dst in zip(_paths(copy, stored, SPACE_A), _paths(copy, stored, SPACE_B), strict=True):
        assert src != dst
        shutil.copyfile(src, dst)
    rep, _, baseline, after = _retrieve(copy, stored, SPACE_B, conc, seed=4)
    _assert_fails_closed(rep, baseline, after, caplog, "another key's object")


@pytest.mark.parametrize("conc", [1, 4])
def test_headerless_file_fails_closed(stored, copy, conc, caplog):
    """A file in LMCache's own format (the raw object bytes, no header) is refused, not migrated."""
    path = _paths(copy, stored, SPACE_A)[2]
    with open(path, "rb") as f:
        payload = f.read()[HEADER_SIZE:]
    with open(path, "wb") as f:
        f.write(payload)
    rep, _, baseline, after = _retrieve(copy, stored, SPACE_A, conc, seed=5)
    _assert_fails_closed(rep, baseline, after, caplog, "headerless")


def test_file_size_is_header_plus_object(stored):
    from bsr_runtime.integrations.lmcache.fs_l2_object import MAGIC

    for path in _paths(stored.base, stored, SPACE_A):
        assert os.path.getsize(path) == HEADER_SIZE + C  # LMCache's logical object size
        with open(path, "rb") as f:
            assert f.read(4) == MAGIC


# -- the plugin's tasks, called directly (pool jobs per task) -------------------------------------
class _L1Object:
    """What the plugin reads of an LMCache MemoryObj: `byte_array` (writable) and `data_ptr`."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.byte_array = memoryview(t.numpy())
        self.data_ptr = t.data_ptr()


def _objects(seed: int, fill: int | None = None) -> list[_L1Object]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N):
        t = torch.full((C,), fill, dtype=torch.uint8) if fill is not None else torch.randint(
            0, 256, (C,), dtype=torch.uint8, generator=gen)
        out.append(_L1Object(t))
    return out


def _done(fd: int, query, task_id):
    import select

    while True:
        result = query(task_id)
        if result is not None:
            return result
        ready, _, _ = select.select([fd], [], [], 30.0)
        assert ready, "the plugin's task did not complete"
        os.read(fd, 8)  # LMCache's eventfd: reading resets it


class _CountingPoolJobs:
    """Counts the jobs the plugin hands to its pool (each is one hand-off between threads)."""

    def __init__(self, ad) -> None:
        self.calls, self._submit = 0, ad._pool.submit
        ad._pool.submit = self

    def __call__(self, *args):
        self.calls += 1
        return self._submit(*args)


def _plugin(tmp_path, conc: int):
    from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2Adapter, ConcurrentFSL2AdapterConfig

    return ConcurrentFSL2Adapter(ConcurrentFSL2AdapterConfig(str(tmp_path), load_concurrency=conc))


def _store(ad, keys, objs):
    return _done(ad.get_store_event_fd(), lambda t: ad.pop_completed_store_tasks().get(t),
                 ad.submit_store_task(keys, objs))


def _lookup(ad, keys):
    return _done(ad.get_lookup_and_lock_event_fd(), ad.query_lookup_and_lock_result,
                 ad.submit_lookup_and_lock_task(keys, {}))


def _load(ad, keys, objs):
    return _done(ad.get_load_event_fd(), ad.query_load_result, ad.submit_load_task(keys, objs))


@pytest.mark.parametrize("conc", [1, 3, 8, 16])
def test_plugin_tasks_store_lookup_load(stored, tmp_path, conc):
    """Store: an existing file is replaced (LMCache's FSL2Adapter keeps it, so a damaged object could never be
    repaired by storing it again), a key whose write fails is reported (success False) and leaves no temp
    file; lookup: exactly the keys with files; load into poisoned objects: exactly those keys, byte for
    byte, the others untouched. A store is one pool job, a window's lookup none (it runs on the submitting
    thread), a load min(conc, n) jobs."""
    keys = stored.keys(SPACE_A)
    src, older = _objects(seed=conc), _objects(seed=99)
    ad = _plugin(tmp_path, conc)
    try:
        calls = _CountingPoolJobs(ad)
        assert _store(ad, [keys[1]], [older[1]]) == FILE_BYTES  # written before: replaced below
        failing = ad._key_to_path(keys[4])
        os.makedirs(failing)  # a directory in its place: its temp file cannot be renamed over it
        calls.calls = 0
        result = _store(ad, keys, src)
        assert result < 0  # L2StoreResult: -1 = failed
        assert calls.calls == 1
        assert os.path.isdir(failing) and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
        present = [i for i in range(N) if i != 4]

        calls.calls = 0
        assert _lookup(ad, keys).get_indices_list() == present and calls.calls == 0

        dst = _objects(seed=0, fill=POISON)
        calls.calls = 0
        assert _load(ad, keys, dst).get_indices_list() == present
        assert calls.calls == min(conc, N)
        for i in range(N):
            want = src[i].t
            if i == 4:
                assert bool((dst[i].t == POISON).all())
            else:
                assert torch.equal(dst[i].t, want), i
    finally:
        ad.close()


def test_plugin_long_lookup_runs_on_the_pool(stored, tmp_path):
    """A lookup longer than INLINE_LOOKUP_KEYS is one pool job (not stat calls on LMCache's controller
    thread), with the same answer: every key present, the repeated ones included."""
    from bsr_runtime.integrations.lmcache import fs_l2

    keys = stored.keys(SPACE_A)
    ad = _plugin(tmp_path, 1)
    try:
        _store(ad, keys, _objects(seed=3))
        many = (keys * (fs_l2.INLINE_LOOKUP_KEYS // N + 1))[: fs_l2.INLINE_LOOKUP_KEYS + 1]
        calls = _CountingPoolJobs(ad)
        assert _lookup(ad, many).get_indices_list() == list(range(len(many)))
        assert calls.calls == 1
    finally:
        ad.close()


@pytest.mark.parametrize("task", ["store", "lookup", "load"])
def test_plugin_task_that_raises_still_completes(stored, tmp_path, monkeypatch, task):
    """An exception inside a task (here: every key's path) completes it as failed, nothing found or loaded,
    rather than leaving LMCache's controller waiting for it; the poisoned objects stay untouched."""
    keys = stored.keys(SPACE_A)
    src = _objects(seed=7)
    ad = _plugin(tmp_path, 3)
    try:
        _store(ad, keys, src)

        def broken(*_a, **_k):
            raise RuntimeError("injected")

        if task == "store":
            monkeypatch.setattr(ad, "_store_all", broken)
            assert _store(ad, keys, src) < 0
        elif task == "lookup":
            monkeypatch.setattr(ad, "_present", broken)
            assert _lookup(ad, keys).get_indices_list() == []
        else:
            monkeypatch.setattr(ad, "_load_one", broken)
            dst = _objects(seed=0, fill=POISON)
            assert _load(ad, keys, dst).get_indices_list() == []
            assert all(bool((o.t == POISON).all()) for o in dst)
    finally:
        ad.close()



# -- log lines: none of LMCache's per-window prefetch lines ---------------------------------------
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG], ids=["info", "debug"])
def test_windowed_restore_logs_no_window_lines(stored, copy, level):
    """At INFO, a restore of N chunks at W = 2 from the tier logs none of LMCache's per-prefetch lines
    for its N/2 windows (the restore's report is its record), while a prefetch of another caller still
    logs its line; at DEBUG the window lines are kept."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
    from lmcache.v1.distributed.storage_manager import StorageManager

    from bsr_runtime.integrations.lmcache.prefetch import release_result

    logger = logging.getLogger(StorageManager.__module__)
    handler, old_level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        with LMCacheTier.create(REG, 8 * OBJ_4K, [fs_l2_config(copy)], load_adapter_config()) as tier:
            req = stored.request(SPACE_A, seed=3)
            rep = restore(tier, req, N, 2)
            assert rep.ok and rep.windows == N // 2
            windows = [m for m in handler.lines if m.startswith("Prefetch request completed")]
            assert len(windows) == (N // 2 if level == logging.DEBUG else 0), windows
            okeys = chunk_keys(tier, SPACE_A, req.tokens, 0, 2)
            spec = PrefetchTaskSpec([GroupedObjectKeys(okeys, 0, tier.layout)], num_kv_readers=1,
                                    fetching_policy="prefix")
            handle = tier.sm.submit_prefetch_task(spec, external_request_id="someone-else")
            assert tier.sm.wait_prefetch_status(handle, 30.0)
            result = tier.sm.query_prefetch_status(handle)
            release_result(tier.sm, result, okeys, evict_loaded=True)
            assert any("someone-else" in m for m in handler.lines[-2:]), handler.lines[-3:]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
