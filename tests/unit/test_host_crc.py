"""CRC-32C and the checksumming copy of the CPU library (csrc/bsr_crc32c.c via bsr_kernels.host_crc),
against google_crc32c on fresh random data: every length class of the three-stream loop, odd
alignments, continuation; copies into poisoned destinations with guard bytes around them."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from bsr_harness.testdata import POISON
from bsr_kernels import host_crc

pytestmark = pytest.mark.skipif(not host_crc.available(), reason="libbsr_cpu.so not built (no C compiler)")

# around the 3 x 8 KiB and 3 x 256 B block boundaries of the three-stream loop, the 1 KiB
# threshold and 256 B steps of the folding, and odd sizes
LENGTHS = [0, 1, 7, 8, 9, 63, 767, 768, 769, 1023, 1024, 1025, 1279, 1280, 1535, 4096 + 13, 24575, 24576,
           24577, 3 * 8192 + 3 * 256 + 13, 200_003]


def ref(a: np.ndarray) -> int:
    return google_crc32c.value(a.tobytes())


@pytest.fixture
def rng():
    return np.random.default_rng()


def test_uses_the_fastest_implementation_the_cpu_has():
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if "sse4_2" not in flags:
        pytest.skip("no SSE4.2 here")
    want = "fold" if {"avx512f", "vpclmulqdq", "pclmulqdq"} <= flags else "crc32"
    assert host_crc.hardware() and host_crc.implementation() == want


def test_the_three_stream_loop_matches_too(rng, tmp_path):
    """BSR_CRC_NO_FOLD=1 keeps a process on the crc32 loop: checked in one child process (an import
    of bsr_kernels costs seconds) on several lengths."""
    import subprocess
    import sys

    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1024, 1025, 4096 + 13, 200_003)]
    files = []
    for i, a in enumerate(arrays):
        files.append(tmp_path / f"a{i}.bin")
        files[-1].write_bytes(a.tobytes())
    code = ("import sys, numpy as np; from bsr_kernels import host_crc\n"
            "for f in sys.argv[1:]:\n"
            "    a = np.fromfile(f, dtype=np.uint8)\n"
            "    print(host_crc.implementation(), host_crc.crc32c(a.ctypes.data, a.size))")
    out = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "BSR_CRC_NO_FOLD": "1"}).stdout.split("\n")
    for line, a in zip(out, arrays, strict=False):
        impl, crc = line.split()
        assert impl in ("crc32", "table") and int(crc) == ref(a), f"{a.size} bytes"
    assert len([line for line in out if line.strip()]) == len(arrays)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_crc32c_matches_google(rng, n, offset):
    buf = rng.integers(0, 256, n + 16, dtype=np.uint8)
    a = buf[offset : offset + n]
    assert host_crc.crc32c(a.ctypes.data, n) == ref(a)
    half = n // 3
    c = host_crc.crc32c(a.ctypes.data, half)
    assert host_crc.crc32c(a.ctypes.data + half, n - half, c) == ref(a)  # continuation


def test_crc32c_changes_with_any_flipped_bit(rng):
    a = rng.integers(0, 256, 50_000, dtype=np.uint8)
    good = host_crc.crc32c(a.ctypes.data, a.size)
    for pos in rng.integers(0, a.size, 20).tolist():
        b = a.copy()
        b[pos] ^= 1 << int(rng.integers(0, 8))
        assert host_crc.crc32c(b.ctypes.data, b.size) != good


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_crc32c_many_matches_one_by_one(rng, threads):
    n, size = 37, 70_001
    buf = rng.integers(0, 256, n * size + 3, dtype=np.uint8)
    ptrs = [buf.ctypes.data + 3 + i * size for i in range(n)]
    got = host_crc.crc32c_many(ptrs, size, threads=threads)
    assert got.tolist() == [ref(buf[3 + i * size : 3 + (i + 1) * size]) for i in range(n)]
    assert host_crc.crc32c_many([], size).size == 0


@pytest.mark.parametrize("nbytes", [0, 1, 128, 1025, 70_001])
def test_crc32c_extend_many_matches_continuation(rng, nbytes):
    """The linear continuation gives what the library's continuation (and google_crc32c over the
    concatenation) gives, for random starting CRCs and bytes."""
    n = 29
    buf = rng.integers(0, 256, n * nbytes + 5, dtype=np.uint8)
    ptrs = [buf.ctypes.data + 5 + i * nbytes for i in range(n)]
    start = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    got = host_crc.crc32c_extend_many(start, ptrs, nbytes)
    assert got.tolist() == [host_crc.crc32c(p, nbytes, int(c)) for p, c in zip(ptrs, start, strict=True)]
    head = rng.integers(0, 256, 333, dtype=np.uint8)
    whole = np.concatenate([head, buf[5 : 5 + nbytes]])
    assert host_crc.crc32c_extend_many([ref(head)], ptrs[:1], nbytes)[0] == ref(whole)
    with pytest.raises(ValueError, match="2 CRCs but 1 buffers"):
        host_crc.crc32c_extend_many([1, 2], ptrs[:1], nbytes)


@pytest.mark.parametrize("threads", [0, 1, 2])
@pytest.mark.parametrize("head, body", [(128, 1 << 20), (128, 65_584), (0, 4096), (64, 1), (16, 0)])
def test_copy_crc32c_lands_header_and_body_apart(rng, threads, head, body, nt_stores):
    n, guard = 9, 64
    src = rng.integers(0, 256, n * (head + body) + 1, dtype=np.uint8)[1:]  # odd source alignment
    heads = np.full(n * (head + guard) + guard, POISON, dtype=np.uint8)
    bodies = np.full(n * (body + guard) + guard, POISON, dtype=np.uint8)
    order = rng.permutation(n)  # destinations in another order than the sources
    hp = [heads.ctypes.data + guard + int(j) * (head + guard) for j in order]
    bp = [bodies.ctypes.data + guard + int(j) * (body + guard) for j in order]
    sp = [src.ctypes.data + i * (head + body) for i in range(n)]
    crcs = host_crc.copy_crc32c(sp, hp, bp, head, body, threads=threads)
    for i, j in enumerate(order.tolist()):
        obj = src[i * (head + body) : (i + 1) * (head + body)]
        h0, b0 = guard + j * (head + guard), guard + j * (body + guard)
        assert np.array_equal(heads[h0 : h0 + head], obj[:head])
        assert np.array_equal(bodies[b0 : b0 + body], obj[head:])
        assert crcs[i] == ref(obj[head:])
    for arr, size in ((heads, head), (bodies, body)):  # every guard byte is untouched
        mask = np.ones(arr.size, dtype=bool)
        for j in range(n):
            mask[guard + j * (size + guard) : guard + j * (size + guard) + size] = False
        assert (arr[mask] == POISON).all()


@pytest.mark.parametrize("body", [256, 1024, 1280, 4096 + 64, 65_536 + 255, 3 * 8192 + 3 * 256 + 13])
@pytest.mark.parametrize("misalign", [0, 16, 63])
def test_copy_crc32c_into_aligned_and_misaligned_bodies(rng, nt_stores, body, misalign):
    """Bodies 64-byte aligned (where the streamed copy uses non-temporal stores) or not, lengths on
    and off the 256-byte steps of the fused fold-and-store loop: the bytes, the CRCs and the guards."""
    n, guard, stride = 5, 64, -(-(body + 128) // 64) * 64
    src = rng.integers(0, 256, n * body + 3, dtype=np.uint8)[3:]
    raw = np.full(n * stride + 2 * guard + 64, POISON, dtype=np.uint8)
    base = raw.ctypes.data + guard + (-(raw.ctypes.data + guard)) % 64 + misalign
    off = base - raw.ctypes.data
    bp = [base + i * stride for i in range(n)]
    crcs = host_crc.copy_crc32c([src.ctypes.data + i * body for i in range(n)], None, bp, 0, body, threads=2)
    mask = np.ones(raw.size, dtype=bool)
    for i in range(n):
        got = raw[off + i * stride : off + i * stride + body]
        assert np.array_equal(got, src[i * body : (i + 1) * body]), i
        assert crcs[i] == ref(got), i
        mask[off + i * stride : off + i * stride + body] = False
    assert (raw[mask] == POISON).all()


def test_copy_crc32c_refuses_bad_arguments():
    a = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="sources"):
        host_crc.copy_crc32c([a.ctypes.data], None, [], 0, 8)
    with pytest.raises(ValueError, match="header destinations"):
        host_crc.copy_crc32c([a.ctypes.data], None, [a.ctypes.data + 32], 8, 8)
    with pytest.raises(ValueError, match="invalid arguments"):
        host_crc.copy_crc32c([a.ctypes.data], [a.ctypes.data], [a.ctypes.data + 32], -1, 8)
    with pytest.raises(ValueError, match="nbytes"):
        host_crc.crc32c(a.ctypes.data, -1)
    assert host_crc.copy_crc32c([], [], [], 8, 8).size == 0
