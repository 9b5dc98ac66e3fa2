"""The CUDA backend's C library: it builds with nvcc, loads with ctypes without a GPU, and its
index arithmetic (csrc/bsr_layout.h, run through the kernels' own piece/batch/unit code by
bsr_host_install_strided / bsr_host_gather_strided) matches the torch reference byte for byte."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_util import (
    KV_LAYOUTS,
    STRIDES,
    Case,
    first_use_on_sm90,
    kv_pair_layout,
    kv_registration,
    make_case,
    mla_layout,
    mla_registration,
    naive_gather,
    naive_install,
    random_bytes,
    same_bytes,
    strided_like,
    strided_staging,
)
from kernel_util import registrations as strided_registrations

from bsr_harness.testdata import POISON, window_tables
from bsr_kernels import cuda_backend, presets
from bsr_kernels.registration import Registration, TensorSpec
from bsr_kernels.torch_backend import gather_torch, install_torch
from bsr_kernels.validate import WindowArgs, check_window

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
# Same flags as setup.py (checked below).
NVCC_FLAGS = ["-O3", "-Xcompiler", "-fPIC", "-shared",
              "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
# the window functions before chunk_stride (ABI 2): gone, so nothing can call them with the new arguments
OLD_EXPORTS = ("bsr_install", "bsr_gather", "bsr_host_install", "bsr_host_gather")


# -- the library -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built_lib(cuda_first_use_build) -> tuple[Path, float, Path]:
    """(library, build seconds, cache dir): csrc/ compiled once per run by the first-use build
    (conftest), whose nvcc command for sm_90 is setup.py's (test_library_builds_and_loads)."""
    return cuda_first_use_build


@pytest.fixture(scope="module")
def lib(request) -> ctypes.CDLL:
    """The library freshly built from csrc/ here; without nvcc, the installed one."""
    if cuda_backend.find_nvcc() is not None:
        path, _, _ = request.getfixturevalue("built_lib")
        return cuda_backend.load(path)
    installed = cuda_backend.library()
    if installed is None:
        pytest.skip(f"no nvcc and no installed library: {cuda_backend.load_error()}")
    return installed


def test_library_builds_and_loads(built_lib):
    path, seconds, _ = built_lib
    # the first-use build for sm_90 runs setup.py's command (NVCC_FLAGS: test_setup_py_uses_the_same_flags)
    assert [*cuda_backend.NVCC_FLAGS, "-gencode", "arch=compute_90,code=sm_90",
            "-gencode", "arch=compute_90,code=compute_90"] == NVCC_FLAGS
    assert path.stat().st_size > 0
    lib = cuda_backend.load(path)
    assert lib.bsr_abi_version() == cuda_backend.abi().versions["cuda"]
    for proto in cuda_backend.abi().of("cuda"):  # the functions csrc/bsr_abi.h declares
        assert hasattr(lib, proto.name), proto.name
    for name in OLD_EXPORTS:
        assert not hasattr(lib, name), name
    assert seconds < 300


@pytest.mark.parametrize("name", ["bsr_copy_batch", "bsr_copy_loop"])
def test_dma_baselines_refuse_null_arrays_before_any_cuda_call(lib, name):
    """gpu_check.py's copy-engine baselines: an empty batch is a no-op, null arrays are refused."""
    fn = getattr(lib, name)
    assert fn(None, None, None, 0, None) == 0
    assert fn(None, None, None, 3, None) == 1  # BSR_ERR_INVALID
    assert b"null array" in lib.bsr_last_error()


def test_setup_py_uses_the_same_flags():
    text = (ROOT / "setup.py").read_text()
    for flag in NVCC_FLAGS:
        assert f'"{flag}"' in text, flag


def test_header_is_plain_c_and_cxx():
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no host C compiler")
    for lang, std in (("c", "c99"), ("c++", "c++11")):
        for header in ("bsr_layout.h", "bsr_abi.h"):
            proc = subprocess.run([cc, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-x", lang,
                                   str(CSRC / header)], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr


def test_descriptor_columns_match_header():
    from bsr_kernels.descriptors import DESC_FIELDS

    header = (CSRC / "bsr_layout.h").read_text()
    cols = {m[0].lower(): int(m[1]) for m in re.findall(r"#define BSR_DESC_([A-Z0-9_]+) (\d+)", header)}
    assert cols.pop("cols") == len(DESC_FIELDS)
    assert cols == {name: i for i, name in enumerate(DESC_FIELDS)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_no_device_is_reported_cleanly(lib):
    n = ctypes.c_int(-1)
    rc = lib.bsr_device_count(ctypes.byref(n))
    assert rc != 0 and n.value == 0
    assert "no CUDA device" in lib.bsr_last_error().decode()
    status = cuda_backend.device_status()
    assert isinstance(status, str) and "no CUDA device" in status
    assert cuda_backend.available() is False


# -- byte-for-byte against the torch reference -------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1)


def _random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 256, (n,), dtype=torch.uint8, generator=gen)  # never zero


def _tables(reg: Registration, first: int, num: int, gen: torch.Generator, neg: float):
    """Per group: a block table whose window part is a shuffled subset of the destination's
    blocks with some -1; the parts outside the window hold ids no kernel may read."""
    def upto2() -> int:
        return int(torch.randint(0, 3, (1,), generator=gen))

    return window_tables(reg, first, num, gen, neg, spare=upto2, before=-7, tail=upto2, tail_id=-9)


def _written_mask(reg: Registration, i: int, table: torch.Tensor, first: int, num: int, nb: int):
    """(nb, block_size) bool: slots the window writes, computed entry by entry in Python."""
    spec = reg.specs[i]
    per = reg.chunk_tokens // spec.token_ratio
    skip = per - (spec.tail_tokens or reg.chunk_tokens) // spec.token_ratio  # objects hold each chunk's tail
    mask = torch.zeros(nb, spec.block_size, dtype=torch.bool)
    tab = table.tolist()
    for c in range(first, first + num):
        for e in range(c * per + skip, (c + 1) * per):
            b = tab[e // spec.block_size]
            if b >= 0:
                mask[b, e % spec.block_size] = True
    return mask


def check_case(reg: Registration, lib, first: int, num: int, seed: int, neg: float = 0.2, split: int = 0,
               poison_check: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    tables, nblocks = _tables(reg, first, num, gen, neg)
    cb, tail = reg.chunk_bytes, 48
    staging = _random_bytes(num * cb + tail, gen)

    # install: poisoned destinations, reference vs the library's host path
    kv_ref = reg.allocate(nblocks)
    for t in kv_ref:
        _bytes(t).fill_(POISON)
    kv_lib = [t.clone() for t in kv_ref]
    install_torch(reg, check_window(staging, reg, kv_ref, tables, first, num))
    cuda_backend.host_install(reg, check_window(staging, reg, kv_lib, tables, first, num), lib, split)
    for spec, r, t in zip(reg.specs, kv_ref, kv_lib, strict=True):
        assert torch.equal(_bytes(r), _bytes(t)), f"install differs from the reference for {spec.name}"
    if poison_check:
        for i, (spec, t) in enumerate(zip(reg.specs, kv_lib, strict=True)):
            mask = _written_mask(reg, i, tables[spec.group], first, num, nblocks[spec.group])
            rows = _bytes(t).view(t.shape[0], spec.block_size, spec.entry_bytes)
            assert bool((rows[~mask] == POISON).all()), f"{spec.name}: bytes outside the window changed"

    # gather: random destinations into a poisoned staging buffer
    kv_src = reg.allocate(nblocks)
    for t in kv_src:
        _bytes(t).copy_(_random_bytes(_bytes(t).numel(), gen))
    out_ref = torch.full((num * cb + tail,), POISON, dtype=torch.uint8)
    out_lib = out_ref.clone()
    gather_torch(reg, check_window(out_ref, reg, kv_src, tables, first, num, staging_name="out"))
    cuda_backend.host_gather(reg, check_window(out_lib, reg, kv_src, tables, first, num, staging_name="out"),
                             lib, split)
    assert torch.equal(out_ref, out_lib), _first_diff(out_ref, out_lib, reg)
    assert bool((out_lib[num * cb:] == POISON).all()), "gather wrote past the window"


def _first_diff(a: torch.Tensor, b: torch.Tensor, reg: Registration) -> str:
    idx = int((a != b).nonzero()[0])
    chunk, off = divmod(idx, reg.chunk_bytes)
    seg = max(i for i, o in enumerate(reg.segment_offsets) if o <= off)
    return f"gather differs at byte {idx} (chunk {chunk}, offset {off}, segment of {reg.specs[seg].name})"


@pytest.mark.parametrize("mtp", [False, True])
def test_dsv4_flash_scaled(lib, mtp):
    reg = presets.dsv4_flash(mtp=mtp, scale=1 / 64)
    check_case(reg, lib, first=3, num=3, seed=11 + mtp)


def test_dsv4_flash_unscaled_one_chunk(lib):
    check_case(presets.dsv4_flash(), lib, first=1, num=1, seed=5, poison_check=False)


@pytest.mark.parametrize("split", [0, 1, 5])
def test_llama_like(lib, split):
    check_case(presets.llama_like(), lib, first=2, num=2, seed=7, split=split)


def test_all_blocks_skipped(lib):
    check_case(kv_registration(layers=1, window=128), lib, first=0, num=2, seed=3, neg=1.0)


TOKENS_PER_BLOCK = (1, 2, 3, 4, 5, 8, 12, 16, 20, 32, 48, 64, 128, 192, 256, 512, 1024, 4096, 8192)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 40, 132, 584)
DTYPES = (torch.uint8, torch.float16, torch.float32)


@st.composite
def registrations(draw) -> Registration:
    specs = []
    for g in range(draw(st.integers(1, 3))):
        tpb = draw(st.sampled_from(TOKENS_PER_BLOCK))
        window = draw(st.sampled_from([None, 128]))
        ratios = [r for r in (1, 4, 128) if tpb % r == 0 and 1 <= tpb // r <= 64]
        for k in range(draw(st.integers(1, 4))):
            ratio = draw(st.sampled_from(ratios))
            dtype = draw(st.sampled_from(DTYPES))
            width = draw(st.sampled_from([w for w in WIDTHS if w % dtype.itemsize == 0]))
            n = width // dtype.itemsize
            shape = (2, n // 2) if n % 2 == 0 and draw(st.booleans()) else (n,)
            specs.append(TensorSpec(f"g{g}.t{k}", dtype, shape, tpb // ratio, ratio, g, window))
    return Registration(tuple(draw(st.permutations(specs))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reg=registrations(), first=st.integers(0, 5), num=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       neg=st.sampled_from([0.0, 0.2, 0.6]), split=st.sampled_from([0, 1, 2, 3, 7, 32]))
def test_random_registrations(lib, reg, first, num, seed, neg, split):
    check_case(reg, lib, first, num, seed, neg, split)


def test_out_of_range_block_is_an_error(lib):
    reg = presets.llama_like(layers=1)
    kv = reg.allocate(4)
    tables = (torch.tensor([0, 1, 99, 3] * 8, dtype=torch.int64),)  # 99: past the 4 blocks
    staging = _random_bytes(reg.chunk_bytes, torch.Generator().manual_seed(0))
    args = WindowArgs(staging, tuple(kv), tables, 0, 1, reg.chunk_bytes)  # bypasses check_window on purpose
    with pytest.raises(RuntimeError, match="block id outside"):
        cuda_backend.host_install(reg, args, lib)


# -- chunk-strided staging: chunk c at headroom + c * chunk_stride, gaps never touched -----------
def check_strided_case(reg: Registration, lib, first: int, num: int, seed: int, split: int, stride: str,
                       neg: float = 0.2) -> None:
    """check_case with 2-D chunk-strided staging (and one spare row): the host emulation against
    the torch reference, the gap bytes unchanged after install and after gather."""
    gen = torch.Generator().manual_seed(seed)
    tables, nblocks = _tables(reg, first, num, gen, neg)
    headroom, tail = STRIDES[stride]
    staged = strided_staging(reg, num + 1, headroom, tail, gen)
    kv_ref = reg.allocate(nblocks)
    for t in kv_ref:
        _bytes(t).fill_(POISON)
    kv_lib = [t.clone() for t in kv_ref]
    install_torch(reg, check_window(staged.view, reg, kv_ref, tables, first, num))
    cuda_backend.host_install(reg, check_window(staged.view, reg, kv_lib, tables, first, num), lib, split)
    for spec, r, t in zip(reg.specs, kv_ref, kv_lib, strict=True):
        assert torch.equal(_bytes(r), _bytes(t)), f"strided install differs from the reference for {spec.name}"
    assert staged.gaps_unchanged(), "install wrote a gap"
    kv_src = reg.allocate(nblocks)
    for t in kv_src:
        _bytes(t).copy_(_random_bytes(_bytes(t).numel(), gen))
    out_ref = strided_staging(reg, num + 1, headroom, tail, torch.Generator().manual_seed(seed), fill=POISON)
    out_lib = strided_staging(reg, num + 1, headroom, tail, torch.Generator().manual_seed(seed), fill=POISON)
    gather_torch(reg, check_window(out_ref.view, reg, kv_src, tables, first, num, staging_name="out"))
    cuda_backend.host_gather(reg, check_window(out_lib.view, reg, kv_src, tables, first, num, staging_name="out"),
                             lib, split)
    assert torch.equal(out_ref.buf, out_lib.buf), _first_diff(out_ref.view[:num].reshape(-1),
                                                              out_lib.view[:num].reshape(-1), reg)
    assert out_lib.gaps_unchanged(), "gather wrote a gap"
    assert bool((out_lib.view[num:] == POISON).all()), "gather wrote past the window"


@pytest.mark.parametrize("stride", sorted(STRIDES))
@pytest.mark.parametrize("split", [0, 1, 5])
def test_strided_staging_llama(lib, split, stride):
    check_strided_case(presets.llama_like(), lib, first=2, num=2, seed=7, split=split, stride=stride)


@pytest.mark.parametrize("stride", ["h16", "h128-tail48"])
def test_strided_staging_dsv4(lib, stride):
    check_strided_case(presets.dsv4_flash(mtp=True, scale=1 / 64), lib, first=3, num=3, seed=11, split=0,
                       stride=stride)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reg=registrations(), first=st.integers(0, 5), num=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       neg=st.sampled_from([0.0, 0.2, 0.6]), split=st.sampled_from([0, 1, 2, 3, 7, 32]),
       stride=st.sampled_from(sorted(STRIDES)))
def test_strided_staging_random_registrations(lib, reg, first, num, seed, neg, split, stride):
    check_strided_case(reg, lib, first, num, seed, split, stride, neg)


# -- access width ----------------------------------------------------------------------------
def test_access_width_fixed_cases(lib):
    def w(eb, seg, cb, stride, sa=0x10000, da=0x20000):
        return cuda_backend.access_width(eb, seg, cb, stride, sa, da, lib=lib)

    assert w(584, 0, 584 * 256 + 16 * 3, 584 * 64) == 8  # fp8_ds_mla rows: 584 = 8 * 73
    assert w(584, 149504, 16327232, 584 * 64) == 8
    assert w(4096, 16, 1024 * 16, 4096 * 64) == 16
    assert w(64, 32, 4096, 1024) == 16
    assert w(132, 0, 4096, 132 * 64) == 4
    assert w(64, 32, 4096, 1024, sa=0x10004) == 4  # staging base only 4-aligned
    assert w(64, 32, 4096, 1024, da=0x20002) == 2
    assert w(64, 2, 4096, 1024) == 2  # odd segment offset
    assert w(64, 32, 4096, 1024, da=0x20001) == 1
    assert w(12, 0, 4096, 12 * 16) == 4
    assert w(3, 0, 4096, 48) == 1


def _py_width(*values: int) -> int:
    w = 16
    while w > 1 and any(v % w for v in values):
        w //= 2
    return w


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 2**40), min_size=6, max_size=6))
def test_access_width_property(lib, vals):
    assert cuda_backend.access_width(*vals, lib=lib) == _py_width(*vals)


def test_dsv4_widths(lib):
    """The widths the kernels pick for the real DSV4 tensors on 64-byte aligned buffers."""
    reg = presets.dsv4_flash()
    kv = reg.allocate(1)
    staging_addr = 0x7F0000000000
    got = {}
    for i, (spec, t) in enumerate(zip(reg.specs, kv, strict=True)):
        got.setdefault(spec.entry_bytes, set()).add(cuda_backend.access_width(
            spec.entry_bytes, reg.segment_offsets[i], reg.chunk_bytes, t.stride(0) * t.element_size(),
            staging_addr, t.data_ptr(), lib=lib))
    assert got[584] == {8}
    assert got[132] == {4}
    assert got[8192] == got[2048] == got[4096] == {16}  # fp32 compressor states of 2048, 512, 1024 values


# -- the Python wrapper without a GPU ---------------------------------------------------------
def test_zero_copy_needs_pinned_staging():
    reg = presets.llama_like(layers=1)
    staging = torch.zeros(reg.chunk_bytes, dtype=torch.uint8)  # pageable
    args = WindowArgs(staging, tuple(reg.allocate(4)), (torch.arange(32),), 0, 1, reg.chunk_bytes)
    with pytest.raises(ValueError, match="pinned"):
        cuda_backend._device_staging("install", args, torch.device("cuda", 0), True, reg.chunk_bytes)


def test_first_use_build(built_lib):
    """Without an installed library, a GPU machine compiles csrc/ into the cache at first use (the
    run's build, conftest's cuda_first_use_build), and finds it there the next time."""
    path, _, cache = built_lib
    assert path is not None and path.is_file() and path.parent.name.endswith("-sm90")
    assert path.parent.parent == cache
    assert cuda_backend.load(path).bsr_abi_version() == cuda_backend.abi().versions["cuda"]
    built_at = path.stat().st_mtime_ns
    with first_use_on_sm90(cache):
        assert cuda_backend._cached_build(cuda_backend.source_dir()) == path  # cached: no rebuild
    assert path.stat().st_mtime_ns == built_at


# -- strided destinations: the host emulation against the entry-by-entry oracle ---------------
def _strided_check(lib, reg: Registration, case: Case, alloc, split: int = 0) -> None:
    views, buffers = alloc()
    cuda_backend.host_install(reg, check_window(case.staging, reg, views, case.tables, case.first_chunk,
                                                case.num_chunks), lib, split)
    expect_views, expect = alloc()
    naive_install(case, expect_views)
    same_bytes(buffers, expect, "host install vs oracle")
    gen = torch.Generator().manual_seed(1)
    for b in buffers:
        flat = b.view(torch.uint8).view(-1)
        flat.copy_(random_bytes(flat.numel(), gen))
    out = torch.full((case.num_chunks * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    cuda_backend.host_gather(reg, check_window(out, reg, views, case.tables, case.first_chunk, case.num_chunks,
                                               staging_name="out"), lib, split)
    assert torch.equal(out, naive_gather(case, views))


@pytest.mark.parametrize("layout", [*KV_LAYOUTS, "mla", "mla_sliced"])
def test_strided_layouts(lib, layout):
    if layout.startswith("mla"):
        reg = mla_registration()
        alloc = lambda: mla_layout(layout, reg, case.num_blocks[0])  # noqa: E731
    else:
        reg = kv_registration(layers=2, heads=3, head_dim=8, block_size=16)
        alloc = lambda: kv_pair_layout(layout, reg, case.num_blocks[0])  # noqa: E731
    case = make_case(reg, 1, 2, seed=5, hole_frac=0.2)
    _strided_check(lib, reg, case, alloc)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reg=strided_registrations(max_tensors=4), first=st.integers(0, 2), num=st.integers(1, 2),
       seed=st.integers(0, 2**16), split=st.sampled_from([0, 1, 3]))
def test_random_strided_views(lib, reg, first, num, seed, split):
    case = make_case(reg, first, num, seed)
    _strided_check(lib, reg, case, lambda: strided_like(reg, case.num_blocks, seed), split)


def test_run_width_is_per_run_not_per_entry(lib):
    """A block span of 64 fp8_ds_mla rows (584 B, per-entry width 8) moves in 16-byte accesses."""
    assert cuda_backend.access_width(584, 0, 584 * 256, 584 * 64, 0x10000, 0x20000, lib=lib) == 8
    assert cuda_backend.run_width(0x10000 + 584 * 64, 0x20000 + 584 * 64 * 3, 584 * 64, lib=lib) == 16
    assert cuda_backend.run_width(0x10000 + 584, 0x20000, 584 * 63, lib=lib) == 8
    assert cuda_backend.run_width(0x10004, 0x20000, 4096, lib=lib) == 4
    assert cuda_backend.run_width(0x10000, 0x20000, 4097, lib=lib) == 1


def test_stale_library_is_refused(tmp_path):
    """A libbsr_cuda.so from before chunk-strided staging (ABI 2, window functions without
    chunk_stride) is refused by load() before any of its functions is declared or called."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no host C compiler")
    src = tmp_path / "stale.c"
    src.write_text("#include <stdint.h>\nint bsr_abi_version(void) { return 2; }\n"
                   "int bsr_install(void* s, int64_t cb, int64_t f, int64_t n, const int64_t* d, int64_t nt,\n"
                   "                const int64_t* p, int64_t ng, void* stream) { return 0; }\n")
    stale = tmp_path / "libbsr_cuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(stale), str(src)], check=True)
    with pytest.raises(RuntimeError, match=f"ABI version 2, this package needs {cuda_backend.abi().versions['cuda']}"):
        cuda_backend.load(stale)


def test_access_width_follows_the_chunk_stride(lib):
    """Chunk c starts c * chunk_stride after the first: the stride bounds the width like an offset."""
    def w(stride):
        return cuda_backend.access_width(64, 32, stride, 1024, 0x10000, 0x20000, lib=lib)

    assert w(4096 + 128) == 16
    assert w(4096 + 8) == 8
    assert w(4096 + 4) == 4
    assert w(4096 + 1) == 1
