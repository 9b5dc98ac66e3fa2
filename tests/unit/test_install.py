"""install_window / gather_window: every backend on this machine against the references.

The torch backend is checked against an entry-by-entry oracle (kernel_util.naive_install);
every other backend is checked against the torch backend. Destinations are poisoned first;
blocks and slots outside the window must stay poisoned.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_util import (
    POISON,
    Case,
    assert_same,
    make_case,
    naive_install,
    poisoned,
    random_kv,
    registrations,
    snapshot,
    untouched_outside_window,
)

from bsr_kernels import gather_window, install_window, presets
from bsr_kernels.install import available_backends

BACKENDS = available_backends("cpu")
OTHER_BACKENDS = [b for b in BACKENDS if b != "torch"]


def test_triton_backend_is_exercised_when_interpreter_is_on():
    # CI runs with TRITON_INTERPRET=1: the Triton backend must not be silently absent there.
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert "triton" in BACKENDS


def _installed(case: Case, backend: str) -> list[torch.Tensor]:
    kv = poisoned(case.reg, case.num_blocks)
    used = install_window(case.staging, case.reg, kv, case.tables, case.first_chunk, case.num_chunks,
                          backend=backend)
    assert used == backend
    return kv


def _oracle(case: Case) -> list[torch.Tensor]:
    kv = poisoned(case.reg, case.num_blocks)
    naive_install(case, kv)
    return kv


PRESETS = {
    "dsv4": lambda: presets.dsv4_flash(scale=1 / 64),
    "dsv4-mtp": lambda: presets.dsv4_flash(mtp=True, scale=1 / 64),
    "llama": lambda: presets.llama_like(layers=3, kv_heads=2, head_dim=24, block_size=16),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("first_chunk,num_chunks", [(0, 1), (1, 2), (3, 1)])
def test_torch_backend_matches_oracle_on_presets(preset, first_chunk, num_chunks):
    case = make_case(PRESETS[preset](), first_chunk, num_chunks, seed=first_chunk * 7 + num_chunks)
    kv = _installed(case, "torch")
    assert_same(kv, _oracle(case), case.reg, f"{preset} torch vs oracle")
    untouched_outside_window(case, kv)


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_backends_match_torch_on_presets(backend, preset):
    case = make_case(PRESETS[preset](), first_chunk=2, num_chunks=2, seed=11)
    kv = _installed(case, backend)
    assert_same(kv, _installed(case, "torch"), case.reg, f"{preset} {backend} vs torch")
    untouched_outside_window(case, kv)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registrations(), first_chunk=st.integers(0, 3), num_chunks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_torch_backend_matches_oracle_random(reg, first_chunk, num_chunks, seed):
    case = make_case(reg, first_chunk, num_chunks, seed)
    kv = _installed(case, "torch")
    assert_same(kv, _oracle(case), reg, "torch vs oracle")
    untouched_outside_window(case, kv)


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registrations(), first_chunk=st.integers(0, 3), num_chunks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_backends_match_torch_random(backend, reg, first_chunk, num_chunks, seed):
    case = make_case(reg, first_chunk, num_chunks, seed)
    kv = _installed(case, backend)
    assert_same(kv, _installed(case, "torch"), reg, f"{backend} vs torch")
    untouched_outside_window(case, kv)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registrations(), first_chunk=st.integers(0, 3), num_chunks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gather_then_install_round_trips(backend, reg, first_chunk, num_chunks, seed):
    case = make_case(reg, first_chunk, num_chunks, seed)
    src = random_kv(reg, case.num_blocks, seed + 1)
    out = torch.full((num_chunks * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    assert gather_window(out, reg, src, case.tables, first_chunk, num_chunks, backend=backend) == backend
    # gather agrees with the torch gather byte for byte (padding and -1 entries zeroed)
    ref = torch.full_like(out, POISON)
    gather_window(ref, reg, src, case.tables, first_chunk, num_chunks, backend="torch")
    assert torch.equal(out, ref)
    dst = poisoned(reg, case.num_blocks)
    install_window(out, reg, dst, case.tables, first_chunk, num_chunks, backend=backend)
    # every resident entry of the window is back; everything else still poisoned
    expect = poisoned(reg, case.num_blocks)
    naive_install(Case(reg, case.num_blocks, case.tables, first_chunk, num_chunks, out), expect)
    assert_same(dst, expect, reg, f"{backend} round trip")
    for i, spec in enumerate(reg.specs):
        table = case.tables[spec.group]
        tpb = spec.tokens_per_block
        lo = first_chunk * reg.chunk_tokens // tpb
        hi = -(-(first_chunk + num_chunks) * reg.chunk_tokens // tpb)
        blocks = table[lo:hi]
        full = blocks[1:-1] if blocks.numel() > 2 else blocks[:0]  # edge blocks may be partly outside
        full = full[full >= 0]
        if full.numel():
            assert torch.equal(dst[i][full].view(torch.uint8), src[i][full].view(torch.uint8))


def test_gather_zeroes_padding_and_holes():
    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 0, 1, seed=5, hole_frac=0.0)
    case.tables[0][:] = -1  # the whole sliding-window group is non-resident
    src = random_kv(reg, case.num_blocks, 9)
    out = torch.full((reg.chunk_bytes,), POISON, dtype=torch.uint8)
    gather_window(out, reg, src, case.tables, 0, 1, backend="torch")
    for i, spec in enumerate(reg.specs):
        off, n = reg.segment_offsets[i], reg.segment_bytes(i)
        seg = out[off : off + n]
        if spec.group == 0:
            assert bool((seg == 0).all())
        else:
            assert bool((seg != 0).any())
        nxt = reg.segment_offsets[i + 1] if i + 1 < reg.num_tensors else reg.chunk_bytes
        assert bool((out[off + n : nxt] == 0).all())


# -- bad input: a clear ValueError before any byte moves ------------------------------------

def _bad_case():
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 2, seed=3)
    return reg, case, poisoned(reg, case.num_blocks)


def _expect_error(match, mutate, backend="torch"):
    reg, case, kv = _bad_case()
    args = dict(staging=case.staging, reg=reg, kv=kv, block_tables=case.tables,
                first_chunk=0, num_chunks=2)
    mutate(args, reg, case)
    before = snapshot([t for t in kv])
    with pytest.raises(ValueError, match=match):
        install_window(args["staging"], args["reg"], args["kv"], args["block_tables"], args["first_chunk"],
                       args["num_chunks"], backend=backend, **args.get("extra", {}))
    assert_same(kv, before, reg, "destinations after a rejected call")


def _set(**kw):
    def mutate(args, reg, case):
        args.update(kw)
    return mutate


BAD_INPUTS = {
    "wrong dtype": (r"layers\.0\.k_cache.*dtype", lambda a, r, c: a["kv"].__setitem__(
        0, torch.zeros(a["kv"][0].shape, dtype=torch.float32))),
    "wrong shape": (r"layers\.1\.v_cache.*shape", lambda a, r, c: a["kv"].__setitem__(
        3, torch.zeros((a["kv"][3].shape[0], 8, 1, 8), dtype=a["kv"][3].dtype))),
    "innermost not contiguous": (r"innermost stride is 2", lambda a, r, c: a["kv"].__setitem__(
        1, torch.zeros((a["kv"][1].shape[0], 16, 1, 16), dtype=torch.bfloat16)[..., ::2])),
    "aliased destinations": (r"'layers\.0\.k_cache' and 'layers\.0\.v_cache' overlap",
                             lambda a, r, c: a["kv"].__setitem__(1, a["kv"][0])),
    "-1 without sliding window": (r"block id -1", lambda a, r, c: c.tables[0].__setitem__(2, -1)),
    "missing tensor": (r"expected 4 destination tensors", lambda a, r, c: a.update(kv=a["kv"][:3])),
    "staging too small": (r"staging too small", lambda a, r, c: a.update(staging=c.staging[:-16])),
    "staging misaligned": (r"misaligned", lambda a, r, c: a.update(
        staging=torch.zeros(c.staging.numel() + 16, dtype=torch.uint8)[1 : 1 + c.staging.numel()])),
    "staging wrong dtype": (r"1-D uint8", lambda a, r, c: a.update(staging=c.staging.view(torch.int16))),
    "block id out of range": (r"block id 999 out of range", lambda a, r, c: c.tables[0].__setitem__(1, 999)),
    "block id below -1": (r"block id -2 out of range", lambda a, r, c: c.tables[0].__setitem__(0, -2)),
    "duplicated block ids": (r"duplicated block ids", lambda a, r, c: c.tables[0][:2].fill_(0)),
    "chunk range past the table": (r"too short", lambda a, r, c: a.update(first_chunk=1)),
    "negative chunk": (r"first_chunk must be", _set(first_chunk=-1)),
    "float table": (r"must hold integers", lambda a, r, c: a.update(block_tables=[c.tables[0].float()])),
    "fingerprint mismatch": (r"fingerprint mismatch", _set(extra={"fingerprint": "0" * 32})),
    "unknown backend": (r"unknown backend", lambda a, r, c: None),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_rejected_before_any_byte_moves(name):
    match, mutate = BAD_INPUTS[name]
    _expect_error(match, mutate, backend="nope" if name == "unknown backend" else "torch")


def test_wrong_device_rejected():
    reg, case, kv = _bad_case()
    kv[2] = torch.empty(kv[2].shape, dtype=kv[2].dtype, device="meta")
    with pytest.raises(ValueError, match=r"layers\.1\.k_cache.*on meta"):
        install_window(case.staging, reg, kv, case.tables, 0, 2)


def test_unavailable_backend_is_a_clear_error():
    reg, case, kv = _bad_case()
    with pytest.raises(ValueError, match="not available"):
        install_window(case.staging, reg, kv, case.tables, 0, 2, backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_installer_matches_install_window(backend):
    from bsr_kernels import WindowInstaller

    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, first_chunk=0, num_chunks=5, seed=17)
    expect = _oracle(case)
    kv = poisoned(reg, case.num_blocks)
    installer = WindowInstaller(reg, kv, case.tables, 5, backend=backend)
    saved = [t.clone() for t in case.tables]
    for t in case.tables:  # the installer validated and copied the tables: later edits do not leak in
        t.fill_(0)
    c = reg.chunk_bytes
    for first, n in [(0, 2), (2, 2), (4, 1)]:
        assert installer.install(case.staging[first * c : (first + n) * c].clone(), first, n) == backend
    case.tables[:] = saved
    assert_same(kv, expect, reg, f"{backend} WindowInstaller vs oracle")
    with pytest.raises(ValueError, match="outside the 5 chunks"):
        installer.install(case.staging, 4, 2)
    with pytest.raises(ValueError, match="staging too small"):
        installer.install(case.staging[:c], 0, 2)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton backend not available here")
@pytest.mark.parametrize("tile", [64, 256])
def test_triton_grid_is_total_work(monkeypatch, tile):
    """Small tiles: tensors get different tile counts, every program finds its tensor by the
    binary search over the prefix sums, and the grid is the sum of the tiles."""
    from bsr_kernels import triton_backend

    monkeypatch.setattr(triton_backend, "_INTERP_TILE_BYTES", (tile, tile))
    reg = presets.dsv4_flash(scale=1 / 64)
    reg = type(reg)(reg.specs[:12], name="dsv4-head")  # three groups, 8..256 B entries, ratios 1/4/128
    case = make_case(reg, 1, 2, seed=4)
    kv = _installed(case, "triton")
    assert_same(kv, _oracle(case), reg, f"triton tile {tile} vs oracle")
    starts = triton_backend._tile_starts(reg, 2, tile, torch.device("cpu"))
    assert starts.total == sum(-(-2 * reg.segment_bytes(i) // tile) for i in range(reg.num_tensors))


def test_block_table_pointers_are_reused_across_windows():
    """WindowInstaller keeps its own copy of the tables; their pointer table is built once."""
    from bsr_kernels import WindowInstaller
    from bsr_kernels.descriptors import block_table_pointers

    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=8)
    case = make_case(reg, 0, 2, seed=1)
    inst = WindowInstaller(reg, poisoned(reg, case.num_blocks), case.tables, 2, backend="torch")
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(inst.block_tables, case.tables))
    first, _ = block_table_pointers(inst.block_tables, torch.device("cpu"))
    again, moved = block_table_pointers(inst.block_tables, torch.device("cpu"))
    assert again is first and all(m is t for m, t in zip(moved, inst.block_tables))
    assert first.tolist() == [t.data_ptr() for t in inst.block_tables]


def test_block_table_pointers_follow_a_table_replaced_in_the_same_list():
    """The last call's answer is reused only for the very tables it was built from: a table replaced in the
    same (mutable) list, or tables on another device, get their own pointers."""
    from bsr_kernels.descriptors import block_table_pointers

    cpu = torch.device("cpu")
    tables = [torch.arange(4, dtype=torch.int32), torch.arange(6, dtype=torch.int32)]
    first, _ = block_table_pointers(tables, cpu)
    assert block_table_pointers(tables, cpu)[0] is first
    tables[1] = torch.arange(6, dtype=torch.int32) + 1  # a new tensor at a new address, same list
    again, moved = block_table_pointers(tables, cpu)
    assert again.tolist() == [t.data_ptr() for t in tables] != first.tolist()
    assert moved[1] is tables[1]
    strided = [torch.arange(8, dtype=torch.int32)[::2]]  # not contiguous: copied, so never answered in place
    a, kept = block_table_pointers(strided, cpu)
    assert kept[0] is not strided[0] and a.tolist() == [kept[0].data_ptr()]


def test_a_backend_registered_in_one_place_runs_everywhere_a_backend_name_goes():
    """A toy backend (the cpu library's window call under another name, counting its windows), registered once
    (backends.register_backend): install_window and WindowInstaller run it against the independent oracle,
    "auto" never picks it, the restore's and the connector's configs accept its name; unregistered, it is unknown."""
    from bsr_kernels import backends
    from bsr_runtime.config_schema import Backend as BackendName
    from bsr_runtime.config_schema import ConfigError, Schema, parse
    from bsr_runtime.restore import RestoreConfig

    cpu = backends.get_backend("cpu")
    if not cpu.available(torch.device("cpu")):
        pytest.skip("the native cpu library is not built here")
    windows = []

    def run(kind, reg, state, a, options):
        windows.append((kind, a.first_chunk, a.num_chunks))
        cpu.run(kind, reg, state, a, options)

    class WithBackend(Schema):
        backend: BackendName

    backends.register_backend(backends.InstallBackend("toy", cpu.available, cpu.prepare, run))
    try:
        case = make_case(PRESETS["dsv4"](), first_chunk=1, num_chunks=2, seed=5)
        kv = _installed(case, "toy")
        assert windows == [("install", 1, 2)]
        assert_same(kv, _oracle(case), case.reg, "toy vs oracle")
        untouched_outside_window(case, kv)
        assert "toy" in available_backends("cpu") and backends.resolve_backend("auto", torch.device("cpu")) == "cpu"
        assert RestoreConfig(backend="toy").backend == "toy" and parse(WithBackend, {"backend": "toy"}, "x")
    finally:
        backends.unregister_backend("toy")
    with pytest.raises(ValueError, match="unknown backend 'toy'"):
        _installed(case, "toy")
    with pytest.raises(ValueError, match="backend must be one of"):
        RestoreConfig(backend="toy")
    with pytest.raises(ConfigError, match="backend"):
        parse(WithBackend, {"backend": "toy"}, "x")
