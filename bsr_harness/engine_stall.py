"""What a restore costs the other requests of an engine: a request A decodes while a request B whose
prefix is restored (or already resident in vLLM's prefix cache) is admitted; A's inter-token gaps and
B's time to first token, measured step by step in an in-process engine.

    out = measure_stall(llm, tokens_a, tokens_b)
    out["a_max_gap_s"]      A's largest gap between B's arrival and B's first token
    out["b_ttft_s"]         B's arrival to B's first token
    out["b_steps_s"]        the engine steps that ended between B's arrival and B's first token:
                            (start after the arrival, duration), so where B's time went is seen step by step
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

_ids = itertools.count()


def _params(max_tokens: int):
    from bsr_harness.vllm_engines import greedy

    return greedy(max_tokens)


def measure_stall(llm, tokens_a: Sequence[int], tokens_b: Sequence[int] | Sequence[Sequence[int]], *,
                  a_max_tokens: int = 120, b_after: int = 20, b_max_tokens: int = 8,
                  b_salt: str | None = None) -> dict[str, Any]:
    """Step an in-process engine: A starts alone; once A has `b_after` tokens the B requests arrive (one
    prompt, or several at once); stepping goes on until every request finished.

    Returns A's gaps (seconds between consecutive tokens of A), the largest gap while some B waits for
    its first token, A's median gap, each B's time to first token, and each B's greedy output (tokens,
    logprobs) and cached-token count."""
    engine = llm.llm_engine
    many = bool(tokens_b) and not isinstance(tokens_b[0], int)
    bs = [list(t) for t in tokens_b] if many else [list(tokens_b)]
    run = next(_ids)
    a_id = f"stall-a-{run}"
    engine.add_request(a_id, {"prompt_token_ids": list(tokens_a)}, _params(a_max_tokens))
    seen = _Seen(a_id)
    b_ids: list[str] = []
    b_arrival = b_done_first = None
    steps: list[tuple[float, float]] = []  # (start, end) of every step
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append((t0, now))
        seen.take(outs, now)
        if not b_ids and len(seen.a_times) >= b_after:
            b_arrival = time.perf_counter()
            b_ids = _add_bs(engine, bs, run, b_salt, b_max_tokens)
        if b_ids and b_done_first is None and len(seen.b_first) == len(b_ids):
            b_done_first = now
    return _result(seen, b_ids, b_arrival, b_done_first, steps)


class _Seen:
    """What the steps gave: A's token times, each B's first-token time and its finished output."""

    def __init__(self, a_id: str) -> None:
        self.a_id = a_id
        self.a_times: list[float] = []
        self.b_first: dict[str, float] = {}
        self.b_out: dict[str, Any] = {}

    def take(self, outs, now: float) -> None:
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if o.request_id == self.a_id:
                self.a_times.extend([now] * (n - len(self.a_times)))
            elif n and o.request_id not in self.b_first:
                self.b_first[o.request_id] = now
            if o.finished and o.request_id != self.a_id:
                c = o.outputs[0]
                self.b_out[o.request_id] = (list(c.token_ids),
                                            [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
                                            o.num_cached_tokens)


def _add_bs(engine, bs: list[list[int]], run: int, b_salt: str | None, b_max_tokens: int) -> list[str]:
    """The B requests added now; their ids."""
    b_ids = []
    for i, t in enumerate(bs):
        rid = f"stall-b{i}-{run}"
        prompt: dict[str, Any] = {"prompt_token_ids": t}
        if b_salt is not None:
            prompt["cache_salt"] = b_salt
        engine.add_request(rid, prompt, _params(b_max_tokens))
        b_ids.append(rid)
    return b_ids


def _result(seen: _Seen, b_ids: list[str], b_arrival: float | None, b_done_first: float | None,
            steps: list[tuple[float, float]]) -> dict[str, Any]:
    a_times, b_first = seen.a_times, seen.b_first
    gaps = [b - a for a, b in zip(a_times, a_times[1:])]
    window_end = b_done_first if b_done_first is not None else a_times[-1]
    during = [b - a for a, b in zip(a_times, a_times[1:]) if b > b_arrival and a < window_end]
    ttft = {rid: b_first[rid] - b_arrival for rid in b_ids if rid in b_first}
    return {
        "a_tokens": len(a_times),
        "a_median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else 0.0,
        "a_max_gap_s": max(during, default=0.0),
        "a_gaps_during_b_s": during,
        "b_ttft_s": [ttft.get(rid) for rid in b_ids],
        "b_steps_s": [(t0 - b_arrival, t1 - t0) for t0, t1 in steps
                      if b_arrival is not None and b_done_first is not None and b_arrival < t1 <= b_done_first],
        "b_first_order": sorted(b_first, key=b_first.get),
        "b_ids": b_ids,
        "b_outputs": [seen.b_out.get(rid) for rid in b_ids],
    }
