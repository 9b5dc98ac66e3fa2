"""How record fields read on the generated pages: units from the field names (`*_bytes` as KiB/MiB,
`*_s` as seconds, `*_GBps` as GB/s, `a_vs_b` as a ratio), Markdown tables, machine and commit lines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def short_commit(commit: str) -> str:
    head, dirty, _ = commit.partition("-dirty")
    return (head[:12] if len(head) == 40 else head) + ("-dirty" if dirty else "")


def machine_summary(m: dict) -> str:
    gpu = m.get("gpu") or "no GPU"
    isa = f" ({m['isa']})" if m.get("isa") else ""
    return (f"{m.get('cpu', '?')}{isa}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB, {gpu}; "
            f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}")


WORDS = {"bsr": "BSR", "ttft": "TTFT", "gbps": "GB/s", "GBps": "GB/s", "crc": "CRC", "l1": "L1", "vs": "/"}


def header(key: str) -> str:
    """`tier_vs_raw` -> `tier / raw`, `raw_get_GBps` -> `raw get GB/s`, `bsr_s` -> `BSR s`."""
    return " ".join(WORDS.get(w, w) for w in key.split("_"))


def cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(cell(key, v) for v in value)
    if isinstance(value, str):
        return value.replace("|", "\\|").replace("\n", " ")
    if isinstance(value, dict):  # e.g. seconds per phase: "submit 0.001, fetch 0.034"
        return ", ".join(f"{k} {cell(key, v)}" for k, v in value.items())
    name = key.rsplit(".", 1)[-1]
    if name == "bytes" or name.endswith("_bytes"):
        return human_bytes(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if name.endswith("_s") or name in ("seconds", "s"):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return _number(value)


def _number(v: float) -> str:
    """Three significant digits without an exponent (0.00031, 0.62, 35.6, 1,234)."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.3g}" if a < 10 else f"{v:.1f}"
    digits = 2
    while a * 10**digits < 100 and digits < 12:
        digits += 1
    return f"{v:.{digits}f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(rows: list[dict], columns: Sequence[str] | None = None) -> list[str]:
    """A Markdown table of `rows` with `columns` (default: every key, in first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(header(c) for c in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    out += ["| " + " | ".join(cell(c, r.get(c)) for c in columns) + " |" for r in rows]
    return out
