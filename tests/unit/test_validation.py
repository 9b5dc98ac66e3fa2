"""Knobs and inputs are validated where they enter (bsr_runtime/validation.py).

- timeouts (every knob that ends in Event.wait / Lock.acquire): finite, positive and at most
  threading.TIMEOUT_MAX; `inf` or 1e10 used to pass and then overflow inside a wait;
- numeric bounds: NaN used to disable a bound (a byte budget of nan granted 1e15 B; a whole-plan
  restore under max_staging_bytes=nan restored any size);
- entry-point inputs of the connector and the key space: negative num_computed_tokens, float
  token ids (truncated into another token's keys), float chunk counts, unencodable salts;
- the staging of install_window / gather_window / WindowInstaller (bsr_kernels.validate.check_staging):
  1-D contiguous, or 2-D chunk-strided (rows of chunk_bytes, stride(1) == 1, a chunk stride that is
  >= chunk_bytes and a multiple of 16, enough rows, a 16-byte aligned address).
Each is a ValueError naming the knob, raised before any work starts.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from restore_util import fresh_request, store_random_prefix

from bsr_harness.memory_tier import MemoryTier
from bsr_harness.standalone_connector import ConnectorRequest, StandaloneConnector
from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime import commit
from bsr_runtime.admission import Admission
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.retrieve import Retriever

REG = presets.llama_like(layers=2, kv_heads=1, head_dim=16, block_size=16)
BAD_TIMEOUTS = [math.inf, 1e10, threading.TIMEOUT_MAX * 2, math.nan, -math.inf, 0, -1, True, "5", None]
BAD_BYTES = [math.nan, math.inf, 1.5, 1e9, -1, 0, True, "64", None]


def _tier():
    return MemoryTier(REG.chunk_bytes, REG.fingerprint)


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
@pytest.mark.parametrize("make", [
    lambda v: RestoreConfig(fetch_timeout_s=v),
    lambda v: RestoreConfig(admission_timeout_s=v) if v is not None else RestoreConfig(admission_timeout_s="x"),
    lambda v: Retriever(REG, [_tier()], agree_timeout_s=v),
    lambda v: Retriever(REG, [_tier()], unavailable_cooldown_s=v if v not in (0, None) else math.nan),
    lambda v: StandaloneConnector(REG, [_tier()], agree_timeout_s=v),
    lambda v: commit.agree([True], timeout_s=v),
    lambda v: commit.all_min([1], timeout_s=v),
], ids=["fetch_timeout_s", "admission_timeout_s", "retriever_agree", "cooldown", "connector_agree", "agree",
        "all_min"])
def test_timeout_knobs_refused(make, value):
    with pytest.raises(ValueError, match="must be"):
        make(value)


@pytest.mark.parametrize("value", [math.inf, 1e10, math.nan, -1, 0, "1"])
def test_admission_wait_timeouts_refused(value):
    arena = StagingArena(16, 10)
    with pytest.raises(ValueError, match="timeout"), Admission(arena, serial=threading.Lock()).admitted(value):
        pass
    with pytest.raises(ValueError, match="timeout"):
        Admission(arena).window(1, value)
    assert arena.live_bytes == 0


def test_largest_timeout_accepted_and_used():
    """threading.TIMEOUT_MAX itself is a valid timeout: a restore with it works (no overflow)."""
    tier = _tier()
    sp = store_random_prefix(REG, tier, 3, seed=3)
    cfg = RestoreConfig(window_chunks=1, fetch_timeout_s=threading.TIMEOUT_MAX,
                        admission_timeout_s=threading.TIMEOUT_MAX)
    with BoundedRestorer(REG, cfg, serial=threading.Lock()) as r:
        assert r.restore(fresh_request(sp, seed=4), tier, 3).ok


@pytest.mark.parametrize("value", BAD_BYTES)
def test_a_staging_arena_refuses_non_integer_sizes(value):
    with pytest.raises(ValueError, match="staging arena|chunk_bytes"):
        StagingArena(16, value)
    with pytest.raises(ValueError, match="chunk_bytes"):
        StagingArena(value, 1)


@pytest.mark.parametrize("value", [math.nan, math.inf, 1.5, -1, 0, True, "1"])
def test_window_reservations_are_whole_positive_chunk_counts(value):
    arena = StagingArena(16, 100)
    admission = Admission(arena)
    for op in (admission.window, admission.try_window):
        with pytest.raises(ValueError, match="window chunks"):
            op(value)
    assert arena.live_bytes == 0
    with pytest.raises(ValueError, match="exceed the staging budget"):
        admission.window(10**15)  # the bound holds


@pytest.mark.parametrize("value", [v for v in BAD_BYTES if v is not None])
def test_max_staging_bytes_refuses_nan_and_friends(value):
    with pytest.raises(ValueError, match="max_staging_bytes"):
        RestoreConfig(window_chunks=0, max_staging_bytes=value)


@pytest.mark.parametrize("kw", [dict(pipeline_depth=2.0), dict(pipeline_depth=True), dict(pipeline_depth=math.nan),
                                dict(window_chunks=2.0), dict(window_chunks=math.nan),
                                dict(backend=None)])
def test_other_config_knobs(kw):
    with pytest.raises(ValueError):
        RestoreConfig(**kw)


def test_whole_plan_cap_still_binds():
    """The whole-plan staging cap: an int cap that is too small refuses the plan (fail closed)."""
    tier = _tier()
    sp = store_random_prefix(REG, tier, 3, seed=5)
    with BoundedRestorer(REG, RestoreConfig(window_chunks=0, max_staging_bytes=REG.chunk_bytes)) as r:
        rep = r.restore(fresh_request(sp, seed=6), tier, 3)
    assert not rep.ok and "StagingCapacityError" in rep.error


# -- entry-point inputs ---------------------------------------------------------------------------

@pytest.fixture
def conn_setup():
    tier = _tier()
    sp = store_random_prefix(REG, tier, 4, seed=11)
    conn = StandaloneConnector(REG, [tier], config=RestoreConfig(window_chunks=2))
    yield conn, sp
    conn.close()


@pytest.mark.parametrize("computed", [-100, -1, 1.5, math.nan, "0", None, True])
def test_num_computed_tokens_validated(conn_setup, computed):
    conn, sp = conn_setup
    with pytest.raises(ValueError, match="num_computed_tokens"):
        conn.get_num_new_matched_tokens(ConnectorRequest("r", sp.tokens), computed)
    assert conn.get_num_new_matched_tokens(ConnectorRequest("r", sp.tokens), 0)[0] == 3 * REG.chunk_tokens


@pytest.mark.parametrize("mutate", [
    lambda toks: [t + 0.9 for t in toks],
    lambda toks: toks[:5] + [float(toks[5])] + toks[6:],
    lambda toks: toks[:5] + [True] + toks[6:],
    lambda toks: [0, 1] + toks[2:-1] + [False],  # ids 0 and 1 beside a bool that packs as 0
    lambda toks: toks[:5] + ["7"] + toks[6:],
    lambda toks: toks[:5] + [1 << 64] + toks[6:],
    lambda toks: toks[:5] + [None] + toks[6:],
    lambda toks: torch.tensor(toks, dtype=torch.float32),
], ids=["all_float", "one_float", "bool", "last_false", "str", "beyond_int64", "none", "float_tensor"])
def test_token_ids_must_be_integers(conn_setup, mutate):
    conn, sp = conn_setup
    bad = mutate(list(sp.tokens))
    with pytest.raises(ValueError, match="token id"):
        conn.get_num_new_matched_tokens(ConnectorRequest("r", bad), 0)
    with pytest.raises(ValueError, match="token id"):
        PrefixKeys(sp.keyspace, bad, REG.chunk_tokens).window(0, 1)


def test_integer_token_containers_accepted(conn_setup):
    conn, sp = conn_setup
    ref = PrefixKeys(sp.keyspace, sp.tokens, REG.chunk_tokens).window(0, 4)
    import numpy as np

    for toks in (torch.tensor(sp.tokens), np.asarray(sp.tokens, dtype=np.int32), tuple(sp.tokens),
                 [np.int64(t) for t in sp.tokens]):
        assert PrefixKeys(sp.keyspace, toks, REG.chunk_tokens).window(0, 4) == ref


def test_token_ids_pack_as_int64_and_ids_0_and_1_are_integers():
    """Token ids 0 and 1 (often BOS/EOS) are ids, not bools; the packed bytes are numpy's int64 of the ids."""
    import numpy as np

    from bsr_runtime.validation import token_id_bytes

    toks = [1, 0, 5, 1, -3, (1 << 63) - 1, 0]
    assert bytes(token_id_bytes(toks)) == np.asarray(toks, dtype=np.int64).tobytes()
    assert bytes(token_id_bytes(torch.tensor(toks))) == np.asarray(toks, dtype=np.int64).tobytes()
    with pytest.raises(ValueError, match="token id.*False.*position 1"):
        token_id_bytes([1, False, 0])


@pytest.mark.parametrize("n", [2.5, 2.0, math.nan, -1, "2", True])
def test_num_chunks_validated(n):
    tier = _tier()
    sp = store_random_prefix(REG, tier, 3, seed=21)
    with BoundedRestorer(REG, RestoreConfig(window_chunks=2)) as r:
        with pytest.raises(ValueError, match="num_chunks"):
            r.restore(fresh_request(sp, seed=22), tier, n)
        assert r.staging.live_bytes == 0
    with Retriever(REG, [tier], RestoreConfig(window_chunks=2)) as ret:
        with pytest.raises(ValueError, match="num_chunks"):
            ret.retrieve(fresh_request(sp, seed=23), n)
    with pytest.raises(ValueError, match="num_chunks|outside"):
        PrefixKeys(sp.keyspace, sp.tokens, REG.chunk_tokens).window(0, n)


@pytest.mark.parametrize("salt", ["\ud800", "a\udfffb", b"bytes", 5, None])
def test_salt_must_be_text(salt):
    with pytest.raises(ValueError, match="salt"):
        KeySpace(REG.fingerprint, salt=salt)
    with pytest.raises(ValueError, match="salt"):
        StandaloneConnector(REG, [_tier()], salt=salt)


@pytest.mark.parametrize("kw", [dict(tp_rank=0.0), dict(tp_world=1.5), dict(tp_rank=True, tp_world=2),
                                dict(tp_world=0), dict(tp_rank=-1)])
def test_tp_geometry_is_integers(kw):
    with pytest.raises(ValueError, match="tp_"):
        KeySpace(REG.fingerprint, **kw)


def test_unicode_salt_works():
    a, b = KeySpace(REG.fingerprint, salt="tenant-é-😀"), KeySpace(REG.fingerprint, salt="tenant-e")
    assert a.key(b"\0" * 16) != b.key(b"\0" * 16)


@pytest.mark.parametrize("kw,match", [
    (dict(window_chunks=math.nan), "store window"), (dict(window_chunks=2.5), "store window"),
    (dict(window_chunks=0), "store window"), (dict(window_chunks=True), "store window"),
    (dict(num_chunks=2.5), "num_chunks"), (dict(num_chunks=-1), "num_chunks"), (dict(num_chunks=4), "num_chunks"),
])
def test_store_knobs_validated(kw, match):
    """store_prefix: W and the chunk count are integers in range, checked before any byte is put."""
    from bsr_harness.experiments import make_source
    from bsr_runtime.store import store_prefix

    src = make_source(REG, 3, seed=31)
    tier = _tier()
    with pytest.raises(ValueError, match=match):
        store_prefix(REG, tier, src.keyspace, src.tokens, src.kv, src.block_tables, **kw)
    assert len(tier) == 0  # nothing was put


@pytest.mark.parametrize("value", [2.5, math.nan, "3", None])
def test_plan_and_alloc_counts_validated(conn_setup, value):
    conn, sp = conn_setup
    req = ConnectorRequest("r", sp.tokens)
    if value is not None:
        with pytest.raises(ValueError, match="max_chunks"):
            conn.retriever.plan(sp.tokens, sp.keyspace, value)
    tokens, _ = conn.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ValueError, match="num_external_tokens"):
        conn.update_state_after_alloc(req, [[0] * 64], value)


# -- chunk-strided staging: every malformed 2-D staging is refused before any byte moves ------------

def _strided(rows: int, stride: int, offset: int, width: int | None = None, step: int = 1) -> torch.Tensor:
    """(rows, width) uint8 at `offset` of a random buffer, rows `stride` bytes apart, columns `step` apart."""
    width = REG.chunk_bytes if width is None else width
    buf = torch.randint(0, 256, (offset + rows * stride + width * step,), dtype=torch.uint8)
    return buf.as_strided((rows, width), (stride, step), offset)


_CB = REG.chunk_bytes
BAD_STAGING = {  # name: (staging for a 2-chunk window, message)
    "stride(1) != 1": (lambda: _strided(2, 2 * _CB + 128, 128, step=2), r"stride\(1\) == 1"),
    "stride(0) < chunk_bytes": (lambda: _strided(2, _CB - 16, 128), "less than chunk_bytes"),
    "stride(0) not a multiple of 16": (lambda: _strided(2, _CB + 136, 128), "not a multiple of 16"),
    "shape[1] != chunk_bytes": (lambda: _strided(2, _CB + 128, 128, width=_CB - 16), "one row of chunk_bytes"),
    "shape[1] > chunk_bytes": (lambda: _strided(2, _CB + 128, 128, width=_CB + 16), "one row of chunk_bytes"),
    "too few rows": (lambda: _strided(1, _CB + 128, 128), "too small: 1 rows"),
    "misaligned": (lambda: _strided(2, _CB + 128, 136), "misaligned"),
    "2-D int16": (lambda: _strided(2, _CB + 128, 128).view(torch.int16), "1-D uint8 tensor, or 2-D uint8"),
    "3-D": (lambda: _strided(2, _CB + 128, 128).unsqueeze(0), "1-D uint8 tensor, or 2-D uint8"),
    "1-D not contiguous": (lambda: torch.zeros(4 * _CB, dtype=torch.uint8)[::2], "not contiguous"),
}


@pytest.mark.parametrize("entry", ["install_window", "gather_window", "WindowInstaller.install",
                                   "WindowInstaller.gather"])
@pytest.mark.parametrize("name", sorted(BAD_STAGING))
def test_malformed_staging_refused_before_any_byte_moves(name, entry):
    from bsr_kernels import WindowInstaller, gather_window, install_window

    make, match = BAD_STAGING[name]
    staging = make()
    gen = torch.Generator().manual_seed(1)
    tables = [torch.randperm(REG.blocks_needed(0, 2 * REG.chunk_tokens), generator=gen)]
    kv = REG.allocate([tables[0].numel()])
    for t in kv:
        t.view(torch.uint8).fill_(0xA5)
    kv_before = [t.clone() for t in kv]
    whole = torch.empty(0, dtype=torch.uint8).set_(staging.untyped_storage())  # the buffer, gaps included
    before = whole.clone()
    with pytest.raises(ValueError, match=match):
        if entry == "install_window":
            install_window(staging, REG, kv, tables, 0, 2, backend="auto")
        elif entry == "gather_window":
            gather_window(staging, REG, kv, tables, 0, 2, backend="auto")
        else:
            inst = WindowInstaller(REG, kv, tables, 2)
            (inst.install if entry.endswith("install") else inst.gather)(staging, 0, 2)
    assert torch.equal(whole, before), "the staging changed"
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(kv, kv_before))


def test_strided_staging_accepted():
    """The forms a staging pool hands out: `buf.view(n, stride)[:, headroom:]`, the same made with
    as_strided, a tail gap after each chunk, and more rows than the window."""
    from bsr_kernels.validate import check_staging

    n, h = 3, 128
    buf = torch.zeros(n * (_CB + h), dtype=torch.uint8)
    assert check_staging(buf.view(n, _CB + h)[:, h:], REG, n) == _CB + h
    assert check_staging(buf.as_strided((n, _CB), (_CB + h, 1), h), REG, n) == _CB + h
    assert check_staging(buf.view(n, _CB + h)[:, 16 : 16 + _CB], REG, 2) == _CB + h  # tail gap, extra row
    assert check_staging(buf[: n * _CB].view(n, _CB), REG, n) == _CB  # 2-D without gaps
    assert check_staging(buf, REG, n) == _CB  # 1-D
