"""The C interface is declared once, in csrc/bsr_abi.h: the reader (bsr_kernels/native_abi.py), the
sources' definitions against it, the libraries' exported symbols against it, a planted disagreement
failing the build, and no Python signature written anywhere else."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bsr_kernels import cpu_backend, cuda_backend
from bsr_kernels.native_abi import AbiError, parse, read_abi

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
_VERSIONS = "#define BSR_CPU_ABI_VERSION 7\n#define BSR_CUDA_ABI_VERSION 9\n"
_VERSION_FNS = "BSR_CPU_API int bsr_cpu_abi_version(void);\nBSR_CUDA_API int bsr_abi_version(void);\n"


def test_reader_turns_prototypes_into_ctypes():
    text = _VERSIONS + _VERSION_FNS + """
/* BSR_CPU_API int commented_out(int x); */
#define BSR_CPU_API BSR_EXTERN_C __attribute__((visibility("default")))
BSR_CPU_API const char* f_error(void);
BSR_CPU_API int64_t f_mixed(void* a, const int64_t *b, int64_t c,
                            uint32_t d, uint64_t e, size_t f, int* out, void** many);
BSR_CUDA_API uint32_t g(int  x);
"""
    abi = parse(text)
    assert abi.versions == {"cpu": 7, "cuda": 9}
    assert set(abi.functions) == {"bsr_cpu_abi_version", "bsr_abi_version", "f_error", "f_mixed", "g"}
    error, mixed, g = abi.functions["f_error"], abi.functions["f_mixed"], abi.functions["g"]
    assert (error.library, error.restype, error.argtypes) == ("cpu", ctypes.c_char_p, ())
    assert mixed.restype is ctypes.c_int64
    assert mixed.argtypes == (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64,
                              ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
    assert (g.library, g.restype, g.argtypes) == ("cuda", ctypes.c_uint32, (ctypes.c_int,))


@pytest.mark.parametrize("text,match", [
    (_VERSION_FNS + "#define BSR_CPU_ABI_VERSION 1\n", "no #define BSR_CUDA_ABI_VERSION"),
    (_VERSIONS + "BSR_CPU_API int bsr_cpu_abi_version(void);\n", "no prototype of bsr_abi_version"),
    (_VERSIONS + _VERSION_FNS + "BSR_CPU_API long f(int x);\n", "unsupported C type 'long'"),
    (_VERSIONS + _VERSION_FNS + "BSR_CPU_API int f(unsigned x);\n", "unsupported C type 'unsigned'"),
    (_VERSIONS + _VERSION_FNS + "BSR_CPU_API int f(int64_t);\n", "cannot read the parameter 'int64_t'"),
    (_VERSIONS + _VERSION_FNS + "BSR_CPU_API int f(void);\nBSR_CPU_API int f(void);\n", "f is declared twice"),
])
def test_reader_refuses_what_it_cannot_declare(text, match):
    with pytest.raises(AbiError, match=match):
        parse(text)


def test_missing_header_is_a_clear_error(tmp_path):
    with pytest.raises(AbiError, match="bsr_abi.h not found"):
        read_abi(tmp_path)


_DEFINITION = re.compile(r"\b(BSR_CPU_API|BSR_CUDA_API)\s+([^;{}()]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*\{")


def test_every_exported_definition_is_the_headers_prototype():
    """Each BSR_*_API definition in the sources, read as a prototype, is the header's declaration of
    that function (the compiler checks the types too: see the planted disagreement below)."""
    abi = read_abi(CSRC)
    as_prototypes = [_VERSIONS]
    for src in sorted([*CSRC.glob("*.c"), *CSRC.glob("*.cu")]):
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", src.read_text(), flags=re.S)
        as_prototypes += [f"{marker} {result} {name}({params});" for marker, result, name, params in
                          _DEFINITION.findall(text)]
    defined = parse("\n".join(as_prototypes)).functions
    assert set(defined) == set(abi.functions), "defined and declared functions differ"
    for name, proto in defined.items():
        assert proto == abi.functions[name], name


def _exported(lib: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith("bsr_")}


def test_cpu_library_exports_exactly_the_header(monkeypatch, tmp_path):
    if cpu_backend.find_cc() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("BSR_CACHE_DIR", str(tmp_path))
    built = cpu_backend._cached_build(cpu_backend.source_dir())
    assert _exported(built) == {p.name for p in cpu_backend.abi().of("cpu")}


def test_cuda_library_exports_exactly_the_header():
    path = cuda_backend.library_path()
    if path is None:
        pytest.skip(f"no CUDA library: {cuda_backend.load_error()}")
    assert _exported(Path(path)) == {p.name for p in cuda_backend.abi().of("cuda")}


def _build_copy(tmp_path: Path, edit_header) -> subprocess.CompletedProcess:
    src = tmp_path / f"csrc{len(list(tmp_path.iterdir()))}"
    shutil.copytree(CSRC, src)
    header = src / "bsr_abi.h"
    header.write_text(edit_header(header.read_text()))
    sources = [str(f) for f in sorted(src.glob("*.c"))]
    return subprocess.run([cpu_backend.find_cc(), *cpu_backend.CC_FLAGS, "-o", str(tmp_path / "lib.so"), *sources],
                          capture_output=True, text=True)


def test_a_prototype_that_disagrees_with_its_definition_fails_the_build(tmp_path):
    if cpu_backend.find_cc() is None:
        pytest.skip("no C compiler")
    assert _build_copy(tmp_path, lambda h: h).returncode == 0
    proc = _build_copy(tmp_path, lambda h: h.replace("bsr_cpu_stream_bytes(int into, int64_t bytes)",
                                                     "bsr_cpu_stream_bytes(int into, int bytes)"))
    assert proc.returncode != 0 and "bsr_cpu_stream_bytes" in proc.stderr


def test_a_library_without_a_declared_function_is_refused(tmp_path):
    """A library that reports the right version but lacks a function of the header never loads."""
    cc = cpu_backend.find_cc()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "partial.c"
    src.write_text(f"int bsr_cpu_abi_version(void) {{ return {cpu_backend.abi().versions['cpu']}; }}\n")
    lib = tmp_path / "libpartial.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(AttributeError, match="bsr_cpu_last_error"):
        cpu_backend.load(lib)


def test_no_python_code_declares_a_signature():
    """The packages' functions get argtypes and restype in one place, from the header: nothing in
    bsr_kernels sets them elsewhere, nothing outside it sets them on a bsr_* function (the runtime
    declares libc's syscall and google_crc32c's functions, which are not ours)."""
    offenders = []
    for package in ("bsr_kernels", "bsr_runtime", "bsr_harness", "benchmarks", "tests"):
        own = r"\.(argtypes|restype)\s*=" if package == "bsr_kernels" else r"\bbsr_\w+\s*\.\s*(argtypes|restype)\s*="
        for f in (ROOT / package).rglob("*.py"):
            if f.name != "native_abi.py" and re.search(own, f.read_text()):
                offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []
