"""A digest of a model checkpoint's weights that is cheap at every engine start, whatever its size.

Objects in a tier are bound to the model that computed them (the key space's model identity): a
checkpoint rewritten in place (same path, same shapes, other values) must miss, a checkpoint merely
opened again or copied elsewhere must hit. Hashing 100+ GB at every start is out of the question,
so the digest covers, for the checkpoint's top-level files:

- `config.json` / `params.json`: whole;
- each `*.safetensors` file: its size, its whole header (tensor names, dtypes, shapes, offsets and
  `__metadata__`), and of every tensor's bytes the first, middle and last SAMPLE_BYTES (the whole
  tensor when it is smaller than three samples; samples less than a page apart are read, and
  digested, as one range). A file whose header is no JSON object is sampled like the other weight
  files below; a header that places a tensor's bytes anywhere but two integers within the file
  (a string, a float, past the end) is a ValueError naming the file and the tensor;
- other weight files (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`, `*.gguf`): their size and
  OTHER_FILE_SAMPLES evenly spaced samples of SAMPLE_BYTES, first and last included.

Names and sizes are included, paths and modification times are not (a copy hits). What it does not
see: a change confined to bytes no sample covers (a few values in the middle of a tensor), files
in subdirectories, and anything outside the files (engine arguments that change the computation).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config_schema import short_repr
from .tiers.fs_open import open_regular

CONFIG_FILES = ("config.json", "params.json")
SAFETENSORS_SUFFIX = ".safetensors"
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf")
SAMPLE_BYTES = 1024
OTHER_FILE_SAMPLES = 64
MERGE_GAP = 4096  # samples closer than this (one page) are read as one range
MAX_READ = 1 << 20  # ... of at most about this many bytes (a run of small tensors read whole)
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit
DIGEST_VERSION = b"bsr-weights-1"
_READERS = 8  # files digested at once (a sharded checkpoint on network storage gains from queue depth)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files of a checkpoint the digest covers: a single weight file, or a directory's top-level
    config and weight files, sorted by name. A directory with no weight file is an error."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(p)!r}")
    files = sorted(f for f in p.iterdir() if f.is_file() and _covered(f.name))
    if not any(f.name not in CONFIG_FILES for f in files):
        raise ValueError(f"{str(p)!r} holds no weight file (*{SAFETENSORS_SUFFIX}, "
                         f"{', '.join('*' + s for s in OTHER_WEIGHT_SUFFIXES)})")
    return files


def _covered(name: str) -> bool:
    return name in CONFIG_FILES or name.endswith((SAFETENSORS_SUFFIX, *OTHER_WEIGHT_SUFFIXES))


def checkpoint_digest(path: str | os.PathLike) -> str:
    """The weights digest of a checkpoint (directory or single file): 32 hex digits."""
    files = checkpoint_files(path)
    with ThreadPoolExecutor(min(_READERS, len(files))) as pool:
        per_file = list(pool.map(file_digest, files))
    h = hashlib.blake2b(DIGEST_VERSION, digest_size=16)
    for f, d in zip(files, per_file):
        h.update(_framed(f.name.encode()))
        h.update(d)
    return h.hexdigest()


def file_digest(path: Path) -> bytes:
    """The digest of one file of a checkpoint (what the module docstring says is read of it)."""
    h = hashlib.blake2b(digest_size=16)
    # opened the filesystem tier's way: a FIFO or device put in a weight file's place cannot block the
    # engine's start (a checkpoint's own symlinks, e.g. a Hugging Face cache's, are resolved first)
    with os.fdopen(open_regular(os.path.realpath(path)), "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        h.update(struct.pack("<Q", size))
        if path.name in CONFIG_FILES:
            ranges: Iterator[tuple[int, int]] = iter([(0, size)])
        else:
            # samples are small and far apart: read-ahead would read most of a cold file
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            safetensors = path.name.endswith(SAFETENSORS_SUFFIX)
            ranges = _safetensors_ranges(fd, size, h, path.name) if safetensors else _spread_ranges(size)
        for start, end in _merged(ranges):
            data = os.pread(fd, end - start, start)
            if len(data) != end - start:
                raise OSError(f"{path}: short read at {start} (the file changed while it was read?)")
            h.update(struct.pack("<QQ", start, end))
            h.update(data)
    return h.digest()


def _merged(ranges: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Ascending ranges with those that touch or lie within MERGE_GAP of each other read as one
    (one read instead of several: the gap's bytes are digested too)."""
    cur = None
    for start, end in ranges:
        if cur is not None and start <= cur[1] + MERGE_GAP and cur[1] - cur[0] < MAX_READ:
            cur = (cur[0], max(cur[1], end))
            continue
        if cur is not None:
            yield cur
        cur = (start, end)
    if cur is not None:
        yield cur


def _safetensors_ranges(fd: int, size: int, h, name: str) -> Iterator[tuple[int, int]]:
    """Hashes the header into `h`; yields the sampled byte ranges of every tensor in file order. A
    file whose header is no JSON object is not safetensors and is sampled like any other weight file;
    a header that is one but places a tensor nowhere valid is a ValueError naming the file and tensor
    (the model identity then asks for a model_id)."""
    raw = os.pread(fd, 8, 0)
    n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    header = os.pread(fd, n, 8) if 0 < n <= min(size - 8, MAX_SAFETENSORS_HEADER) else b""
    try:
        entries = json.loads(header) if len(header) == n else None
    except (ValueError, RecursionError):  # RecursionError: a header nested deeper than json parses
        entries = None
    if not isinstance(entries, dict):
        yield from _spread_ranges(size)
        return
    spans = sorted(_tensor_span(name, tensor, v, size - 8 - n) for tensor, v in entries.items()
                   if tensor != "__metadata__")
    h.update(struct.pack("<Q", n))
    h.update(header)
    for b, e in spans:
        yield from _tensor_samples(8 + n + b, 8 + n + e)


def _tensor_span(name: str, tensor: str, entry: object, data_bytes: int) -> tuple[int, int]:
    """(begin, end) of `tensor`'s bytes after the header: two integers within the file's data."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return offsets[0], offsets[1]
    raise ValueError(f"{short_repr(name)} is not valid safetensors: tensor {short_repr(tensor)} has data_offsets "
                     f"{short_repr(offsets)}, expected [begin, end], integers within its {data_bytes} data bytes")


def _tensor_samples(start: int, end: int) -> Iterator[tuple[int, int]]:
    if end - start <= 3 * SAMPLE_BYTES:
        if end > start:
            yield start, end
        return
    mid = (start + end) // 2 - SAMPLE_BYTES // 2
    yield start, start + SAMPLE_BYTES
    yield mid, mid + SAMPLE_BYTES
    yield end - SAMPLE_BYTES, end


def _spread_ranges(size: int) -> Iterator[tuple[int, int]]:
    if size <= OTHER_FILE_SAMPLES * SAMPLE_BYTES:
        yield 0, size
        return
    step = (size - SAMPLE_BYTES) / (OTHER_FILE_SAMPLES - 1)
    for i in range(OTHER_FILE_SAMPLES):
        start = round(i * step)
        yield start, start + SAMPLE_BYTES


def _framed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data
