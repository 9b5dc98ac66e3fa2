"""The commit rule (ARCHITECTURE.md, contract 4): a restored prefix is exposed only if q[r][g] holds
for every TP rank r and every HMA group g.

Each rank computes its validity vector q[r][.] (one entry per group) and `agree` reduces it
with a MIN all-reduce over the torch.distributed default group (gloo on CPU, NCCL on GPU).
One invalid group on one rank collapses the whole external prefix to zero tokens on every
rank (`hma_collapse`): block indices of different groups are not comparable token offsets,
so no per-group boundary is inferred.

Fail closed. Anything but a clean, timely, matching reduction reads as invalid:
- the reduction does not complete within `timeout_s` (a dead or hung rank), or raises
  (a peer closed its connection);
- the ranks were not reducing the same decision: every call carries a 63-bit `tag` (derived
  from the request id and the phase) as (tag, -tag), so MIN recovers (min, max) of the tags
  and any mismatch (a late rank pairing with another request's reduction) shows;
- the reduction completed after the earliest deadline of any rank: each rank contributes its
  wall-clock deadline (now + timeout_s) and MIN yields the earliest; a rank that completes
  after it cannot know whether a peer already gave up, so it reads invalid too. A rank that
  arrives late therefore does not commit what its peers have abandoned. (Exact agreement
  under unbounded delay is impossible — two generals; the residual window is a completion
  that straddles the earliest deadline within one network latency. Ranks are expected to
  share a clock to well under `timeout_s`, e.g. NTP on one cluster.)
- after any of these the group is *poisoned*: collectives may now be misaligned, so every
  later `agree` / `all_min` on that group returns the fail-closed answer without
  communicating, until `reset_poison()` (call it after the TP group was rebuilt).

With world size 1 or no initialised process group, `agree` is the local AND.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_TAG_MASK = (1 << 62) - 1

_poison_lock = threading.Lock()
_poisoned: dict[int, str] = {}  # id(group) (0 = default group) -> why
last_error: str | None = None  # the most recent reason an agree failed closed (diagnostics)


def make_tag(*parts: object) -> int:
    """A positive 62-bit tag naming one decision (e.g. request id and phase)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = str(p).encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little") & _TAG_MASK


def hma_collapse(valid_per_group: Sequence[bool]) -> bool:
    """One invalid group invalidates the whole prefix (no per-group token boundary)."""
    return all(bool(v) for v in valid_per_group)


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def world_size(group=None) -> int:
    dist = _dist()
    return 1 if dist is None else dist.get_world_size(group)


def is_poisoned(group=None) -> bool:
    with _poison_lock:
        return _group_key(group) in _poisoned


def reset_poison(group=None) -> None:
    """Forget an earlier failure on `group` (after the TP group was rebuilt)."""
    with _poison_lock:
        _poisoned.pop(_group_key(group), None)


def _group_key(group) -> int:
    return 0 if group is None else id(group)


def _fail(group, why: str) -> None:
    global last_error
    last_error = why
    with _poison_lock:
        _poisoned.setdefault(_group_key(group), why)
    log.warning("commit agreement failed closed: %s", why)


def all_min(values: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S, tag: int = 0,
            group=None) -> list[int] | None:
    """Element-wise MIN of `values` over every rank of `group`, or None (fail closed) when the
    reduction times out, raises, mixes decisions (tags differ) or completes too late.

    Every rank of the group must call it with vectors of the same length, in the same order
    of decisions. World size 1 / no process group: `values` unchanged."""
    global last_error
    vals = [int(v) for v in values]
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return vals
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if is_poisoned(group):
        last_error = "process group poisoned by an earlier failed agreement"
        return None
    tag = int(tag) & _TAG_MASK
    deadline_ms = time.time_ns() // 1_000_000 + int(timeout_s * 1000)
    device = torch.device("cpu")
    try:
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(vals + [tag, -tag, deadline_ms], dtype=torch.int64, device=device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        if ok is False:
            _fail(group, f"all-reduce not completed within {timeout_s}s")
            return None
        out = t.cpu().tolist()
    except Exception as e:  # noqa: BLE001 - any failure of the collective fails closed
        _fail(group, f"all-reduce failed: {type(e).__name__}: {e}")
        return None
    now_ms = time.time_ns() // 1_000_000
    n = len(vals)
    lo, neg_hi, earliest = out[n], out[n + 1], out[n + 2]
    if lo != tag or -neg_hi != tag:
        _fail(group, f"ranks reduced different decisions (tags {lo}..{-neg_hi}, mine {tag})")
        return None
    if now_ms > earliest:
        _fail(group, f"all-reduce completed {now_ms - earliest} ms after the earliest rank's deadline")
        return None
    return out[:n]


def agree(valid_per_group: Sequence[bool], *, timeout_s: float = DEFAULT_TIMEOUT_S, tag: int = 0,
          group=None) -> bool:
    """True iff every rank of `group` reports every group valid (MIN all-reduce of q[r][.]);
    False on any failure of the reduction (see the module docstring). World size 1: local AND."""
    q = [1 if v else 0 for v in valid_per_group] or [1]
    out = all_min(q, timeout_s=timeout_s, tag=tag, group=group)
    return out is not None and hma_collapse(v == 1 for v in out)


def agree_local(per_rank: Sequence[Sequence[bool]]) -> bool:
    """The commit rule over per-rank vectors held in one process (tests, simulations)."""
    return bool(per_rank) and all(hma_collapse(q) for q in per_rank)
