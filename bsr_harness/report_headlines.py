"""Which figures make the README's short results table (one line per headline: the latest record it matches,
read by `figure`); docs/performance.md's sections are report_sections.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .report_format import cell, human_bytes
from .report_sections import against_whole_plan, fair_whole_plan


@dataclass(frozen=True)
class Headline:
    benchmark: str
    result: str
    matches: Callable[[dict], bool]
    figure: Callable[[dict], str | None]


def _setting(**want) -> Callable[[dict], bool]:
    return lambda rec: all(rec.get("settings", {}).get(k) == v for k, v in want.items())


DEFAULT_SCALE = 1 / 64  # bsr's --scale default (bsr_cli/args.py): records without the setting ran at it


def _sweep_of(*names: str, scale: float = DEFAULT_SCALE) -> Callable[[dict], bool]:
    """A `bsr sweep --baseline` record of a tier under any of its `names` (its current one, then the
    earlier ones older records were written with: fs, lmcache-fs, history kept as written) at `scale`:
    the chunk size decides how much the per-window fixed costs weigh, so each scale has its own line."""
    return lambda rec: (rec.get("settings", {}).get("tier") in names and rec["settings"].get("baseline") is True
                        and rec["settings"].get("scale", DEFAULT_SCALE) == scale and fair_whole_plan(rec))


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def _peaks(f: dict) -> str | None:
    pairs = against_whole_plan(f["rows"])
    if not pairs:
        return None
    shortest = min(pairs, key=lambda p: p["tokens"])
    longest = max(pairs, key=lambda p: p["tokens"])
    bsr = ", ".join(human_bytes(b) for b in sorted({p["bsr_peak_staging_bytes"] for p in pairs}))
    return (f"BSR {bsr} at every length from {shortest['tokens']:,} to {longest['tokens']:,} tokens "
            f"(W = {shortest['W']}); whole plan {human_bytes(shortest['whole_plan_peak_staging_bytes'])} to "
            f"{human_bytes(longest['whole_plan_peak_staging_bytes'])}; state hashes equal: "
            f"{cell('', all(p['state_hashes_ok'] for p in pairs))}")


def _ratios(f: dict) -> str | None:
    pairs = sorted(against_whole_plan(f["rows"]), key=lambda p: p["tokens"])
    if not pairs:
        return None
    return (f"{_span([p['bsr_vs_whole_plan'] for p in pairs])} over {pairs[0]['tokens']:,}-{pairs[-1]['tokens']:,} "
            f"tokens (per row: {', '.join(format(p['bsr_vs_whole_plan'], '.2f') for p in pairs)})")


def _engine(f: dict) -> str | None:
    e = f.get("engine")
    if not e:
        return None
    return (f"{e['prompt_tokens']:,}-token prompt, {e['tier']} tier, W = {e['window_chunks']}: TTFT "
            f"{e['restored_ttft_s']:.3f} s restored vs {e['cold_ttft_s']:.3f} s cold; peak staging "
            f"{human_bytes(e['peak_staging_bytes'])}; tokens and logprobs identical: "
            f"{cell('', e['tokens_identical'] and e['logprobs_identical'])}")


def _faults(f: dict) -> str:
    rows = f["rows"]
    failed = [r for r in rows if r["outcome"] != "committed"]
    return (f"{sum(r['passed'] and r['outcome'] == r['expected'] for r in rows)}/{len(rows)} scenarios as expected; "
            f"tokens exposed by failed restores: {sum(r['exposed_tokens'] for r in failed)}; staging leaked: "
            f"{human_bytes(sum(r['staging_leaked_bytes'] for r in rows))}")


def _install(f: dict) -> str | None:
    rows = [r for r in f["rows"] if r["device"] == "cpu" and r["window_chunks"] == 32 and "cpu:2t_vs_contiguous" in r]
    if not rows:
        return None
    return "; ".join(f"{r['registration']} {r['mode']}: {r['cpu:2t_vs_contiguous']:.2f}" for r in rows)


def _ladder(f: dict) -> str:
    rows = f["rows"]
    need = ", ".join(human_bytes(r["first_passing_rung_bytes"]) if r["first_passing_rung_bytes"] else "none"
                     for r in rows)
    bsr = {human_bytes(r["bsr_capacity_bytes"]) for r in rows}
    return (f"whole plan first passes at L1 = {need} for {', '.join(format(r['tokens'], ',') for r in rows)} tokens; "
            f"BSR passes at {', '.join(sorted(bsr))} for all: {cell('', all(r['bsr_pass'] for r in rows))}")


def _stall(f: dict) -> str | None:
    rows = sorted(f.get("rows") or [], key=lambda r: (r["model"], r["tokens"]))
    if not rows:
        return None
    return "; ".join(f"{r['model']} {r['tokens']:,}: async {r['gap_ratio_async']:.2f}, sync {r['gap_ratio_sync']:.2f}"
                     + (f", B's TTFT {r['ttft_ratio_in_run']:.2f}"
                        if "ttft_ratio_in_run" in r else "") for r in rows)


HEADLINES = [
    Headline("bsr_demo", "peak staging", lambda rec: True, _peaks),
    *(Headline("bsr_sweep", f"restore time, BSR / whole plan, {what}, {chunk}", _sweep_of(*names, scale=scale),
               _ratios)
      for what, names in (("filesystem tier", ("filesystem", "fs")),
                          ("Mooncake store host over tcp", ("mooncake",)),
                          ("through LMCache (FS L2)", ("lmcache-filesystem", "lmcache-fs")),
                          ("through LMCache (Mooncake L2)", ("lmcache-mooncake",)))
      for scale, chunk in ((1 / 64, "c = 256 KB (scale 1/64)"), (1 / 16, "c = 1 MB (scale 1/16)"))),
    Headline("lmcache_ladder", "LMCache L1 needed to restore", lambda rec: True, _ladder),
    Headline("bsr_demo", "real vLLM engine, restored by a fresh engine", lambda rec: True, _engine),
    Headline("vllm_stall", "a co-running request A while B's prefix restores: A's largest gap / resident (async, "
             "sync); B's TTFT / (resident + 1.2x its restore)",
             _setting(models="tiny,kvheavy"), _stall),
    Headline("bsr_faults", "fault matrix, real Mooncake master and files", lambda rec: True, _faults),
    Headline("bench_install", "CPU install (2 threads, W = 32) / contiguous copy", lambda rec: True, _install),
]
