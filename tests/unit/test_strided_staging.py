"""Chunk-strided staging: chunk c of the window at headroom + c * chunk_stride of a larger buffer
(a staging pool leaves scratch before each chunk for an object header), handed to the installer
as a 2-D (num_chunks, chunk_bytes) view with strides (chunk_stride, 1).

Every backend here (torch, cpu, Triton under TRITON_INTERPRET=1, and "cuda-host": the CUDA
library's host emulation of its kernels, built from csrc/ with nvcc when there is one) against
the independent entry-by-entry oracle (kernel_util.naive_install / naive_gather), on fresh random
data: destinations poisoned first, blocks outside the window still poisoned after, and the gap
bytes between chunks (random, saved before) byte for byte unchanged after install and after
gather. Headrooms 16 and 128, a tail gap after each chunk, a gap-less 2-D view, and the same
view made with as_strided.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_util import (
    KV_LAYOUTS,
    POISON,
    STRIDES,
    Case,
    assert_same,
    kv_pair_layout,
    kv_registration,
    make_case,
    mla_layout,
    mla_registration,
    naive_gather,
    naive_install,
    poisoned,
    random_bytes,
    random_kv,
    registrations,
    same_bytes,
    snapshot,
    strided_like,
    strided_staging,
    untouched_outside_window,
)

from bsr_kernels import WindowInstaller, cuda_backend, gather_window, install_window, presets
from bsr_kernels.install import available_backends
from bsr_kernels.registration import Registration, TensorSpec
from bsr_kernels.validate import WindowArgs, check_window

BACKENDS = available_backends("cpu")
ALL_BACKENDS = [*BACKENDS, "cuda-host"]
STRIDE_IDS = sorted(STRIDES)



def padded_registration() -> Registration:
    """Segments that do not fill their 16-byte alignment: gather zeroes padding inside each chunk
    (and must stop at chunk_bytes, before the gap)."""
    specs = (TensorSpec("a", torch.uint8, (20,), 2, 128, 0, 128),  # 2 entries, 40 B: 8 B padding
             TensorSpec("b", torch.float16, (2, 3), 16, 4, 1, None),  # 64 entries of 12 B
             TensorSpec("c", torch.float32, (33,), 2, 128, 0, 128),  # 2 entries of 132 B: 8 B padding
             TensorSpec("d", torch.uint8, (7,), 4, 64, 2, None))  # 4 entries, 28 B: 4 B padding (chunk tail)
    return Registration(specs, name="padded")


PRESETS = {
    "dsv4": lambda: presets.dsv4_flash(scale=1 / 64),
    "llama": lambda: presets.llama_like(layers=3, kv_heads=2, head_dim=24, block_size=16),
    "padded": padded_registration,
}


@pytest.fixture(scope="module")
def cuda_lib(request):
    """The CUDA library built from csrc/ (its host emulation runs on CPU tensors) by the run's
    first-use build (conftest: cuda_first_use_build); without nvcc, the installed one."""
    if cuda_backend.find_nvcc() is None:
        lib = cuda_backend.library()
        if lib is None:
            pytest.skip(f"no nvcc and no CUDA library: {cuda_backend.load_error()}")
        return lib
    path, _, _ = request.getfixturevalue("cuda_first_use_build")
    return cuda_backend.load(path)


class Runner:
    """install / gather of one window with one backend (cuda-host: the library's host emulation)."""

    def __init__(self, backend: str, request) -> None:
        self.backend = backend
        self.lib = request.getfixturevalue("cuda_lib") if backend == "cuda-host" else None

    def install(self, staging, reg: Registration, kv, tables, first: int, num: int) -> None:
        if self.lib is not None:
            cuda_backend.host_install(reg, check_window(staging, reg, kv, tables, first, num), self.lib)
        else:
            assert install_window(staging, reg, kv, tables, first, num, backend=self.backend) == self.backend

    def gather(self, out, reg: Registration, kv, tables, first: int, num: int) -> None:
        if self.lib is not None:
            args = check_window(out, reg, kv, tables, first, num, staging_name="out")
            cuda_backend.host_gather(reg, args, self.lib)
        else:
            assert gather_window(out, reg, kv, tables, first, num, backend=self.backend) == self.backend


@pytest.fixture(params=ALL_BACKENDS)
def runner(request) -> Runner:
    return Runner(request.param, request)


# Triton takes dsv4 at one stride (headroom and a tail gap), the small presets at every stride: the
# interpreter runs one Python program per tensor (167 for dsv4), and the stride only moves where each
# chunk starts (the kernel's copy unit comes from the destinations; strides are multiples of 16).
TRITON_DSV4_STRIDE = "h128-tail48"


def backend_preset_stride(preset_names: list[str]) -> list[tuple[str, str, str]]:
    return [(b, p, s) for b in ALL_BACKENDS for p in preset_names for s in STRIDE_IDS
            if not (b == "triton" and p == "dsv4" and s != TRITON_DSV4_STRIDE)]


def _oracle(case: Case) -> list[torch.Tensor]:
    kv = poisoned(case.reg, case.num_blocks)
    naive_install(case, kv)
    return kv


@functools.cache
def _install_case(preset: str, stride: str) -> tuple[Case, list[torch.Tensor]]:
    """The case and its oracle, once per preset and stride (the oracle is Python, seconds for dsv4);
    every backend installs the same case against it. Read-only for the tests."""
    case = make_case(PRESETS[preset](), first_chunk=2, num_chunks=2, seed=len(stride) + len(preset))
    return case, _oracle(case)


@functools.cache
def _gather_case(preset: str, stride: str) -> tuple[Case, list[torch.Tensor], torch.Tensor]:
    """The case, its source blocks and the oracle's gather, once per preset and stride."""
    case = make_case(PRESETS[preset](), first_chunk=1, num_chunks=2, seed=7 + len(stride))
    src = random_kv(case.reg, case.num_blocks, seed=len(preset))
    return case, src, naive_gather(case, src).view(case.num_chunks, case.reg.chunk_bytes)


def _staging(case: Case, stride_id: str, seed: int, **kw):
    headroom, tail = STRIDES[stride_id]
    gen = torch.Generator().manual_seed(seed)
    # one row more than the window: rows past num_chunks are not the window's
    return strided_staging(case.reg, case.num_chunks + 1, headroom, tail, gen, **kw)


# -- install ---------------------------------------------------------------------------------
@pytest.mark.parametrize("runner, preset, stride", backend_preset_stride(sorted(PRESETS)), indirect=["runner"])
def test_install_matches_oracle(runner, preset, stride):
    case, want = _install_case(preset, stride)
    st_ = _staging(case, stride, seed=3, chunks=case.staging)
    before = st_.buf.clone()
    kv = poisoned(case.reg, case.num_blocks)
    runner.install(st_.view, case.reg, kv, case.tables, case.first_chunk, case.num_chunks)
    assert_same(kv, want, case.reg, f"{preset} {runner.backend} {stride} vs oracle")
    untouched_outside_window(case, kv)
    assert st_.gaps_unchanged(), "install wrote a gap between chunks"
    assert torch.equal(st_.buf, before), "install wrote the staging"


def test_install_reads_no_gap_byte(runner):
    """Gap bytes of the value a wrong offset would pick up are never installed: the gaps hold
    bytes that differ from every chunk byte, rows in a window of three chunks."""
    reg = kv_registration(layers=2, heads=2, head_dim=8, block_size=16, window=None)
    case = make_case(reg, 0, 3, seed=21)
    case.staging[case.staging == 0x11] = 0x12
    st_ = _staging(case, "h128-tail48", seed=4, chunks=case.staging)
    st_.buf[~st_.rows] = 0x11
    kv = poisoned(reg, case.num_blocks)
    runner.install(st_.view, reg, kv, case.tables, 0, 3)
    assert_same(kv, _oracle(case), reg, f"{runner.backend} vs oracle")
    for t in kv:
        assert not bool((t.view(torch.uint8) == 0x11).any()), "a gap byte was installed"


@pytest.mark.parametrize("as_strided", [False, True], ids=["sliced", "as_strided"])
def test_install_as_strided_view(runner, as_strided):
    case = make_case(PRESETS["llama"](), first_chunk=1, num_chunks=3, seed=8)
    st_ = _staging(case, "h128", seed=5, chunks=case.staging, as_strided=as_strided)
    kv = poisoned(case.reg, case.num_blocks)
    runner.install(st_.view, case.reg, kv, case.tables, 1, 3)
    assert_same(kv, _oracle(case), case.reg, f"{runner.backend} as_strided={as_strided}")
    assert st_.gaps_unchanged()


# -- gather ----------------------------------------------------------------------------------
@pytest.mark.parametrize("runner, preset, stride", backend_preset_stride(sorted(PRESETS)), indirect=["runner"])
def test_gather_matches_oracle(runner, preset, stride):
    case, src, expect = _gather_case(preset, stride)
    src_before = snapshot(src)
    out = _staging(case, stride, seed=6, fill=POISON)
    runner.gather(out.view, case.reg, src, case.tables, case.first_chunk, case.num_chunks)
    n = case.num_chunks
    got = out.view[:n]
    if not torch.equal(got, expect):
        idx = (got != expect).nonzero()[0].tolist()
        raise AssertionError(f"{runner.backend} {stride}: gather differs at chunk {idx[0]}, byte {idx[1]}")
    assert bool((out.view[n:] == POISON).all()), "gather wrote a row past the window"
    assert out.gaps_unchanged(), "gather wrote a gap between chunks"
    assert_same(src, src_before, case.reg, "gather wrote the destinations")


def test_gather_holes_and_padding_are_zero_inside_rows_only(runner):
    """A non-resident group gathers as zeros and segment padding is zeroed, inside the rows:
    the gaps keep their bytes."""
    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 0, 2, seed=5, hole_frac=0.0)
    case.tables[0][:] = -1  # the sliding-window group is wholly non-resident
    src = random_kv(reg, case.num_blocks, 9)
    out = _staging(case, "h16", seed=2, fill=POISON)
    runner.gather(out.view, reg, src, case.tables, 0, 2)
    for c in range(2):
        row = out.view[c]
        for i, spec in enumerate(reg.specs):
            off, nbytes = reg.segment_offsets[i], reg.segment_bytes(i)
            nxt = reg.segment_offsets[i + 1] if i + 1 < reg.num_tensors else reg.chunk_bytes
            if spec.group == 0:
                assert bool((row[off : off + nbytes] == 0).all())
            assert bool((row[off + nbytes : nxt] == 0).all())
    assert torch.equal(out.view[:2], naive_gather(case, src).view(2, -1))
    assert out.gaps_unchanged()


# -- gather -> install round trip through strided staging --------------------------------------
def _round_trip_oracle(reg: Registration, first: int, num: int, seed: int):
    """The case, its source blocks, the oracle's gather of them and the oracle's install of that."""
    case = make_case(reg, first, num, seed)
    src = random_kv(reg, case.num_blocks, seed + 1)
    gathered = naive_gather(case, src)
    expect = poisoned(reg, case.num_blocks)
    naive_install(Case(reg, case.num_blocks, case.tables, first, num, gathered), expect)
    return case, src, gathered, expect


@functools.cache
def _preset_round_trip_oracle(preset: str):
    """Once per preset (the oracle is Python, seconds for dsv4); read-only for the tests."""
    return _round_trip_oracle(PRESETS[preset](), 2, 2, seed=31)


def _round_trip(runner: Runner, stride: str, oracle) -> None:
    case, src, want_gathered, expect = oracle
    reg, first, num = case.reg, case.first_chunk, case.num_chunks
    out = _staging(case, stride, seed=33, fill=POISON)
    runner.gather(out.view, reg, src, case.tables, first, num)
    gathered = out.view[:num].reshape(-1).clone()
    assert torch.equal(gathered, want_gathered), f"{runner.backend} {stride}: gather vs oracle"
    assert out.gaps_unchanged(), "gather wrote a gap"
    dst = poisoned(reg, case.num_blocks)
    runner.install(out.view, reg, dst, case.tables, first, num)
    assert out.gaps_unchanged(), "install wrote a gap"
    assert torch.equal(out.view[:num].reshape(-1), gathered), "install wrote the staging"
    assert_same(dst, expect, reg, f"{runner.backend} {stride} round trip")
    untouched_outside_window(case, dst)


@pytest.mark.parametrize("runner, preset, stride", backend_preset_stride(["dsv4", "padded"]), indirect=["runner"])
def test_round_trip_presets(runner, preset, stride):
    _round_trip(runner, stride, _preset_round_trip_oracle(preset))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(reg=registrations(max_tensors=4), first=st.integers(0, 3), num=st.integers(1, 3), seed=st.integers(0, 2**16),
       stride=st.sampled_from(STRIDE_IDS))
def test_round_trip_random_registrations(runner, reg, first, num, seed, stride):
    _round_trip(runner, stride, _round_trip_oracle(reg, first, num, seed))


# -- strided destinations too -----------------------------------------------------------------
def _layout(name: str):
    if name.startswith("mla"):
        reg = mla_registration()
        return reg, lambda nb: mla_layout(name, reg, nb)
    reg = kv_registration(layers=2, heads=3, head_dim=8, block_size=16)
    return reg, lambda nb: kv_pair_layout(name, reg, nb)


@pytest.mark.parametrize("layout", [*KV_LAYOUTS, "mla", "mla_sliced"])
def test_strided_destination_layouts(runner, layout):
    reg, alloc = _layout(layout)
    case = make_case(reg, 1, 2, seed=13, hole_frac=0.2)
    st_ = _staging(case, "h128-tail48", seed=1, chunks=case.staging)
    views, bufs = alloc(case.num_blocks[0])
    runner.install(st_.view, reg, views, case.tables, 1, 2)
    ev, expect = alloc(case.num_blocks[0])
    naive_install(case, ev)
    same_bytes(bufs, expect, f"{runner.backend} {layout} install")
    assert st_.gaps_unchanged()
    out = _staging(case, "h16", seed=2, fill=POISON)
    runner.gather(out.view, reg, views, case.tables, 1, 2)
    assert torch.equal(out.view[:2].reshape(-1), naive_gather(case, views))
    assert out.gaps_unchanged()


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(reg=registrations(max_tensors=4), first=st.integers(0, 2), num=st.integers(1, 2), seed=st.integers(0, 2**16),
       stride=st.sampled_from(STRIDE_IDS))
def test_random_strided_views(runner, reg, first, num, seed, stride):
    """Random registrations into random strided destination views (padded rows, slot-major,
    heads outside slots): the per-entry copy paths, not only whole block runs."""
    case = make_case(reg, first, num, seed)
    st_ = _staging(case, stride, seed=seed, chunks=case.staging)
    views, bufs = strided_like(reg, case.num_blocks, seed)
    runner.install(st_.view, reg, views, case.tables, first, num)
    ev, expect = strided_like(reg, case.num_blocks, seed)
    naive_install(case, ev)
    same_bytes(bufs, expect, f"{runner.backend} {stride} install")
    assert st_.gaps_unchanged()
    gen = torch.Generator().manual_seed(seed + 1)
    for b in bufs:
        flat = b.view(torch.uint8).view(-1)
        flat.copy_(random_bytes(flat.numel(), gen))
    out = _staging(case, stride, seed=seed + 2, fill=POISON)
    runner.gather(out.view, reg, views, case.tables, first, num)
    assert torch.equal(out.view[:num].reshape(-1), naive_gather(case, views))
    assert out.gaps_unchanged() and bool((out.view[num:] == POISON).all())


# -- WindowInstaller: windows of one restore, strided and 1-D mixed -----------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_installer_strided_windows(backend):
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=16, block_size=16)
    case = make_case(reg, 0, 5, seed=17)
    kv = poisoned(reg, case.num_blocks)
    inst = WindowInstaller(reg, kv, case.tables, 5, backend=backend)
    cb, gen = reg.chunk_bytes, torch.Generator().manual_seed(3)
    windows = [(0, 2, (128, 0)), (2, 2, None), (4, 1, (16, 32))]
    staged = []
    for first, n, shape in windows:
        chunks = case.staging[first * cb : (first + n) * cb]
        if shape is None:
            assert inst.install(chunks.clone(), first, n) == backend
            continue
        s = strided_staging(reg, n, *shape, gen, chunks=chunks)
        assert inst.install(s.view, first, n) == backend
        staged.append(s)
    assert_same(kv, _oracle(case), reg, f"{backend} WindowInstaller strided windows")
    assert all(s.gaps_unchanged() for s in staged)
    for first, n, shape in windows:
        out = strided_staging(reg, n + 1, *(shape or (128, 16)), gen, fill=POISON)
        assert inst.gather(out.view, first, n) == backend
        assert torch.equal(out.view[:n].reshape(-1), naive_gather(Case(reg, case.num_blocks, case.tables, first, n,
                                                                        case.staging), kv))
        assert bool((out.view[n:] == POISON).all()) and out.gaps_unchanged()


# -- the native libraries below validation: any chunk stride >= chunk_bytes ----------------------
@pytest.mark.parametrize("extra", [1, 4, 8, 24])
@pytest.mark.parametrize("kind", ["cpu", "cuda-host"])
def test_libraries_take_unaligned_strides(request, kind, extra):
    """Strides validation refuses (not a multiple of 16) still address every chunk right in the
    libraries (the CUDA kernels' access width then drops to what the stride allows)."""
    if kind == "cpu":
        from bsr_kernels import cpu_backend

        if not cpu_backend.available():
            pytest.skip(f"no CPU library: {cpu_backend.load_error()}")
    reg = kv_registration(layers=2, heads=2, head_dim=8, block_size=16)
    case = make_case(reg, 1, 3, seed=extra, hole_frac=0.2)
    cb, stride = reg.chunk_bytes, reg.chunk_bytes + extra
    buf = torch.full((3 * stride + 16,), 0x11, dtype=torch.uint8)
    staging = buf.as_strided((3, cb), (stride, 1), 16)
    staging.copy_(case.staging.view(3, cb))
    before = buf.clone()
    kv = poisoned(reg, case.num_blocks)
    args = WindowArgs(staging, tuple(kv), tuple(case.tables), 1, 3, stride)
    if kind == "cpu":
        from bsr_kernels import cpu_backend

        cpu_backend.install(reg, args)
    else:
        cuda_backend.host_install(reg, args, request.getfixturevalue("cuda_lib"))
    assert_same(kv, _oracle(case), reg, f"{kind} stride {stride}")
    assert torch.equal(buf, before)
    src = random_kv(reg, case.num_blocks, 4)
    out = torch.full_like(buf, POISON)
    view = out.as_strided((3, cb), (stride, 1), 16)
    args = WindowArgs(view, tuple(src), tuple(case.tables), 1, 3, stride)
    if kind == "cpu":
        cpu_backend.gather(reg, args)
    else:
        cuda_backend.host_gather(reg, args, request.getfixturevalue("cuda_lib"))
    assert torch.equal(view.reshape(-1), naive_gather(case, src))
    rows = torch.zeros_like(out, dtype=torch.bool)
    rows.as_strided((3, cb), (stride, 1), 16).fill_(True)
    assert bool((out[~rows] == POISON).all()), f"{kind} gather wrote between chunks"


@pytest.mark.parametrize("kind", ["cpu", "cuda-host"])
def test_libraries_refuse_stride_below_chunk_bytes(request, kind):
    reg = kv_registration(layers=1)
    case = make_case(reg, 0, 2, seed=1)
    kv = poisoned(reg, case.num_blocks)
    args = WindowArgs(case.staging, tuple(kv), tuple(case.tables), 0, 2, reg.chunk_bytes - 16)
    if kind == "cpu":
        from bsr_kernels import cpu_backend

        if not cpu_backend.available():
            pytest.skip(f"no CPU library: {cpu_backend.load_error()}")
        with pytest.raises(RuntimeError, match="chunk_stride"):
            cpu_backend.install(reg, args)
    else:
        with pytest.raises(RuntimeError, match="chunk_stride"):
            cuda_backend.host_install(reg, args, request.getfixturevalue("cuda_lib"))
    assert all(bool((t.view(torch.uint8) == POISON).all()) for t in kv)
