"""The C interface of the native libraries, read from csrc/bsr_abi.h: the one place it is declared.

`read_abi(header)` parses the header's prototypes (BSR_CPU_API: libbsr_cpu.so, BSR_CUDA_API:
libbsr_cuda.so) and version macros; `NativeAbi.load(path, library)` opens a library, refuses one
that reports another version than the header's, and gives each of its functions the ctypes result
and argument types its prototype says. Pointers are declared as addresses (c_void_p): callers pass
a tensor's data_ptr(), a numpy array's ctypes.data, None or ctypes.byref(...).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HEADER = "bsr_abi.h"
LIBRARIES = {"cpu": ("BSR_CPU_API", "BSR_CPU_ABI_VERSION", "bsr_cpu_abi_version"),
             "cuda": ("BSR_CUDA_API", "BSR_CUDA_ABI_VERSION", "bsr_abi_version")}

_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32,
            "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t}
_PROTOTYPE = re.compile(r"\b(BSR_CPU_API|BSR_CUDA_API)\s+([^;{}()]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;")
_VERSION = re.compile(r"#define\s+(BSR_\w+_ABI_VERSION)\s+(\d+)\b")


class AbiError(RuntimeError):
    """The header cannot be read as the interface, or a library does not match it."""


@dataclass(frozen=True)
class Prototype:
    library: str  # "cpu" | "cuda"
    name: str
    restype: type | None
    argtypes: tuple[type, ...]


@dataclass(frozen=True)
class NativeAbi:
    header: Path
    versions: dict[str, int]  # library -> the version its ABI function must report
    functions: dict[str, Prototype]

    def of(self, library: str) -> list[Prototype]:
        return [p for p in self.functions.values() if p.library == library]

    def load(self, path: str | os.PathLike, library: str, *, holds_gil: bool = False) -> ctypes.CDLL:
        """Open `path`, check the version it reports, declare every function of `library`.
        A stale build (another version) is refused before any other symbol is looked up. `holds_gil`:
        its functions are called without giving the GIL up (ctypes.PyDLL), for calls of microseconds."""
        lib = (ctypes.PyDLL if holds_gil else ctypes.CDLL)(str(path))
        version_fn = _declare(lib, self.functions[LIBRARIES[library][2]])
        version = version_fn()
        if version != self.versions[library]:
            raise AbiError(f"{path}: ABI version {version}, this package needs {self.versions[library]} "
                           f"({self.header.name}): a stale build; rebuild it with `pip install -e . --no-deps` "
                           f"(BSR_BUILD_CUDA=1 for the CUDA library) or delete it")
        for proto in self.of(library):
            _declare(lib, proto)
        return lib


def _declare(lib: ctypes.CDLL, proto: Prototype):
    fn = getattr(lib, proto.name)  # AttributeError: the library lacks a declared function
    fn.restype, fn.argtypes = proto.restype, list(proto.argtypes)
    return fn


def c_type(text: str, *, result: bool) -> type | None:
    """The ctypes type of a C type as the header writes it (spaces around '*' are ignored)."""
    t = re.sub(r"\s*\*\s*", "*", " ".join(text.split()))
    if t == "void":
        if result:
            return None
        raise AbiError("void is a parameter type only as (void)")
    if t == "const char*" and result:
        return ctypes.c_char_p
    if t.endswith("*"):
        return ctypes.c_void_p
    if t.startswith("const "):
        t = t[len("const "):]
    if t in _SCALARS:
        return _SCALARS[t]
    raise AbiError(f"unsupported C type {text!r} in {HEADER}")


def _parameters(text: str, name: str) -> tuple[type, ...]:
    text = " ".join(text.split())
    if text in ("", "void"):
        return ()
    out = []
    for param in text.split(","):
        m = re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*", param)
        if m is None or m[1].strip() in ("", "const"):
            raise AbiError(f"{name}: cannot read the parameter {param.strip()!r} (a type and a name)")
        out.append(c_type(m[1], result=False))
    return tuple(out)


def parse(text: str, header: Path = Path(HEADER)) -> NativeAbi:
    """The interface declared in header text: comments ignored, one prototype per declaration."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    declarations = re.sub(r"^\s*#[^\n]*", " ", code, flags=re.M)  # no macro definitions
    marker_of = {marker: library for library, (marker, _, _) in LIBRARIES.items()}
    functions: dict[str, Prototype] = {}
    for marker, result, name, params in _PROTOTYPE.findall(declarations):
        if name in functions:
            raise AbiError(f"{header.name}: {name} is declared twice")
        functions[name] = Prototype(marker_of[marker], name, c_type(result, result=True), _parameters(params, name))
    found = dict(_VERSION.findall(code))
    versions = {}
    for library, (_, macro, version_fn) in LIBRARIES.items():
        if macro not in found:
            raise AbiError(f"{header.name}: no #define {macro}")
        if version_fn not in functions:
            raise AbiError(f"{header.name}: no prototype of {version_fn}")
        versions[library] = int(found[macro])
    return NativeAbi(header, versions, functions)


@lru_cache(maxsize=4)
def _read(header: Path, mtime_ns: int) -> NativeAbi:
    return parse(header.read_text(), header)


def read_abi(src: Path | None) -> NativeAbi:
    """The interface declared in `src`/bsr_abi.h (the csrc/ the libraries are built from)."""
    if src is None or not (src / HEADER).is_file():
        raise AbiError(f"{HEADER} not found (looked in {src}): the native libraries' interface is read from it")
    header = src / HEADER
    return _read(header, header.stat().st_mtime_ns)
