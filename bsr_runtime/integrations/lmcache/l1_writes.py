"""Writes through LMCache's L1 (the tier's put and delete): reservations aborted when never filled,
waiting until an L2 adapter holds what was written, deleting it from L1 once it does.

A put is `reserve_write` -> copy into the reserved L1 objects -> `finish_write`; LMCache's store
controller then writes the objects to every L2 adapter, holding a read lock on each until its L2
store completes.
"""

from __future__ import annotations

import time

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.storage_manager import StorageManager

from .objects import _POLL_S
from .probe import L2Lookups


def abort_writes(sm: StorageManager, keys: list[ObjectKey]) -> None:
    """Discard reservations that were never filled. StorageManager has no public abort (its
    finish_write would admit, and store, unwritten bytes): use the L1 manager's
    finish_write_and_delete under the manager's write tag; otherwise LMCache's write TTL
    reclaims them."""
    from lmcache.v1.distributed import storage_manager as smod

    mgr, tag = getattr(sm, "_l1_manager", None), getattr(smod, "_L1_WRITE_TAG", None)
    if keys and mgr is not None and tag is not None:
        mgr.finish_write_and_delete(keys, tag=tag)


def wait_in_l2(l2: L2Lookups, keys: list[ObjectKey], deadline: float) -> None:
    """Until some L2 adapter holds every key."""
    pending = list(keys)
    delay = _POLL_S[0]
    while True:
        found, _errors = l2.lookup(pending)
        present = [any(row[i] for row in found.values()) for i in range(len(pending))]
        pending = [k for k, p in zip(pending, present, strict=True) if not p]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} objects did not reach any L2 adapter in time")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def delete_everywhere(sm: StorageManager, keys: list[ObjectKey], deadline: float) -> None:
    """The keys' objects gone from L1 (waiting out readers' locks) and from every L2 adapter."""
    flush_l1(sm, keys, deadline)
    for _desc, l2 in sm.l2_adapters():
        l2.delete(keys)  # LMCache's adapters log a failed delete and return


def flush_l1(sm: StorageManager, keys: list[ObjectKey], deadline: float) -> None:
    """Delete stored keys from L1; the store controller holds a read lock until its L2 store
    completes, so locked keys are retried."""
    delay = _POLL_S[0]
    while True:
        _deleted, skipped = sm.delete_l1_keys(keys)
        if skipped == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{skipped} stored objects stayed locked in L1")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
