"""CUDA backend: the C-ABI library built from csrc/ (libbsr_cuda.so), loaded with ctypes.

No torch ABI coupling: the library gets raw data pointers, int64 descriptor tables
(bsr_kernels.descriptors) and a CUDA stream handle. It links cudart statically.

Where the library comes from, first hit wins:
1. $BSR_CUDA_LIB (an explicit path);
2. bsr_kernels/lib/libbsr_cuda.so, built by setup.py at install time when nvcc was found;
3. a first-use build cache, $BSR_CACHE_DIR or ~/.cache/bsr, keyed by a hash of the csrc/
   sources and the GPU's compute capability. When nothing above exists and a CUDA device is
   visible to torch, the same csrc/bsr_install.cu is compiled there with nvcc (PATH,
   $CUDA_HOME/bin, /usr/local/cuda/bin, or the pip `nvidia-cuda-nvcc` wheel) for that
   GPU's architecture. cupy's RawModule is not used for this: NVRTC compiles kernels only,
   not the host-side C API the ctypes contract needs.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import warnings
from pathlib import Path

import torch

from .descriptors import block_table_pointers, descriptor_table
from .native_abi import NativeAbi, read_abi
from .native_library import LazyLibrary, LibraryNotLoaded, build_atomically, cache_dir, sources_digest
from .registration import Registration
from .validate import WindowArgs

LIB_NAME = "libbsr_cuda.so"
MAX_ENTRY_BYTES = 1 << 30  # BSR_MAX_ENTRY_BYTES in csrc/bsr_layout.h
NVCC_FLAGS = ("-O3", "-Xcompiler", "-fPIC", "-shared")

_PKG = Path(__file__).resolve().parent

DEVICE_FUNCTIONS = ("bsr_install_strided", "bsr_gather_strided")
HOST_FUNCTIONS = ("bsr_host_install_strided", "bsr_host_gather_strided")


def source_dir() -> Path | None:
    """csrc/ beside the package (editable/source tree) or bsr_kernels/csrc (regular install)."""
    for d in (_PKG.parent / "csrc", _PKG / "csrc"):
        if (d / "bsr_install.cu").is_file():
            return d
    return None


def abi() -> NativeAbi:
    """The C interface as csrc/bsr_abi.h declares it (the sources the library is built from)."""
    return read_abi(source_dir())


def load(path: str | os.PathLike) -> ctypes.CDLL:
    """Load one library file, check the ABI version it reports against bsr_abi.h's and declare its
    functions from the header; raises OSError/RuntimeError (a stale build is refused before any of
    its functions is called)."""
    return abi().load(path, "cuda")


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    try:
        import nvidia.cuda_nvcc as wheel  # type: ignore[import-not-found]

        candidates.extend(Path(p) / "bin" / "nvcc" for p in wheel.__path__)
    except ImportError:
        pass
    return next((str(p) for p in candidates if p.is_file()), None)


def _cached_build(src: Path) -> Path | None:
    """The first-use build for the current GPU (compiling it if needed), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    sources = sorted(f for f in src.iterdir() if f.is_file() and f.suffix in (".cu", ".h", ".cuh"))
    out = cache_dir() / f"{sources_digest(sources)}-sm{arch}" / LIB_NAME
    nvcc = find_nvcc()
    if nvcc is None and not out.is_file():
        raise RuntimeError(f"{LIB_NAME} is not installed and nvcc was not found to build it at first use")
    gencode = ["-gencode", f"arch=compute_{arch},code=sm_{arch}",
               "-gencode", f"arch=compute_{arch},code=compute_{arch}"]
    return build_atomically(out, lambda tmp: [nvcc, *NVCC_FLAGS, *gencode, "-o", str(tmp), str(src / "bsr_install.cu")],
                            "nvcc")


def _warn_if_stale(lib: Path) -> None:
    src = source_dir()
    if src is None:
        return
    built = lib.stat().st_mtime
    newer = [f.name for f in src.iterdir() if f.is_file() and f.stat().st_mtime > built]
    if newer:
        warnings.warn(f"{lib} is older than {', '.join(sorted(newer))} in {src}: rebuild it "
                      "(pip install -e . --no-deps)", RuntimeWarning, stacklevel=3)


def _find() -> tuple[ctypes.CDLL, str]:
    """The installed library ($BSR_CUDA_LIB or bsr_kernels/lib), else a first-use build."""
    errors = []
    explicit = os.environ.get("BSR_CUDA_LIB")
    path = Path(explicit) if explicit else _PKG / "lib" / LIB_NAME
    if not path.is_file():
        errors.append(f"{path} not found")
    else:
        try:
            lib = load(path)
            _warn_if_stale(path)
            return lib, str(path)
        except (OSError, RuntimeError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    if not explicit:
        src = source_dir()
        try:
            built = _cached_build(src) if src is not None else None
            if built is not None:
                return load(built), str(built)
            errors.append("no first-use build: " + ("no CUDA device" if src is not None else "csrc/ sources not found"))
        except (OSError, RuntimeError, AttributeError) as e:
            errors.append(str(e))
    raise LibraryNotLoaded("; ".join(errors) + " (build it with BSR_BUILD_CUDA=1 pip install -e . and nvcc on PATH)")


_LIBRARY = LazyLibrary(_find)
library, library_path, load_error = _LIBRARY.get, _LIBRARY.path, _LIBRARY.error  # loaded on first use


def last_error(lib: ctypes.CDLL | None = None) -> str:
    lib = lib if lib is not None else library()
    if lib is None:
        return load_error() or "CUDA library not loaded"
    return (lib.bsr_last_error() or b"").decode(errors="replace")


def device_status() -> str:
    """One line on the CUDA situation; never raises. Contains "no CUDA device" when there is none."""
    try:
        lib = library()
        if lib is None:
            torch_side = f"{torch.cuda.device_count()} CUDA device(s) visible to torch" if torch.cuda.is_available() \
                else "no CUDA device visible to torch"
            return f"{torch_side}; CUDA library not loaded: {load_error()}"
        n = ctypes.c_int(0)
        if lib.bsr_device_count(ctypes.byref(n)) != 0:
            return last_error(lib)
        if not torch.cuda.is_available():
            return f"{n.value} CUDA device(s), but this torch build has no CUDA ({torch.__version__})"
        return f"{n.value} CUDA device(s); library {_LIBRARY.path()}"
    except Exception as e:  # a status line must not raise
        return f"CUDA status unknown: {type(e).__name__}: {e}"


def available() -> bool:
    """Library loaded, a CUDA device present, and torch built with CUDA."""
    try:
        lib = library()
        if lib is None or not torch.cuda.is_available():
            return False
        n = ctypes.c_int(0)
        return lib.bsr_device_count(ctypes.byref(n)) == 0 and n.value > 0
    except Exception:
        return False


# -- device calls ------------------------------------------------------------------------------
def _check_entries(reg: Registration) -> None:
    wide = [s.name for s in reg.specs if s.entry_bytes > MAX_ENTRY_BYTES]
    if wide:
        raise ValueError(f"entries wider than {MAX_ENTRY_BYTES} B are not supported by the CUDA kernels: {wide}")


def _device_staging(kind: str, a: WindowArgs, device: torch.device, zero_copy: bool,
                    chunk_bytes: int) -> tuple[torch.Tensor, int, bool]:
    """(the staging the kernel reads/writes, its chunk stride, whether it stands in for a.staging)."""
    staging, stride, n = a.staging, a.chunk_stride, a.num_chunks
    if staging.device.type == "cpu" and zero_copy:
        if not staging.is_pinned():
            raise ValueError(
                "zero_copy=True needs pinned host staging (torch.Tensor.pin_memory() or a StagingArena on "
                "a CUDA machine); this staging is pageable. Pin it or pass zero_copy=False to copy it "
                "to the device first."
            )
        return staging, stride, False  # read (gather: written) in place, gaps untouched
    if staging.device == device:
        return staging, stride, False
    if kind == "gather":  # gather writes every byte of the window: no need to copy the old contents
        return torch.empty(n * chunk_bytes, dtype=torch.uint8, device=device), chunk_bytes, True
    # install: one bulk copy of the span of the window's chunks, gaps between them included (one
    # DMA from pinned memory; the kernel skips the gaps), keeping the stride
    span = (n - 1) * stride + chunk_bytes
    flat = staging if staging.dim() == 1 else staging.as_strided((span,), (1,))
    return flat[:span].to(device, non_blocking=True), stride, True


def _run(kind: str, reg: Registration, a: WindowArgs, stream, zero_copy: bool, desc: torch.Tensor | None) -> None:
    if a.num_chunks == 0:
        return
    lib = library()
    if lib is None:
        raise RuntimeError(f"CUDA backend unavailable: {load_error()}")
    _check_entries(reg)
    device = a.kv[0].device
    if device.type != "cuda":
        raise ValueError(f"the CUDA backend needs destinations on a CUDA device, got {device}")
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        stream = stream if stream is not None else current
        if stream != current:
            stream.wait_stream(current)  # descriptors, tables and kv written on the current stream
        with torch.cuda.stream(stream):
            if desc is None:
                desc = descriptor_table(reg, a.kv, device)
            ptrs, tables = block_table_pointers(a.block_tables, device)
            staged, stride, copied = _device_staging(kind, a, device, zero_copy, reg.chunk_bytes)
            name = DEVICE_FUNCTIONS[kind == "gather"]
            rc = getattr(lib, name)(staged.data_ptr(), reg.chunk_bytes, stride, a.first_chunk, a.num_chunks,
                                    desc.data_ptr(), reg.num_tensors, ptrs.data_ptr(), reg.num_groups,
                                    ctypes.c_void_p(stream.cuda_stream))
            if rc != 0:
                raise RuntimeError(f"{name}: {last_error(lib)}")
            for t in (desc, ptrs, *tables, *((staged,) if staged.device.type == "cuda" else ())):
                t.record_stream(stream)  # keep them allocated until the kernel has run
            if kind == "gather" and copied:  # back to the host: the chunks' rows only, never the gaps
                if a.staging.dim() == 2:
                    a.staging[: a.num_chunks].copy_(staged.view(a.num_chunks, reg.chunk_bytes),
                                                    non_blocking=a.staging.is_pinned())
                else:
                    a.staging[: staged.numel()].copy_(staged, non_blocking=a.staging.is_pinned())


def install(reg: Registration, a: WindowArgs, stream=None, zero_copy: bool = True,
            desc: torch.Tensor | None = None) -> None:
    """One launch: scatter the window's staged chunks into every tensor's destination blocks
    (`desc`: the destinations' descriptor table on their device, when the caller has it)."""
    _run("install", reg, a, stream, zero_copy, desc)


def gather(reg: Registration, a: WindowArgs, stream=None, zero_copy: bool = True,
           desc: torch.Tensor | None = None) -> None:
    """One launch: the inverse of install (-1 entries and segment padding read as zero)."""
    _run("gather", reg, a, stream, zero_copy, desc)


# -- host emulation (tests) --------------------------------------------------------------------
def _host_call(kind: str, reg: Registration, a: WindowArgs, lib: ctypes.CDLL | None, split: int) -> None:
    lib = lib if lib is not None else library()
    if lib is None:
        raise RuntimeError(f"CUDA library not loaded: {load_error()}")
    cpu = torch.device("cpu")
    tensors = (a.staging, *a.kv, *a.block_tables)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("host_install/host_gather need CPU tensors")
    if a.num_chunks == 0:
        return
    desc = descriptor_table(reg, a.kv, cpu)
    ptrs, tables = block_table_pointers(a.block_tables, cpu)
    fn = getattr(lib, HOST_FUNCTIONS[kind == "gather"])
    rc = fn(a.staging.data_ptr(), reg.chunk_bytes, a.chunk_stride, a.first_chunk, a.num_chunks,
            desc.data_ptr(), reg.num_tensors, ptrs.data_ptr(), reg.num_groups, split)
    del tables
    if rc != 0:
        raise RuntimeError(f"bsr_host_{kind}: {last_error(lib)}")


def host_install(reg: Registration, a: WindowArgs, lib: ctypes.CDLL | None = None, split: int = 0) -> None:
    """The kernel's piece/batch/unit code run on CPU tensors (split 0 = the launch heuristic)."""
    _host_call("install", reg, a, lib, split)


def host_gather(reg: Registration, a: WindowArgs, lib: ctypes.CDLL | None = None, split: int = 0) -> None:
    _host_call("gather", reg, a, lib, split)


def access_width(entry_bytes: int, seg_offset: int, chunk_stride: int, block_stride: int, staging_addr: int,
                 dst_addr: int, lib: ctypes.CDLL | None = None) -> int:
    """The vector width (bytes) the kernels use for one tensor, from the shared header
    (`chunk_stride`: bytes from one staged chunk to the next; chunk_bytes for 1-D staging)."""
    lib = lib if lib is not None else library()
    if lib is None:
        raise RuntimeError(f"CUDA library not loaded: {load_error()}")
    w = ctypes.c_int(0)
    if lib.bsr_host_access_width(entry_bytes, seg_offset, chunk_stride, block_stride, staging_addr, dst_addr,
                                 ctypes.byref(w)):
        raise RuntimeError(last_error(lib))
    return w.value


def run_width(src_addr: int, dst_addr: int, nbytes: int, lib: ctypes.CDLL | None = None) -> int:
    """The vector width (bytes) the kernels use for one contiguous run of a packed tensor."""
    lib = lib if lib is not None else library()
    if lib is None:
        raise RuntimeError(f"CUDA library not loaded: {load_error()}")
    w = ctypes.c_int(0)
    if lib.bsr_host_run_width(src_addr, dst_addr, nbytes, ctypes.byref(w)):
        raise RuntimeError(last_error(lib))
    return w.value
