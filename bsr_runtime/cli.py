"""The `bsr` command."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError


def _install_demo(args: argparse.Namespace) -> int:
    """Gather a random scaled DeepSeek-V4-Flash state window by window and install it back
    with every backend on this machine; prints GB/s and whether the state came back equal."""
    from bsr_kernels import StagingPool, gather_window, install_window, presets
    from bsr_kernels.install import available_backends

    reg = presets.dsv4_flash(scale=args.scale)
    chunks = args.tokens // reg.chunk_tokens
    print(reg.describe())
    print(f"paper's c for the unscaled registration: {presets.PAPER_DSV4_CHUNK_BYTES:,} B; "
          f"ours unscaled: {presets.dsv4_flash().chunk_bytes:,} B")
    blocks = [reg.blocks_needed(g, chunks * reg.chunk_tokens) for g in range(reg.num_groups)]
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randperm(n, generator=gen) for n in blocks]
    src = reg.allocate(blocks)
    for t in src:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    pool = StagingPool(reg.chunk_bytes, args.window)
    print(f"{chunks} chunks ({args.tokens:,} tokens), window W={args.window}, "
          f"staging {human_bytes(pool.capacity_bytes)}")
    print(f"{'backend':8} {'windows':>7} {'bytes':>12} {'seconds':>8} {'GB/s':>7} {'peak staging':>14} state equal")
    for backend in available_backends("cpu"):
        dst = reg.allocate(blocks)
        for t in dst:
            t.view(torch.uint8).fill_(0xA5)
        pool.reset_peak()
        t0 = time.perf_counter()
        windows = 0
        for first in range(0, chunks, args.window):
            n = min(args.window, chunks - first)
            lease = pool.acquire(n)
            gather_window(lease.view, reg, src, tables, first, n, backend="torch")
            install_window(lease.view, reg, dst, tables, first, n, backend=backend)
            pool.record_install(lease)
            pool.release(lease)
            windows += 1
        dt = time.perf_counter() - t0
        equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(src, dst))
        moved = chunks * reg.chunk_bytes
        print(f"{backend:8} {windows:7d} {human_bytes(moved):>12} {dt:8.2f} {moved / dt / 1e9:7.2f} "
              f"{human_bytes(pool.peak_bytes):>14} {'yes' if equal else 'NO'}")
        if not equal:
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bsr", description="Bounded-state restoration of LLM KV-cache prefixes.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the main job on its embedded default")
    d.add_argument("--tokens", type=int, default=65536, help="prefix length in tokens (default 65536)")
    d.add_argument("--window", type=int, default=32, help="window W in chunks (default 32)")
    d.add_argument("--scale", type=float, default=1 / 64, help="entry-width scale of the preset (default 1/64)")
    d.set_defaults(func=_install_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"bsr: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
