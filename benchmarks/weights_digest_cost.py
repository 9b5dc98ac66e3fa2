"""Start-up cost of the model identity's weights digest (bsr_runtime/weights_digest.py) on a multi-GB
checkpoint, beside reading the whole checkpoint once (what a full hash would at least cost).

    python benchmarks/weights_digest_cost.py --dir /tmp/bsr-digest-bench [--gib 6] [--shards 4] \
        [--tensors 300,30000] [--reps 3] [--keep]

Writes synthetic safetensors checkpoints of random bytes (`--gib` in `--shards` files, each tensor
count of `--tensors` in turn), then per checkpoint: the digest with the checkpoint's pages dropped
from the page cache first (posix_fadvise DONTNEED on every file: "cold", what a start after a reboot
or on a fresh node pays, as far as the page cache goes; the device's own caches stay), the digest
again from the page cache ("warm"), and one sequential read of every byte, cold, for scale.
Medians of --reps. The files are deleted at the end unless --keep. Appends a record to
benchmarks/results/weights_digest_cost.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_runtime.weights_digest import SAMPLE_BYTES, checkpoint_digest, checkpoint_files  # noqa: E402

WRITE_BLOCK = 64 << 20


def write_checkpoint(path: Path, total_bytes: int, shards: int, tensors: int) -> None:
    """`shards` safetensors files of float32 tensors of random bytes, `tensors` in all, about equal."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    per_shard = tensors // shards
    elems = total_bytes // tensors // 4
    for s in range(shards):
        header, offset = {}, 0
        for t in range(per_shard):
            header[f"model.layers.{s}.t{t}.weight"] = {"dtype": "F32", "shape": [elems],
                                                       "data_offsets": [offset, offset + elems * 4]}
            offset += elems * 4
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                n = min(WRITE_BLOCK, left)
                f.write(os.urandom(n))
                left -= n


def drop_cache(path: Path) -> None:
    for f in checkpoint_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(path: Path) -> None:
    buf = bytearray(WRITE_BLOCK)
    for f in checkpoint_files(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def timed(fn, before=None, reps: int = 3) -> float:
    out = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tensors", default="300,30000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    add_record_options(ap)
    a = ap.parse_args()
    rows = []
    total = int(a.gib * (1 << 30))
    print(f"weights digest: first, middle and last {SAMPLE_BYTES} B of every tensor + headers; "
          f"{a.gib:g} GiB in {a.shards} safetensors shards; medians of {a.reps}")
    print(f"{'tensors':>8} {'digest cold s':>14} {'digest warm s':>14} {'read all cold s':>16} {'cold ratio':>11}")
    try:
        for tensors in (int(t) for t in a.tensors.split(",")):
            ckpt = a.dir / f"ckpt-{tensors}"
            write_checkpoint(ckpt, total, a.shards, tensors)
            cold = timed(lambda c=ckpt: checkpoint_digest(c), lambda c=ckpt: drop_cache(c), a.reps)
            warm = timed(lambda c=ckpt: checkpoint_digest(c), None, a.reps)
            full = timed(lambda c=ckpt: read_all(c), lambda c=ckpt: drop_cache(c), 1)
            print(f"{tensors:>8} {cold:>14.3f} {warm:>14.3f} {full:>16.2f} {cold / full:>11.4f}", flush=True)
            rows.append({"tensors": tensors, "digest_cold_s": cold, "digest_warm_s": warm, "read_all_cold_s": full})
            if not a.keep:
                shutil.rmtree(ckpt)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    record_script(a, "weights_digest_cost", {"checkpoint_gib": a.gib, "shards": a.shards, "rows": rows},
                  omit=("dir", "keep"))


if __name__ == "__main__":
    main()
