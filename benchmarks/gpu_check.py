"""GPU check of the install/gather backends (run it through benchmarks/gpu_check.sh).

1. Correctness on the GPU: every backend (CUDA zero-copy, CUDA with a host->device copy,
   CUDA device-staged, Triton host/device staging, torch) against the torch reference, for
   the scaled (1/64) and unscaled DeepSeek-V4-Flash presets with and without MTP: poisoned
   destinations, random staging (never zero), shuffled block tables with -1 holes, a window
   at a non-zero first chunk; install and gather.
   And a save through the Saver and a restore through the window loop with the destinations on the GPU
   and no stream given, behind a busy GPU (a kernel that spins first): the restored state hash equals the
   source's (the put waits for its gather, the staging goes back after its install).
2. Throughput per window size W in {1, 8, 16, 32, 64} on the unscaled preset (c = chunk
   bytes, W*c bytes per install): CUDA install zero-copy (kernel reads pinned host memory),
   CUDA with one H2D copy then the kernel, CUDA device-staged (kernel only), Triton (host
   staging: bulk copy + kernel; device staging: kernel only), a bulk cudaMemcpyAsync H2D of
   the same bytes (torch copy_ from pinned host), a cudaMemcpyAsync per tensor per block
   (torch copy_ per tensor per block), and the same runs by the copy engines from C
   (libbsr_cuda.so): one cudaMemcpyBatchAsync (CUDA >= 12.8; dma-batch) and one cudaMemcpyAsync
   per run (dma-loop), checked once per W to write what the kernel writes; with the ratios
   CUDA/bulk, Triton/bulk, CUDA/loop, CUDA/dma-batch.

Writes the report to $TMPDIR/bsr_gpu_check_<date>.txt (rewritten after each row, so a run cut
short keeps what it measured) and appends its figures as a record to
benchmarks/results/gpu_check.jsonl (bsr_harness.records; also when stopped by SIGTERM, e.g. by
gpu_check.sh's timeout). Exit status 1 when a correctness check fails or the
CUDA backend is not available, 2 when torch has no CUDA. Well under 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a plain checkout too

import torch  # noqa: E402

from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_harness.testdata import POISON, poisoned, window_tables  # noqa: E402
from bsr_kernels import cuda_backend, presets  # noqa: E402
from bsr_kernels.install import gather_window, install_window  # noqa: E402
from bsr_kernels.registration import Registration  # noqa: E402
from bsr_kernels.torch_backend import gather_torch, install_torch  # noqa: E402
from bsr_kernels.validate import check_window  # noqa: E402

WINDOWS = (1, 8, 16, 32, 64)


class Report:
    """Printed lines, also kept in a file once `saving` is on (after CUDA is confirmed); the figures
    for the run's record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []
        self.saving = False
        self.figures: dict = {"correctness": [], "throughput": []}

    def add(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.save()

    def save(self) -> None:
        if self.saving:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n")


# -- data ------------------------------------------------------------------------------------
def random_bytes(n: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """Random bytes in 1..255 (never zero), generated on the GPU."""
    data = torch.randint(1, 256, (n,), dtype=torch.uint8, device=device)
    if device.type == "cuda" and pinned:
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host.copy_(data)
        return host
    return data


def make_tables(reg: Registration, first: int, num: int, seed: int, neg: float, device: torch.device):
    """Shuffled block tables for chunks first..first+num-1 (-1 before the window and in holes)."""
    tables, nblocks = window_tables(reg, first, num, seed, neg)
    return [t.to(device) for t in tables], nblocks


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


# -- 1. correctness ----------------------------------------------------------------------------
def check_save_restore(dev: torch.device, rep: Report, backend: str = "auto", n: int = 8) -> bool:
    """Save n chunks from destinations on `dev` (the Saver: gather on this thread, put on its own), restore them
    into other, poisoned blocks (the window loop, W = 2, depth 2), both with no stream given and each behind a
    kernel that keeps the GPU busy first: the restored state hash must equal the source's."""
    from bsr_harness.testdata import block_tables
    from bsr_runtime.keys import KeySpace
    from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
    from bsr_runtime.saver import Saver
    from bsr_runtime.state_hash import state_hash
    from bsr_runtime.tiers import FilesystemTier

    reg = presets.dsv4_flash(scale=1 / 64)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 50_000, (n * reg.chunk_tokens,), generator=gen).tolist()
    blocks, (src_tables,) = block_tables(reg, [n], 8, spare=0, holes="none")
    src = [t.to(dev) for t in reg.allocate(blocks)]
    for t in src:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(1, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    expected = state_hash(reg, src, src_tables, n)
    dst_blocks, (dst_tables,) = block_tables(reg, [n], 9, spare=1, holes="none")
    dst = [t.to(dev) for t in poisoned(reg, dst_blocks)]

    def busy() -> None:
        if dev.type == "cuda":
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the gather / install

    space = KeySpace(reg.fingerprint)
    with tempfile.TemporaryDirectory(prefix="bsr-gpu-check-") as root, \
            FilesystemTier(root, reg.chunk_bytes, reg.fingerprint) as tier:
        saver = Saver(reg, [tier], staging_chunks=n, keyspace=space, backend=backend)
        saver.kv = src
        try:
            busy()
            saver.save("gpu-check", tokens, 0, n, [t.tolist() for t in src_tables], "")
            saved = saver.wait_idle(60)
            recs = saver.take_finished()
        finally:
            saver.close(30)
        saved = saved and len(recs) == 1 and recs[0].get("ok") and recs[0].get("stored") == n
        with BoundedRestorer(reg, RestoreConfig(window_chunks=2, pipeline_depth=2, backend=backend)) as r:
            busy()
            out = r.restore(RestoreRequest("gpu-check", tokens, space, dst, dst_tables), tier, n)
        restored = out.ok and state_hash(reg, dst, dst_tables, n) == expected
    ok = bool(saved and restored)
    rep.add(f"save + restore through the loop on {dev.type} (backend {backend}, {n} chunks, busy GPU first): "
            f"{'PASS' if ok else 'FAIL'} (saved {[(r.get('ok'), r.get('stored'), r.get('error')) for r in recs]}, "
            f"restored {out.ok} {out.error or ''})")
    rep.figures["correctness"].append({"check": "save_restore", "backend": backend, "pass": ok})
    return ok


def check_registration(reg: Registration, first: int, num: int, seed: int, dev: torch.device, rep: Report) -> bool:
    tables, nblocks = make_tables(reg, first, num, seed, neg=0.15, device=dev)
    n = num * reg.chunk_bytes
    host = random_bytes(n, dev, pinned=True)
    devs = host.to(dev)
    ref = poisoned(reg, nblocks, dev)
    install_torch(reg, check_window(devs, reg, ref, tables, first, num))
    src_kv = reg.allocate(nblocks, dev)
    for t in src_kv:
        t.view(torch.uint8).view(-1).copy_(random_bytes(t.numel() * t.element_size(), dev))
    gref = torch.full((n,), POISON, dtype=torch.uint8, device=dev)
    gather_torch(reg, check_window(gref, reg, src_kv, tables, first, num, staging_name="out"))
    torch.cuda.synchronize()

    variants = [  # (label, backend, staging kind, zero_copy)
        ("cuda zero-copy", "cuda", "pinned", True),
        ("cuda host->dev copy", "cuda", "pinned", False),
        ("cuda device-staged", "cuda", "device", True),
        ("triton host-staged", "triton", "pinned", True),
        ("triton device-staged", "triton", "device", True),
        ("torch", "torch", "device", True),
    ]
    ok_all = True
    for label, backend, kind, zc in variants:
        staging = host if kind == "pinned" else devs
        results = []
        for op in ("install", "gather"):
            try:
                if op == "install":
                    kv = poisoned(reg, nblocks, dev)
                    install_window(staging, reg, kv, tables, first, num, backend=backend, zero_copy=zc)
                    torch.cuda.synchronize()
                    good = same(kv, ref)
                else:
                    out = torch.full((n,), POISON, dtype=torch.uint8, device=dev)
                    if kind == "pinned":
                        out = out.cpu().pin_memory()
                    gather_window(out, reg, src_kv, tables, first, num, backend=backend, zero_copy=zc)
                    torch.cuda.synchronize()
                    good = torch.equal(out.to(dev), gref)
                results.append("ok" if good else "MISMATCH")
                ok_all &= good
            except Exception as e:  # report and go on with the other backends
                unavailable = isinstance(e, ValueError) and "not available" in str(e)
                if unavailable and backend == "triton":
                    results.append("skipped (triton unavailable)")
                else:
                    results.append(f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    ok_all = False
                if os.environ.get("BSR_GPU_CHECK_TRACEBACK"):
                    traceback.print_exc()
        rep.add(f"  {reg.name:<22} {label:<22} install: {results[0]:<10} gather: {results[1]}")
        rep.figures["correctness"].append({"registration": reg.name, "variant": label, "install": results[0],
                                           "gather": results[1]})
    return ok_all


# -- 2. throughput -----------------------------------------------------------------------------
def bench(fn, stream: torch.cuda.Stream, min_s: float = 0.15, max_iters: int = 50) -> float:
    """Seconds per call, timed with CUDA events on `stream` (launch gaps included)."""
    with torch.cuda.stream(stream):
        fn()  # warm-up (Triton compiles here)
        stream.synchronize()
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        once = max(time.perf_counter() - t0, 1e-6)
        iters = max(2, min(max_iters, int(min_s / once)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(iters):
            fn()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def block_copies(reg: Registration, kv, tables_cpu, staging: torch.Tensor, num: int):
    """(dst, src) byte views: one copy per tensor per destination block of the window (`tables_cpu` as the
    kernels read them: validate.check_block_tables' result, tail groups narrowed to each chunk's tail)."""
    pairs = []
    cb = reg.chunk_bytes
    for i, (spec, t) in enumerate(zip(reg.specs, kv, strict=True)):
        eb, bs, epc = spec.entry_bytes, spec.block_size, reg.entries_per_chunk(i)
        rows = t.view(torch.uint8).view(t.shape[0], bs * eb)
        table = tables_cpu[spec.group]
        end = num * epc
        for k in range(-(-end // bs)):
            b = int(table[k])
            if b < 0:
                continue
            e, stop = k * bs, min((k + 1) * bs, end)
            while e < stop:  # split where a block straddles chunks
                c, j = divmod(e, epc)
                run = min(stop, (c + 1) * epc) - e
                slot = e - k * bs
                s0 = c * cb + reg.segment_offsets[i] + j * eb
                pairs.append((rows[b, slot * eb:(slot + run) * eb], staging[s0:s0 + run * eb]))
                e += run
    return pairs


def throughput(dev: torch.device, rep: Report, deadline: float) -> None:
    from bsr_kernels import triton_backend

    reg = presets.dsv4_flash()
    cb, wmax = reg.chunk_bytes, max(WINDOWS)
    rep.add(f"registration {reg.describe()}")
    host = random_bytes(wmax * cb, dev, pinned=True)
    devs = host.to(dev)
    bulk_dst = torch.empty_like(devs)
    gen = torch.Generator().manual_seed(1)
    tables_cpu, nblocks = [], []
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, wmax * reg.chunk_tokens)
        tables_cpu.append(torch.randperm(need, generator=gen).to(torch.int64))
        nblocks.append(need)
    tables_cpu = reg.without_heads(tables_cpu)  # sliding windows: each chunk's tail resident, as in an engine
    tables = [t.to(dev) for t in tables_cpu]
    kv = reg.allocate(nblocks, dev)
    stream = torch.cuda.Stream(dev)
    have_cuda = cuda_backend.available()
    have_triton = triton_backend.available(dev)

    cols = ("W", "MiB", "cuda-zc", "cuda-h2d+k", "cuda-dev", "triton-host", "triton-dev", "bulk-H2D", "loop-H2D",
            "dma-batch", "dma-loop", "copies", "cuda/bulk", "triton/bulk", "cuda/loop", "cuda/batch")
    rep.add("GB/s = W*c bytes / time per install (10^9 B/s); cuda-zc: kernel reads pinned host memory;")
    rep.add("cuda-h2d+k / triton-host: one bulk H2D copy then the kernel; -dev: staging already on the GPU;")
    rep.add("loop-H2D: torch copy_ (cudaMemcpyAsync) per tensor per block; dma-batch: the same runs in one")
    rep.add("cudaMemcpyBatchAsync; dma-loop: one cudaMemcpyAsync per run from C; ratios use cuda-zc and triton-host.")
    rep.add(" ".join(f"{c:>11}" for c in cols))
    ctx = dict(reg=reg, host=host, devs=devs, bulk_dst=bulk_dst, kv=kv, tables=tables, tables_cpu=tables_cpu,
               stream=stream, have_cuda=have_cuda, have_triton=have_triton, rep=rep)
    for w in WINDOWS:
        if time.monotonic() > deadline:
            rep.add(f"{w:>11} skipped: time budget spent")
            continue
        rep.add(" ".join(f"{c:>11}" for c in window_row(w, cols, **ctx)))


def window_row(w, cols, *, reg, host, devs, bulk_dst, kv, tables, tables_cpu, stream, have_cuda, have_triton,
               rep) -> list[str]:
    from bsr_kernels import triton_backend

    nbytes = w * reg.chunk_bytes
    a_host = check_window(host[:nbytes], reg, kv, tables, 0, w)
    a_dev = check_window(devs[:nbytes], reg, kv, tables, 0, w)
    res: dict[str, float | None] = {}

    def run(name, fn):
        try:
            res[name] = nbytes / bench(fn, stream) / 1e9
        except Exception as e:
            res[name] = None
            rep.add(f"  W={w} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    if have_cuda:
        run("cuda-zc", lambda: cuda_backend.install(reg, a_host, stream, True))
        run("cuda-h2d+k", lambda: cuda_backend.install(reg, a_host, stream, False))
        run("cuda-dev", lambda: cuda_backend.install(reg, a_dev, stream, True))
    if have_triton:
        run("triton-host", lambda: triton_backend.install(reg, a_host, stream))
        run("triton-dev", lambda: triton_backend.install(reg, a_dev, stream))
    run("bulk-H2D", lambda: bulk_dst[:nbytes].copy_(host[:nbytes], non_blocking=True))
    pairs = block_copies(reg, kv, [t.cpu() for t in a_host.block_tables], host, w)  # as the kernels read them

    run("loop-H2D", lambda: copy_runs(pairs, stream))
    if have_cuda:
        dma_runs(reg, pairs, kv, a_host, stream, run, rep, w)

    def ratio(a, b):
        x, y = res.get(a), res.get(b)
        return f"{x / y:.2f}x" if x and y else "-"

    def gbs(name):
        v = res.get(name)
        return f"{v:.1f}" if v else "-"

    rep.figures["throughput"].append({"window_chunks": w, "bytes": nbytes, "copies": len(pairs),
                                      **{f"{k}_GBps": round(v, 2) if v else None for k, v in res.items()}})

    return [str(w), f"{nbytes / 2**20:.0f}", *(gbs(c) for c in cols[2:11]), str(len(pairs)),
            ratio("cuda-zc", "bulk-H2D"), ratio("triton-host", "bulk-H2D"), ratio("cuda-zc", "loop-H2D"),
            ratio("cuda-zc", "dma-batch")]


def dma_runs(reg, pairs, kv, a_host, stream, run, rep, w) -> None:
    """Time the copy-engine baselines over the kernel's runs, after checking once that the batched
    copy writes exactly what the CUDA kernel writes (poisoned destinations compared byte for byte)."""
    lib = cuda_backend.library()
    dst = torch.tensor([d.data_ptr() for d, _ in pairs], dtype=torch.int64)
    src = torch.tensor([s.data_ptr() for _, s in pairs], dtype=torch.int64)
    size = torch.tensor([d.numel() for d, _ in pairs], dtype=torch.int64)

    def dma(name: str) -> None:
        fn = getattr(lib, name)
        if fn(dst.data_ptr(), src.data_ptr(), size.data_ptr(), len(pairs), stream.cuda_stream) != 0:
            raise RuntimeError(f"{name}: {lib.bsr_last_error().decode(errors='replace')}")

    def written_by(copy) -> list[torch.Tensor]:
        # The poison is written on the current stream and the copy runs on `stream` (a non-blocking
        # one): without the device-wide synchronize the fill can land after the copy.
        for t in kv:
            t.view(torch.uint8).fill_(POISON)
        torch.cuda.synchronize()
        copy()
        torch.cuda.synchronize()
        return [t.clone() for t in kv]

    try:
        by_kernel = written_by(lambda: cuda_backend.install(reg, a_host, stream, True))
        by_dma = written_by(lambda: dma("bsr_copy_batch"))
        if not same(by_dma, by_kernel):
            by_loop = written_by(lambda: copy_runs(pairs, stream))
            loop = "agree with it" if same(by_loop, by_kernel) else "differ too: " + differing(by_loop, by_kernel)
            rep.add(f"  W={w} dma-batch: writes differ from the CUDA kernel's (timing skipped): "
                    f"{differing(by_dma, by_kernel)}; the same runs by torch copy_ {loop}")
            return
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        rep.add(f"  W={w} dma-batch check: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    run("dma-batch", lambda: dma("bsr_copy_batch"))
    run("dma-loop", lambda: dma("bsr_copy_loop"))


def copy_runs(pairs, stream: torch.cuda.Stream) -> None:
    """The kernel's runs as one torch copy_ each, on `stream` (the loop-H2D baseline)."""
    with torch.cuda.stream(stream):
        for d, s in pairs:
            d.copy_(s, non_blocking=True)


def differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """Which tensors differ and by how many bytes, for a mismatch's one line."""
    bad = [(i, int((x.view(torch.uint8) != y.view(torch.uint8)).sum())) for i, (x, y) in enumerate(zip(a, b))]
    bad = [(i, n) for i, n in bad if n]
    return (f"{len(bad)} of {len(a)} tensors, {sum(n for _, n in bad):,} bytes (first: "
            + ", ".join(f"#{i} {n:,} B" for i, n in bad[:3]) + ")")


# -- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip remaining windows after this long")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    add_record_options(ap)
    args = ap.parse_args()
    t_start = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    rep = Report(args.out or Path(tempfile.gettempdir()) / f"bsr_gpu_check_{stamp}.txt")
    rep.add(f"bsr gpu_check {stamp} on {platform.node()}")
    rep.add(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    if not torch.cuda.is_available():
        rep.add("torch.cuda is unavailable: this torch build has no CUDA or no GPU/driver is visible. "
                "Install a CUDA-enabled torch (e.g. from the PyTorch CUDA wheel index) and rerun.")
        return 2
    rep.saving = True
    signal.signal(signal.SIGTERM, _stopped)
    try:
        return checks(args, rep, t_start)
    finally:
        rep.figures["seconds"] = round(time.monotonic() - t_start, 1)
        record_script(args, "gpu_check", rep.figures, omit=("out",))


def _stopped(signum, frame) -> None:
    raise SystemExit(124)  # unwinds through main's finally, which records what was measured


def checks(args, rep: Report, t_start: float) -> int:
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    rep.add(f"device {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
            f"{props.multi_processor_count} SMs")
    rep.add(f"CUDA library: {cuda_backend.library_path() or 'not loaded'}; status: {cuda_backend.device_status()}")
    if cuda_backend.load_error():
        rep.add(f"CUDA library load error: {cuda_backend.load_error()}")
    rep.add(f"cuda backend available: {cuda_backend.available()}")
    rep.figures.update(device=props.name, cuda_backend_available=cuda_backend.available())
    torch.manual_seed(0)

    rep.add("")
    rep.add("== correctness against the torch reference (GPU) ==")
    ok = True
    cases = [
        (presets.dsv4_flash(scale=1 / 64), 3, 4),
        (presets.dsv4_flash(mtp=True, scale=1 / 64), 2, 5),
        (presets.dsv4_flash(), 1, 2),
        (presets.dsv4_flash(mtp=True), 2, 1),
    ]
    for k, (reg, first, num) in enumerate(cases):
        ok &= check_registration(reg, first, num, 100 + k, dev, rep)
        torch.cuda.empty_cache()
    for backend in ("auto", "torch"):
        try:
            ok &= check_save_restore(dev, rep, backend)
        except Exception as e:  # noqa: BLE001 - a failed check, reported as one
            rep.add(f"save + restore ({backend}): ERROR {type(e).__name__}: {e}")
            traceback.print_exc()
            ok = False
    rep.add(f"correctness: {'PASS' if ok else 'FAIL'} ({time.monotonic() - t_start:.1f} s)")

    if not args.skip_bench:
        rep.add("")
        rep.add("== install throughput (unscaled DeepSeek-V4-Flash) ==")
        try:
            throughput(dev, rep, t_start + args.budget_s)
        except Exception as e:
            rep.add(f"throughput: ERROR {type(e).__name__}: {e}")
            traceback.print_exc()
            ok = False
    rep.add("")
    rep.add(f"done in {time.monotonic() - t_start:.1f} s; report {rep.path}")
    if not cuda_backend.available():
        rep.add("FAIL: the CUDA backend is not available on this GPU machine")
        ok = False
    rep.figures["pass"] = bool(ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
