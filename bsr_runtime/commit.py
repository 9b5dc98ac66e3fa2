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

A failed reduction fails closed that one decision, and only a broken or misaligned group stays
failed. The ranks must stay aligned: a collective pairs with the peers' collective of the same
position in the group's sequence, so every rank issues exactly one reduction per decision, in the
same order (the loader runs them on one thread in submission order, a refused submit issuing none),
whatever the outcome. Then:
- a timeout leaves the reduction posted: gloo (the group BSR agrees on) keeps the work and its tensor
  until the peers' reduction of the same position arrives and completes it, so a late rank's reduction
  pairs with the one its peers gave up on, never with a later decision's, and reads invalid by the
  deadline rule; the next decision starts at the next position on every rank: it agrees afresh, nothing
  to reset. (Checked against torch's gloo: a rank arriving after its peer's wait timed out completes that
  reduction, and the next reductions pair one to one.)
- a late completion (past the earliest deadline) completed the same position everywhere: aligned too.
- *poisoned* stay only a group whose collective raised (a peer closed its connection, or arrived after
  the group's own gloo timeout, which closes the pairs for good) and one whose ranks reduced different
  decisions (tags differ: the ranks' sequences diverged, so every later pairing would be off by the
  same amount). Every later `agree` / `all_min` on that group then fails closed without communicating,
  until `reset_poison()` (after the TP group was rebuilt, on every rank at the same point).

`agree` tells the two failures apart: False means the reduction completed and some rank or group was
invalid (the commit rule); a reduction that did not complete (timed out, raised, mismatched, too late,
poisoned group) raises AgreementFailed with why, so a caller counts it as a failed agreement, not as
the commit rule.

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

from .validation import check_timeout

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_TAG_MASK = (1 << 62) - 1



class AgreementFailed(RuntimeError):
    """The ranks reached no decision (the reduction timed out, raised, mixed decisions or completed too
    late, or the group is poisoned): the load fails closed, counted as a failed agreement."""


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


def _fail(group, why: str, *, poison: bool) -> str:
    """Record why an agreement failed closed; `poison`: the group is broken or misaligned for good."""
    global last_error
    last_error = why
    if poison:
        with _poison_lock:
            _poisoned.setdefault(_group_key(group), why)
    log.warning("commit agreement failed closed: %s%s", why, " (group poisoned)" if poison else "")
    return why


def all_min(values: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S, tag: int = 0,
            group=None) -> list[int] | None:
    """Element-wise MIN of `values` over every rank of `group`, or None (fail closed) when the
    reduction times out, raises, mixes decisions (tags differ) or completes too late.

    Every rank of the group must call it with vectors of the same length, in the same order
    of decisions. World size 1 / no process group: `values` unchanged."""
    out, _why = _all_min(values, timeout_s, tag, group)
    return out


def _all_min(values: Sequence[int], timeout_s: float, tag: int, group) -> tuple[list[int] | None, str | None]:
    """all_min and, when it failed closed, why."""
    global last_error
    timeout_s = check_timeout("agree timeout_s", timeout_s)
    vals = [int(v) for v in values]
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return vals, None
    if is_poisoned(group):
        last_error = "process group poisoned by an earlier failed agreement"
        return None, last_error
    tag = int(tag) & _TAG_MASK
    deadline_ms = time.time_ns() // 1_000_000 + int(timeout_s * 1000)
    out, why = _reduce(dist, vals + [tag, -tag, deadline_ms], timeout_s, group)
    if out is None:
        return None, why
    now_ms = time.time_ns() // 1_000_000
    n = len(vals)
    lo, neg_hi, earliest = out[n], out[n + 1], out[n + 2]
    if lo != tag or -neg_hi != tag:
        return None, _fail(group, f"ranks reduced different decisions (tags {lo}..{-neg_hi}, mine {tag})", poison=True)
    if now_ms > earliest:  # completed on every rank: the group stays aligned
        return None, _fail(group, f"all-reduce completed {now_ms - earliest} ms after the earliest rank's deadline",
                           poison=False)
    return out[:n], None


def _reduce(dist, vals: list[int], timeout_s: float, group) -> tuple[list[int] | None, str | None]:
    """The MIN all-reduce of `vals`, waited for up to `timeout_s`: (result, None) or (None, why). A
    reduction still posted after the wait (a timeout) leaves the group aligned; one that raised breaks it."""
    device = torch.device("cpu")
    work = None
    try:
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(vals, dtype=torch.int64, device=device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        if ok is False:
            return None, _fail(group, f"all-reduce not completed within {timeout_s}s", poison=False)
        return t.cpu().tolist(), None
    except Exception as e:  # noqa: BLE001 - any failure of the collective fails closed
        if work is not None and not work.is_completed():  # gloo's wait timed out: still posted, still aligned
            return None, _fail(group, f"all-reduce not completed within {timeout_s}s ({e})", poison=False)
        return None, _fail(group, f"all-reduce failed: {type(e).__name__}: {e}", poison=True)


def agree(valid_per_group: Sequence[bool], *, timeout_s: float = DEFAULT_TIMEOUT_S, tag: int = 0,
          group=None) -> bool:
    """True iff every rank of `group` reports every group valid (MIN all-reduce of q[r][.]); False
    when the reduction completed and some rank or group was invalid (the commit rule). Raises
    AgreementFailed when no decision was reached (see the module docstring). World size 1: local AND."""
    q = [1 if v else 0 for v in valid_per_group] or [1]
    out, why = _all_min(q, timeout_s, tag, group)
    if out is None:
        raise AgreementFailed(why or "no decision")
    return hma_collapse(v == 1 for v in out)


def agree_local(per_rank: Sequence[Sequence[bool]]) -> bool:
    """The commit rule over per-rank vectors held in one process (tests, simulations)."""
    return bool(per_rank) and all(hma_collapse(q) for q in per_rank)
