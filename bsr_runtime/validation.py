"""Validation of knobs and inputs where they enter the runtime: one place, one error type.

Every check raises ValueError with the knob's name and the offending value. Integers must be
integers (not bools, not floats such as 2.5 or NaN); numbers must be finite; timeouts must be
positive and at most `threading.TIMEOUT_MAX` (what `Event.wait` / `Lock.acquire` accept), so a
timeout of `inf` or 1e10 is refused here instead of overflowing inside a wait later.
"""

from __future__ import annotations

import math
import numbers
import threading
from array import array
from collections.abc import Sequence

import numpy as np

TIMEOUT_MAX_S = float(threading.TIMEOUT_MAX)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]; bools, floats and other types are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_optional_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, lo=lo, hi=hi)


def check_number(name: str, value: object, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> float:
    """`value` as a finite float in [lo, hi] ((lo, hi] with lo_open); NaN and +-inf are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return v


def check_timeout(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """A timeout in seconds: positive, finite, at most threading.TIMEOUT_MAX (None = wait forever
    where allow_none)."""
    if value is None and allow_none:
        return None
    return check_number(name, value, lo=0.0, lo_open=True, hi=TIMEOUT_MAX_S)


def check_duration(name: str, value: object) -> float:
    """A non-negative finite duration (a cooldown may be 0), at most threading.TIMEOUT_MAX."""
    return check_number(name, value, lo=0.0, hi=TIMEOUT_MAX_S)


def check_text(name: str, value: object) -> str:
    """A str that encodes to UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text ({e.reason} at position {e.start})") from None
    return value


def token_id_bytes(tokens: Sequence) -> memoryview:
    """The ids as native-order int64 bytes (what numpy's int64 `tobytes` gives), checked: token ids must be
    integers within int64 (a float id, t + 0.9, would otherwise be truncated into the key of another token;
    a bool or a string is a caller's bug).
    Arrays and tensors are checked by dtype; other sequences are packed in one pass that refuses every
    element that is not an integer but a bool (array('q')), then only the ids equal to 0 or 1 are looked
    at for bools (~0.5 ms for 32K ids, where checking every element's type and then packing took twice that)."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is not None and hasattr(tokens, "ndim"):
        _check_token_array(tokens)
        return memoryview(np.ascontiguousarray(np.asarray(tokens), dtype=np.int64)).cast("B")
    try:
        ids = array("q", tokens)
    except OverflowError:
        raise ValueError("a token id is outside the int64 range") from None
    except TypeError:
        _raise_not_integers(tokens)
        raise
    values = np.frombuffer(ids, dtype=np.int64)
    for i in np.flatnonzero((values >= 0) & (values <= 1)).tolist():  # a bool packs as 0 or 1
        if isinstance(tokens[i], bool):
            raise ValueError(f"token ids must be integers, got {tokens[i]!r} at position {i}")
    return memoryview(ids).cast("B")


def _raise_not_integers(tokens) -> None:
    """The first element that is not an integer, in a one-line error (or a sequence that is no sequence)."""
    try:
        items = list(tokens)
    except TypeError:
        raise ValueError(f"token ids must be a sequence of integers, got {type(tokens).__name__}") from None
    for i, t in enumerate(items):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"token ids must be integers, got {t!r} at position {i}")
    raise ValueError("token ids must be integers that fit in int64")


def _check_token_array(tokens) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence of integers, got shape {tuple(tokens.shape)}")
    if getattr(tokens, "is_floating_point", None) is not None:  # a torch tensor
        ok = not tokens.is_floating_point() and not tokens.is_complex() and tokens.dtype != _torch_bool()
    else:
        ok = tokens.dtype.kind in "iu" and not (tokens.dtype.kind == "u" and tokens.dtype.itemsize == 8
                                                and tokens.size and int(tokens.max()) > INT64_MAX)
    if not ok:
        raise ValueError(f"token ids must be integers, got a {tokens.dtype} array")


def _torch_bool():
    import torch

    return torch.bool
