"""install_window / gather_window and WindowInstaller: one contract, backends "torch" | "triton" |
"cuda" | "cpu" | "auto" (backends.py says which runs).

Both entry points validate everything before any byte moves. What depends only on the destinations
(their checks, the descriptor table) is prepared once per layout and reused (prepared.py), so the
one-shot calls repeated on the same destinations pay one pass over the tensors' metadata, their
staging and their chunks' block-table entries; a WindowInstaller pays only the staging and the chunk
range per window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import BACKENDS, RunOptions, available_backends, get_backend, resolve_backend
from .prepared import PreparedDestinations, prepare
from .registration import Registration
from .validate import WindowArgs, check_block_tables, check_chunk_range, check_fingerprint, check_staging

__all__ = ["BACKENDS", "WindowInstaller", "available_backends", "gather_window", "install_window", "resolve_backend"]


def _one_shot(kind: str, staging: torch.Tensor, reg: Registration, kv: Sequence[torch.Tensor],
              block_tables: Sequence[torch.Tensor], first_chunk: int, num_chunks: int, *, name: str,
              backend: str, stream: torch.cuda.Stream | None, fingerprint: str | None, zero_copy: bool,
              cpu_threads: int, end_tokens: int | None = None) -> str:
    check_fingerprint(reg, fingerprint)
    first_chunk, num_chunks = check_chunk_range(first_chunk, num_chunks)
    stride = check_staging(staging, reg, num_chunks, name)
    kv = tuple(kv)
    dest = prepare(reg, kv, backend, resolve_backend)
    tables = check_block_tables(reg, block_tables, first_chunk, num_chunks, dest.layout, end_tokens=end_tokens,
                                gather=kind == "gather")
    a = WindowArgs(staging, kv, tables, first_chunk, num_chunks, stride)
    dest.run(kind, a, stream=stream, zero_copy=zero_copy, cpu_threads=_threads(cpu_threads))
    return dest.backend


def install_window(
    staging: torch.Tensor,
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
    fingerprint: str | None = None,
    zero_copy: bool = True,
    cpu_threads: int = 0,
) -> str:
    """Scatter `num_chunks` staged chunks (chunk-major, starting at request chunk `first_chunk`)
    into the destination blocks. Returns the backend that ran.

    `staging` is 1-D contiguous uint8 (chunk c at byte c * reg.chunk_bytes) or 2-D uint8 of shape
    (>= num_chunks, reg.chunk_bytes), one row per chunk, with stride(1) == 1 and a chunk stride
    stride(0) >= chunk_bytes that is a multiple of 16 (e.g. `buf.view(n, stride)[:, headroom:]`:
    scratch bytes before each chunk). Bytes between rows are never read into destinations.

    Entry e of tensor t lands in block `block_tables[group][e // block_size]`, slot
    `e % block_size`; block id -1 is skipped (legal only in groups with a sliding window). Each
    destination may be any strided view of shape (num_blocks, block_size, *entry_shape) whose
    innermost dim has stride 1 (vLLM CPU, FlashAttention, FlashInfer HND, MLA row slices); no two
    destinations may share a byte, except destinations of different groups that are the same memory
    block for block (vLLM's hybrid allocator) when no block id is resident in both groups' tables.
    The staged layout stays canonical whatever the destination layout. `fingerprint`, when
    given, is the registration fingerprint the staged objects were written under. Everything is
    validated before any byte moves. With the CUDA backend and pinned host staging, `zero_copy` reads host memory
    directly; otherwise the staging must be (or is copied) on the destination device. With the
    cpu backend, `cpu_threads` forces a thread count (0: one, two above the library's size threshold).

    Repeated calls on destinations of one layout reuse their validation (prepared.py); a loop over
    the windows of one request is cheaper still with a WindowInstaller, which also checks the
    block tables once.
    """
    return _one_shot("install", staging, reg, kv, block_tables, first_chunk, num_chunks, name="staging",
                     backend=backend, stream=stream, fingerprint=fingerprint, zero_copy=zero_copy,
                     cpu_threads=cpu_threads)


def gather_window(
    out: torch.Tensor,
    reg: Registration,
    kv: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    first_chunk: int,
    num_chunks: int,
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
    zero_copy: bool = True,
    cpu_threads: int = 0,
    end_tokens: int | None = None,
) -> str:
    """Exact inverse of install_window: copy the window's entries from the destination blocks
    into `out` (chunk-major staging layout, 1-D or 2-D chunk-strided as for install_window).
    Padding and entries of -1 blocks read as zero; bytes between the rows of a 2-D `out` are
    never written. `end_tokens`: a prefix ending inside the window's last chunk (blocks past it -1)."""
    return _one_shot("gather", out, reg, kv, block_tables, first_chunk, num_chunks, name="out", backend=backend,
                     stream=stream, fingerprint=None, zero_copy=zero_copy, cpu_threads=cpu_threads,
                     end_tokens=end_tokens)


def _threads(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"cpu_threads must be a non-negative integer (0 = auto), got {n!r}")
    return int(n)


class WindowInstaller:
    """install_window for the windows of one request, validated and prepared once.

    The destinations and block tables are checked for chunks 0..num_chunks-1 when the installer
    is made (`local_tokens`: the blocks of those first tokens are the engine's own, -1 here in any
    group: never written; `end_tokens`: a prefix ending inside its last chunk, the blocks past it
    -1) (block tables are copied, so the request cannot change them underneath), and the
    per-restore state is built then (prepared.py: destination views or the descriptor table);
    each window then checks only its staging and its chunk range and passes just those. Same
    results as install_window / gather_window.
    """

    def __init__(self, reg: Registration, kv: Sequence[torch.Tensor], block_tables: Sequence[torch.Tensor],
                 num_chunks: int, *, backend: str = "auto", stream: torch.cuda.Stream | None = None,
                 fingerprint: str | None = None, zero_copy: bool = True, cpu_threads: int = 0,
                 local_tokens: int = 0, end_tokens: int | None = None) -> None:
        check_fingerprint(reg, fingerprint)
        _, num_chunks = check_chunk_range(0, num_chunks)
        self.kv = tuple(kv)
        self._dest: PreparedDestinations = prepare(reg, self.kv, backend, resolve_backend)
        tables = check_block_tables(reg, block_tables, 0, num_chunks, self._dest.layout, local_tokens, end_tokens)
        self.reg = reg
        self.num_chunks = num_chunks
        self.backend = self._dest.backend
        # copied (the request cannot change them underneath) and, for GPU backends, uploaded once
        # per restore: each window then reuses the device tables and their cached pointer table
        device = self._dest.device if get_backend(self.backend).tables_on_device else tables[0].device
        self.block_tables = tuple(t.to(device, copy=True) for t in tables)
        self.stream = stream
        self.zero_copy = zero_copy
        self.cpu_threads = _threads(cpu_threads)
        # each window calls the backend's window call straight (prepared.py's run, without its frame)
        self._run = get_backend(self.backend).run
        self._options = RunOptions(stream, zero_copy, self.cpu_threads)

    def _args(self, staging: torch.Tensor, first_chunk: int, num_chunks: int, name: str) -> WindowArgs:
        """One window's arguments, its chunk range and staging checked."""
        if first_chunk < 0 or num_chunks < 0 or first_chunk + num_chunks > self.num_chunks:
            raise ValueError(f"chunks {first_chunk}..{first_chunk + num_chunks - 1} are outside the "
                             f"{self.num_chunks} chunks this installer was validated for")
        stride = check_staging(staging, self.reg, num_chunks, name)
        return WindowArgs(staging, self.kv, self.block_tables, first_chunk, num_chunks, stride)

    def install(self, staging: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        """Scatter `num_chunks` staged chunks starting at request chunk `first_chunk`."""
        a = self._args(staging, first_chunk, num_chunks, "staging")
        if num_chunks:
            self._run("install", self.reg, self._dest.state, a, self._options)
        return self.backend

    def gather(self, out: torch.Tensor, first_chunk: int, num_chunks: int) -> str:
        """The inverse: the window's entries into `out` (padding and -1 entries as zero)."""
        a = self._args(out, first_chunk, num_chunks, "out")
        if num_chunks:
            self._run("gather", self.reg, self._dest.state, a, self._options)
        return self.backend
