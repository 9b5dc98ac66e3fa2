"""Build hook: compiles csrc/ into C-ABI shared libraries inside bsr_kernels.

- libbsr_cuda.so from csrc/bsr_install.cu when nvcc is found. BSR_BUILD_CUDA=1 forces the build
  (an nvcc error fails the install), =0 skips it. Without nvcc the package installs without it.
- libbsr_cpu.so (the "cpu" backend) from csrc/bsr_install_cpu.c with the system C compiler ($CC,
  else cc, gcc or clang). BSR_BUILD_CPU=1 forces it, =0 skips it. Without a compiler the package
  installs without it and backend "auto" falls back to torch on CPU destinations.
Each skip is said in one line.

The library goes to bsr_kernels/lib/libbsr_cuda.so in the source tree (what an editable
install imports) and, for regular installs, into the build tree too, with a copy of csrc/
under bsr_kernels/csrc/ for the first-use compile fallback of bsr_kernels.cuda_backend.
It is rebuilt only when a file in csrc/ is newer than it. nvcc links cudart statically, so
the library loads on machines without libcudart (it then reports "no CUDA device").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
SOURCE = CSRC / "bsr_install.cu"
LIB_NAME = "libbsr_cuda.so"
LIB_DIR = ROOT / "bsr_kernels" / "lib"
# sm_90 SASS plus compute_90 PTX (newer GPUs JIT the PTX); BSR_CUDA_GENCODE overrides.
GENCODE = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
NVCC_FLAGS = ["-O3", "-Xcompiler", "-fPIC", "-shared"]


def _say(msg: str) -> None:
    print(f"bsr: {msg}", file=sys.stderr, flush=True)


def find_nvcc() -> str | None:
    """nvcc on PATH, else $CUDA_HOME/bin (or $CUDA_PATH/bin), else /usr/local/cuda/bin."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


CPU_SOURCE = CSRC / "bsr_install_cpu.c"
CPU_LIB_NAME = "libbsr_cpu.so"
CC_FLAGS = ["-std=c11", "-O3", "-fPIC", "-shared", "-pthread"]


def _up_to_date(lib: Path, suffixes: tuple[str, ...] = (".cu", ".cuh", ".h")) -> bool:
    if not lib.is_file():
        return False
    built = lib.stat().st_mtime
    return all(f.stat().st_mtime < built for f in CSRC.iterdir() if f.is_file() and f.suffix in suffixes)


def find_cc() -> str | None:
    """$CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def build_cpu_library() -> Path | None:
    """Compile csrc/bsr_install_cpu.c into bsr_kernels/lib; returns the library path or None when skipped."""
    mode = os.environ.get("BSR_BUILD_CPU", "").strip()
    if mode == "0":
        _say("BSR_BUILD_CPU=0, CPU library skipped; the torch backend serves CPU destinations")
        return None
    forced = mode == "1"
    lib = LIB_DIR / CPU_LIB_NAME
    if not CPU_SOURCE.is_file():
        if forced:
            raise RuntimeError(f"bsr: BSR_BUILD_CPU=1 but {CPU_SOURCE} is missing")
        _say(f"{CPU_SOURCE} not found, CPU library skipped; the torch backend serves CPU destinations")
        return None
    cc = find_cc()
    if cc is None:
        if forced:
            raise RuntimeError("bsr: BSR_BUILD_CPU=1 but no C compiler ($CC, cc, gcc, clang) was found")
        _say("no C compiler found, CPU library skipped; the torch backend serves CPU destinations")
        return None
    if _up_to_date(lib, (".c", ".h")):
        _say(f"CPU library up to date: {lib}")
        return lib
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{CPU_LIB_NAME}.{os.getpid()}.tmp")
    cmd = [cc, *CC_FLAGS, "-o", str(tmp), str(CPU_SOURCE)]
    _say("building CPU library: " + " ".join(cmd))
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        tmp.unlink(missing_ok=True)
        if forced:
            raise RuntimeError(f"bsr: the C compiler failed ({e}); BSR_BUILD_CPU=1 makes this fatal") from e
        _say(f"the C compiler failed ({e}), CPU library skipped; the torch backend serves CPU destinations")
        return None
    os.replace(tmp, lib)
    _say(f"built {lib}")
    return lib


def build_cuda_library() -> Path | None:
    """Compile csrc/ into bsr_kernels/lib; returns the library path or None when skipped."""
    mode = os.environ.get("BSR_BUILD_CUDA", "").strip()
    if mode == "0":
        _say("BSR_BUILD_CUDA=0, CUDA library skipped; torch/Triton backends only")
        return None
    forced = mode == "1"
    lib = LIB_DIR / LIB_NAME
    if not SOURCE.is_file():  # e.g. an sdist made without csrc/
        if forced:
            raise RuntimeError(f"bsr: BSR_BUILD_CUDA=1 but {SOURCE} is missing")
        _say(f"{SOURCE} not found, CUDA library skipped; torch/Triton backends only")
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        if forced:
            raise RuntimeError("bsr: BSR_BUILD_CUDA=1 but nvcc was not found on PATH or in $CUDA_HOME/bin")
        _say("nvcc not found, CUDA library skipped; torch/Triton backends only")
        return None
    if _up_to_date(lib):
        _say(f"CUDA library up to date: {lib}")
        return lib
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    gencode = os.environ.get("BSR_CUDA_GENCODE", "").split() or GENCODE
    tmp = lib.with_name(f".{LIB_NAME}.{os.getpid()}.tmp")
    cmd = [nvcc, *NVCC_FLAGS, *gencode, "-o", str(tmp), str(SOURCE)]
    _say("building CUDA library: " + " ".join(cmd))
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        tmp.unlink(missing_ok=True)
        if forced:
            raise RuntimeError(f"bsr: nvcc failed ({e}); BSR_BUILD_CUDA=1 makes this fatal") from e
        _say(f"nvcc failed ({e}), CUDA library skipped; torch/Triton backends only")
        return None
    os.replace(tmp, lib)
    _say(f"built {lib} in {time.monotonic() - t0:.1f} s")
    return lib


class BuildPyWithLibraries(build_py):
    def run(self) -> None:
        libs = [lib for lib in (build_cuda_library(), build_cpu_library()) if lib is not None]
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install imports bsr_kernels/lib from the source tree
        pkg = Path(self.build_lib) / "bsr_kernels"
        for lib in libs:
            (pkg / "lib").mkdir(parents=True, exist_ok=True)
            self.copy_file(str(lib), str(pkg / "lib" / lib.name))
            _say(f"library packaged: {pkg / 'lib' / lib.name}")
        (pkg / "csrc").mkdir(parents=True, exist_ok=True)
        for f in sorted(CSRC.iterdir()):
            if f.is_file() and f.suffix in (".cu", ".h", ".cuh", ".c"):
                self.copy_file(str(f), str(pkg / "csrc" / f.name))


setup(cmdclass={"build_py": BuildPyWithLibraries})
