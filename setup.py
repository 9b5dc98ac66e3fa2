"""Build hook: compiles csrc/ into C-ABI shared libraries inside bsr_kernels.

- libbsr_cuda.so from csrc/bsr_install.cu when nvcc is found. BSR_BUILD_CUDA=1 forces the build
  (an nvcc error fails the install), =0 skips it. Without nvcc the package installs without it.
- libbsr_cpu.so (the "cpu" backend, CRC-32C) from csrc/*.c with the system C compiler ($CC,
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
from collections.abc import Callable
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
CPU_SOURCES = sorted(str(f) for f in CSRC.glob("*.c"))  # the library: every .c file (pool, crc32c, install)
CPU_LIB_NAME = "libbsr_cpu.so"
# hidden by default: the library exports only what csrc/bsr_abi.h declares (BSR_CPU_API)
CC_FLAGS = ["-std=c11", "-O3", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden"]


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


def _build_library(what: str, env: str, source: Path, lib: Path, compiler: str | None, compiler_name: str,
                   cmd_for: Callable[[str, Path], list[str]], suffixes: tuple[str, ...], fallback: str) -> Path | None:
    """Compile `source` into `lib` unless `env`=0; returns the library path or None when skipped.
    `env`=1 turns every reason to skip into an install error."""
    mode = os.environ.get(env, "").strip()
    if mode == "0":
        _say(f"{env}=0, {what} library skipped; {fallback}")
        return None
    forced = mode == "1"

    def skip(reason: str) -> None:
        if forced:
            raise RuntimeError(f"bsr: {env}=1 but {reason}")
        _say(f"{reason}, {what} library skipped; {fallback}")

    if not source.is_file():  # e.g. an sdist made without csrc/
        return skip(f"{source} is missing")
    if compiler is None:
        return skip(f"no {compiler_name} was found")
    if _up_to_date(lib, suffixes):
        _say(f"{what} library up to date: {lib}")
        return lib
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
    cmd = cmd_for(compiler, tmp)
    _say(f"building {what} library: " + " ".join(cmd))
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        tmp.unlink(missing_ok=True)
        return skip(f"{compiler_name} failed ({e})")
    os.replace(tmp, lib)
    _say(f"built {lib} in {time.monotonic() - t0:.1f} s")
    return lib


def build_cpu_library() -> Path | None:
    """Compile csrc/*.c with the system C compiler (BSR_BUILD_CPU=0 skips, =1 forces)."""
    return _build_library("CPU", "BSR_BUILD_CPU", CPU_SOURCE, LIB_DIR / CPU_LIB_NAME, find_cc(),
                          "C compiler ($CC, cc, gcc, clang)",
                          lambda cc, out: [cc, *CC_FLAGS, "-o", str(out), *CPU_SOURCES], (".c", ".h"),
                          "the torch backend serves CPU destinations")


def build_cuda_library() -> Path | None:
    """Compile csrc/bsr_install.cu with nvcc (BSR_BUILD_CUDA=0 skips, =1 forces)."""
    gencode = os.environ.get("BSR_CUDA_GENCODE", "").split() or GENCODE
    return _build_library("CUDA", "BSR_BUILD_CUDA", SOURCE, LIB_DIR / LIB_NAME, find_nvcc(),
                          "nvcc (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)",
                          lambda nvcc, out: [nvcc, *NVCC_FLAGS, *gencode, "-o", str(out), str(SOURCE)],
                          (".cu", ".cuh", ".h"), "torch/Triton backends serve GPU destinations")


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
