"""CPU backend ("cpu"): the C-ABI library built from csrc/*.c (libbsr_cpu.so), loaded with ctypes.

csrc/bsr_install_cpu.c is the install/gather; the same library carries the worker pool
(bsr_cpu_pool.c) and CRC-32C with copy-and-checksum (bsr_crc32c.c, wrapped by host_crc.py).

One call per window walks the descriptor table (bsr_kernels.descriptors, shared with Triton and
CUDA) and memcpy's contiguous runs; single-threaded by default, two threads from the library's
size threshold up (`threads` forces a count; the worker is kept off the caller's CPU,
`pool_spread`, and takes pieces of the window beside the caller, which never waits for a worker
that has not started, `pool_hold`); installs write with non-temporal stores, gathers from the last-level cache size
up (`stream_bytes`). No torch ABI coupling: raw data pointers only.

Where the library comes from, first hit wins:
1. $BSR_CPU_LIB (an explicit path);
2. bsr_kernels/lib/libbsr_cpu.so, built by setup.py at install time with the system C compiler;
3. a first-use build with that compiler into $BSR_CACHE_DIR or ~/.cache/bsr, keyed by a hash of
   the sources (so a source tree whose library is missing or stale still gets the backend).
Without any, `available()` is False and backend "auto" uses torch for CPU destinations.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from pathlib import Path

import torch

from .descriptors import block_table_pointers, descriptor_table
from .native_abi import NativeAbi, read_abi
from .native_library import LazyLibrary, LibraryNotLoaded, build_atomically, cache_dir, sources_digest
from .registration import Registration
from .validate import RunOptions, WindowArgs

LIB_NAME = "libbsr_cpu.so"
SOURCE = "bsr_install_cpu.c"  # the library is every .c file of csrc/ (this one marks the directory)
# hidden by default: the library exports only what csrc/bsr_abi.h declares (BSR_CPU_API)
CC_FLAGS = ("-std=c11", "-O3", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden")

_PKG = Path(__file__).resolve().parent


def source_dir() -> Path | None:
    for d in (_PKG.parent / "csrc", _PKG / "csrc"):
        if (d / SOURCE).is_file():
            return d
    return None


def abi() -> NativeAbi:
    """The C interface as csrc/bsr_abi.h declares it (the sources the library is built from)."""
    return read_abi(source_dir())


def load(path: str | os.PathLike) -> ctypes.CDLL:
    """Load one library file, check the ABI version it reports against bsr_abi.h's and declare its
    functions from the header; raises OSError/RuntimeError (a stale build: `_find` then builds the
    current sources, and the stale library's functions are never called)."""
    return abi().load(path, "cpu")


def find_cc() -> str | None:
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _sources(src: Path) -> list[Path]:
    return sorted(f for f in src.iterdir() if f.is_file() and f.suffix in (".c", ".h"))


def c_sources(src: Path) -> list[str]:
    """The compilation units of libbsr_cpu.so: every .c file of csrc/ (setup.py builds the same)."""
    return [str(f) for f in _sources(src) if f.suffix == ".c"]


def _stale(lib: Path) -> bool:
    src = source_dir()
    return src is not None and any(f.stat().st_mtime > lib.stat().st_mtime for f in _sources(src))


def _cached_build(src: Path) -> Path:
    out = cache_dir() / sources_digest(_sources(src)) / LIB_NAME
    cc = find_cc()
    if cc is None and not out.is_file():
        raise RuntimeError("no C compiler ($CC, cc, gcc, clang) to build it at first use")
    return build_atomically(out, lambda tmp: [cc, *CC_FLAGS, "-o", str(tmp), *c_sources(src)], "C")


def _find() -> tuple[ctypes.CDLL, str]:
    """The installed library unless it is older than its sources, else a first-use build."""
    errors = []
    explicit = os.environ.get("BSR_CPU_LIB")
    path = Path(explicit) if explicit else _PKG / "lib" / LIB_NAME
    if path.is_file() and (explicit or not _stale(path)):
        try:
            return load(path), str(path)
        except (OSError, RuntimeError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    else:
        errors.append(f"{path} " + ("is older than its sources" if path.is_file() else "not found"))
    if not explicit:
        src = source_dir()
        try:
            if src is None:
                raise RuntimeError("csrc/ sources not found")
            built = _cached_build(src)
            return load(built), str(built)
        except (OSError, RuntimeError, AttributeError) as e:
            errors.append(str(e))
    raise LibraryNotLoaded("; ".join(errors))


_LIBRARY = LazyLibrary(_find)
library, library_path, load_error = _LIBRARY.get, _LIBRARY.path, _LIBRARY.error  # loaded on first use


def available() -> bool:
    return library() is not None


@functools.cache
def library_holding_gil() -> ctypes.CDLL | None:
    """The same library, its functions called without giving the GIL up. For calls of a few
    microseconds that never block (queueing a read, asking whether one ended): beside a thread running
    Python (an engine's step), giving the GIL up and taking it back can cost a whole switch interval."""
    path = library_path()
    return None if path is None else abi().load(path, "cpu", holds_gil=True)


def parallel_bytes() -> int:
    """Window size from which threads=0 (auto) uses a second thread."""
    lib = library()
    return int(lib.bsr_cpu_parallel_bytes()) if lib is not None else 0


def pool_spread(on: bool | None = None) -> bool:
    """Whether the library's worker threads are kept off the CPU of the thread that calls it
    (csrc/bsr_cpu_pool.c; on unless BSR_CPU_SPREAD=0). `on` sets it; returns the previous setting."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"CPU backend unavailable: {load_error()}")
    return bool(lib.bsr_cpu_pool_spread(-1 if on is None else int(on)))


def pool_hold(on: bool | None = None) -> bool:
    """Tests: while on, the library's pool workers start no task, as if the scheduler never ran them; a
    call with threads > 1 then runs all its work in the caller's thread (csrc/bsr_cpu_pool.h). `on` sets
    it; returns the previous setting."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"CPU backend unavailable: {load_error()}")
    return bool(lib.bsr_cpu_pool_hold(-1 if on is None else int(on)))


STREAM_INTO = ("staging", "destinations")  # csrc/bsr_stream.h: BSR_INTO_STAGING, BSR_INTO_DESTINATIONS


def stream_bytes(nbytes: int | None = None, *, into: str = "staging") -> int:
    """Calls of the library that move at least this many bytes `into` staging (the checksumming copy,
    gather: by default from the last-level cache size up, $BSR_CPU_STREAM_BYTES) or destinations (the
    install: by default 0, every window; $BSR_CPU_STREAM_DEST_BYTES) use non-temporal stores
    (csrc/bsr_stream.h). `nbytes` sets it (0: always); returns the previous value."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"CPU backend unavailable: {load_error()}")
    if into not in STREAM_INTO:
        raise ValueError(f"into must be one of {STREAM_INTO}, got {into!r}")
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"stream_bytes must be >= 0, got {nbytes}")
    return int(lib.bsr_cpu_stream_bytes(STREAM_INTO.index(into), -1 if nbytes is None else int(nbytes)))


def run(kind: str, reg: Registration, desc: torch.Tensor, a: WindowArgs, options: RunOptions | None = None) -> None:
    """One window through the library (the registry's window call, backends.py): chunk c of `a.staging` at
    byte c * a.chunk_stride, destinations as the descriptor table `desc` (descriptors.descriptor_table)
    describes them; `options.cpu_threads` threads (0 or no options: by the window's bytes)."""
    if a.num_chunks == 0:
        return
    threads = 0 if options is None else options.cpu_threads
    lib = library()
    if lib is None:
        raise RuntimeError(f"CPU backend unavailable: {load_error()}")
    if not all(t.is_cpu for t in a.block_tables):
        raise ValueError("the cpu backend needs block tables on the CPU")
    if not a.staging.is_cpu:
        raise ValueError(f"the cpu backend needs host staging, got {a.staging.device}")
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = auto), got {threads}")
    ptrs, _tables = block_table_pointers(a.block_tables, torch.device("cpu"))  # _tables: alive for the call
    fn = lib.bsr_cpu_install_strided if kind == "install" else lib.bsr_cpu_gather_strided
    rc = fn(a.staging.data_ptr(), reg.chunk_bytes, a.chunk_stride, a.first_chunk, a.num_chunks, desc.data_ptr(),
            reg.num_tensors, ptrs.data_ptr(), reg.num_groups, int(threads))
    if rc != 0:
        raise RuntimeError(f"bsr_cpu_{kind}: {(lib.bsr_cpu_last_error() or b'').decode(errors='replace')}")


def _direct(kind: str, reg: Registration, a: WindowArgs, threads: int) -> None:
    if not all(t.is_cpu for t in a.kv):
        raise ValueError("the cpu backend needs destinations on the CPU")
    run(kind, reg, descriptor_table(reg, a.kv, torch.device("cpu")), a, RunOptions(cpu_threads=threads))


def install(reg: Registration, a: WindowArgs, threads: int = 0) -> None:
    """One call: scatter the window's staged chunks into every tensor's destination blocks."""
    _direct("install", reg, a, threads)


def gather(reg: Registration, a: WindowArgs, threads: int = 0) -> None:
    """The inverse of install (-1 entries and segment padding read as zero)."""
    _direct("gather", reg, a, threads)
