"""Output of the `bsr` command: tables, progress bars, JSON rows, plots, native log redirection."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence


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


def write_json(path: str | None, rows: list[dict]) -> None:
    """The rows as JSON in `path` (the user's --json), opened the filesystem tier's way: a FIFO there
    is an error, not a hang."""
    if path:
        from bsr_runtime.tiers.fs_open import open_regular

        data = (json.dumps(rows, indent=1) + "\n").encode()
        fd = open_regular(os.path.realpath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def rows_table(rows) -> None:
    print_table(
        ["tier", "tokens", "chunks", "W", "windows", "peak staging", "seconds", "GB/s", "state hash ok"],
        [(r.tier, r.tokens, r.chunks, r.window_chunks, r.windows, human_bytes(r.peak_staging_bytes),
          f"{r.seconds:.2f}", f"{r.gbps:.2f}", "yes" if r.state_hash_ok else "NO") for r in rows])


# = bsr_runtime.restore.RESTORE_PHASES, kept import-free for a fast --help (test_config_schemas keeps them equal)
PHASES = ("prepare", "admit", "submit", "fetch", "install", "sync")


def ratio(a: float | None, b: float | None) -> str:
    """a / b to two places, or "-" when either is missing (or b is 0)."""
    return f"{a / b:.2f}" if a is not None and b else "-"


def baseline_table(rows) -> None:
    """Each length's BSR row beside its whole-plan row (W = 0, one window of every chunk, staging allocated
    before anything is timed): the ratio of their median seconds, and where each spent them (ms)."""
    whole = {(r.tier, r.tokens): r for r in rows if r.window_chunks == 0}
    pairs = [(r, whole[r.tier, r.tokens]) for r in rows if r.window_chunks and (r.tier, r.tokens) in whole]
    if not pairs:
        return
    print("BSR / whole plan (W = 0: one window of all N chunks, its staging allocated and touched before timing; "
          "the same read path and installer). Phases in ms, BSR | whole plan:")
    floors = any(b.tier_floor_s is not None and w.tier_floor_s for b, w in pairs)
    print_table(["tier", "tokens", "W", "BSR s", "whole s", "BSR / whole",
                 *(["tier's own W / whole"] if floors else []), *PHASES],
                [(b.tier, b.tokens, b.window_chunks, f"{b.seconds:.4f}", f"{w.seconds:.4f}",
                  f"{b.seconds / w.seconds:.2f}" if w.seconds else "-",
                  *([ratio(b.tier_floor_s, w.tier_floor_s)] if floors else []),
                  *(f"{getattr(b, p + '_s') * 1e3:.1f} | {getattr(w, p + '_s') * 1e3:.1f}" for p in PHASES))
                 for b, w in pairs])
    if floors:
        print("tier's own W / whole: the tier's own reads of the same objects, W per call against the whole "
              "plan's calls, back to back, nothing installed (bsr_harness/tier_floor.py)")


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


def plot_peaks(path: str, rows, title: str) -> None:
    series = {}
    for tier, w in sorted({(r.tier, r.window_chunks) for r in rows}):
        label = f"{tier}, " + (f"BSR W={w}" if w else "whole plan (W=0)")
        series[label] = [(r.tokens, r.peak_staging_bytes / 2**20) for r in rows
                         if (r.tier, r.window_chunks) == (tier, w)]
    line_plot(path, series, "prefix length (tokens)", "peak staging (MiB)", title)


@contextlib.contextmanager
def native_output_to(path: str):
    """Send file descriptors 1 and 2 (vLLM's logging, Mooncake's glog, C++ warnings) to `path`;
    yield a writer on the real stdout."""
    from bsr_harness.native_log import redirected

    with redirected(path, fds=(1, 2)) as real_stdout, os.fdopen(real_stdout, "w", buffering=1) as out:
        yield out
