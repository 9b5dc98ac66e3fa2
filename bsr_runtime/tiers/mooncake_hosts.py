"""A Mooncake tier in a cluster of store hosts: what a read and a put do about a lost host.

Mooncake's master places each object (each of its `replica_num` copies) in the segment of some store
host; a host that dies takes its segment with it, but the master lists its objects until the host's
client TTL passes (`mooncake_master --client_ttl`, 10 s by default), then forgets the host and every
copy it held. Meanwhile (seen with 0.3.13 over tcp):
- a get of an object whose copy the client picks (the first complete one in the master's list) lies
  on the lost host fails with TRANSFER_FAIL (-800), every time: the client never tries another copy;
- a put (or upsert) the master places on the lost host fails with TRANSFER_FAIL and the key is
  dropped; a put placed on live hosts succeeds.

So:
- a read that failed on a lost host, of an object with other copies, waits (bounded by the fetch's
  deadline, polling the master every FAILOVER_POLL_S) until the master lists it without the lost copy,
  then reads again: the restore commits from the surviving copy, later by at most the client TTL.
  An object with one copy fails the read at once (HostLostError: the restore fails closed);
- a put's keys that failed so are put again, at most PUT_RETRIES times, with the live hosts as the
  preferred segments (`ReplicateConfig.preferred_segments`): the hosts holding copies of the keys this
  put stored and of the last keys the tier stored, and every host the tier saw so, those whose
  transfer engine still takes a connection (its RPC address from the HTTP metadata server,
  `mooncake/rpc_meta/<segment>`; a killed host refuses at once, while the master may still list it),
  kept in the tier's HostBook. A repair save lands on the surviving
  hosts before the master has forgotten the lost one. Copies beyond the live hosts known (none known,
  or fewer than replica_num) the master places (at random by default: `mooncake_master
  --allocation_strategy`), so such a retry may land on the lost host again: after PUT_RETRIES the
  save fails (a later miss, counted), never a partial object.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence

from .base import FetchTimeoutError, HostLostError, TierUnavailableError
from .mooncake_client import TRANSFER_FAIL, check_port

FAILOVER_POLL_S = 0.2
PUT_RETRIES = 3
HOSTS_ASKED = 32  # keys whose copies name the live hosts a put retry prefers (one batch lookup)
CONNECT_CHECK_S = 0.2  # a host's port that takes no connection within this is not preferred

PutKeys = Callable[[list[int], object], list[int]]  # (indices of the keys, ReplicateConfig) -> codes


def replicate_config(replica_num: int, preferred: Sequence[str] = ()):
    """Mooncake's ReplicateConfig for a put of `replica_num` copies, preferring the segments `preferred`."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = replica_num
    if preferred:
        config.preferred_segments = list(preferred)
    return config


def replica_hosts(store, key: str) -> list[str]:
    """The store hosts (segment names) the master lists a complete in-memory copy of `key` on; [] when
    it lists none or cannot be asked."""
    from mooncake.store import ReplicaStatus

    try:
        replicas = store.get_replica_desc(key)
    except Exception:  # noqa: BLE001 - an unreachable master or a missing key: no copy to read
        return []
    return [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in replicas
            if r.status == ReplicaStatus.COMPLETE and r.is_memory_replica()]


def await_surviving_copy(store, lost: HostLostError, deadline: float, closing: threading.Event) -> None:
    """Return once the master lists `lost.key` without the copy a read just failed on while another
    copy remains (a read then gets that one). Raises `lost` at once for an object with a single copy
    (or none left), FetchTimeoutError when the master still lists the lost copy at `deadline`."""
    before = replica_hosts(store, lost.key)
    if len(before) < 2:
        raise lost
    while time.monotonic() + FAILOVER_POLL_S < deadline:
        if closing.wait(FAILOVER_POLL_S):
            raise TierUnavailableError("Mooncake tier closed while a read waited for a surviving copy") from lost
        now = replica_hosts(store, lost.key)
        if now != before:
            if not now:
                raise lost
            return
    raise FetchTimeoutError(f"{lost.key}: a copy on a lost store host ({lost}); the master still listed it at "
                            f"the fetch's deadline (it forgets a lost host after its --client_ttl)") from lost


class HostBook:
    """What a tier knows of the store hosts: the keys it stored last, every host it saw hold a copy, and
    where to ask whether a host answers (the HTTP metadata server)."""

    def __init__(self, metadata_server: str) -> None:
        self.metadata_server = metadata_server
        self.recent: deque[str] = deque(maxlen=HOSTS_ASKED)
        self.seen: set[str] = set()

    def live(self, store, stored_keys: Sequence[str]) -> list[str]:
        """The hosts holding copies of `stored_keys` or of the recent keys, and those seen before, that
        answer now (sorted; [] when none does or none can be asked)."""
        self.seen |= hosts_of(store, (list(stored_keys) + list(self.recent))[-HOSTS_ASKED:])
        return sorted(h for h in self.seen if answers(h, self.metadata_server))


def put_on_live_hosts(store, keys: Sequence[str], put: PutKeys, replica_num: int, stats: dict,
                      book: HostBook) -> list[int]:
    """The codes of `put` over every key, the keys the master placed on a lost host put again (at most
    PUT_RETRIES times) on the live hosts `book` knows, spread over them in turn; the keys stored go in
    the book."""
    codes = put(list(range(len(keys))), replicate_config(replica_num))
    for _ in range(PUT_RETRIES):
        lost = [i for i, c in enumerate(codes) if c == TRANSFER_FAIL]
        if not lost:
            break
        stats["put_retries"] = stats.get("put_retries", 0) + 1
        hosts = book.live(store, [k for k, c in zip(keys, codes, strict=True) if c == 0])
        turns = max(1, len(hosts))
        for turn in range(turns):
            mine = lost[turn::turns]
            preferred = hosts[turn:] + hosts[:turn]
            for i, code in zip(mine, put(mine, replicate_config(replica_num, preferred)), strict=True):
                codes[i] = code
    book.recent.extend(k for k, c in zip(keys, codes, strict=True) if c == 0)
    return codes


def hosts_of(store, keys: Sequence[str]) -> set[str]:
    """The hosts the master lists complete in-memory copies of `keys` on (empty when it cannot say)."""
    if not keys:
        return set()
    from mooncake.store import ReplicaStatus

    try:
        found = store.batch_get_replica_desc(list(keys))
    except Exception:  # noqa: BLE001 - the retry then lets the master place the keys
        return set()
    return {r.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for replicas in found.values() for r in replicas
            if r.status == ReplicaStatus.COMPLETE and r.is_memory_replica()}


def answers(segment: str, metadata_server: str) -> bool:
    """Whether the transfer engine of the store host `segment` takes a TCP connection now (its RPC address
    as the HTTP metadata server has it); False when that cannot be told (another metadata backend)."""
    if not metadata_server.startswith(("http://", "https://")):
        return False
    url = f"{metadata_server}?key={urllib.parse.quote(f'mooncake/rpc_meta/{segment}', safe='')}"
    try:
        with urllib.request.urlopen(url, timeout=5 * CONNECT_CHECK_S) as r:
            rpc = json.loads(r.read())
        check_port(str(rpc["ip_or_host_name"]), int(rpc["rpc_port"]), CONNECT_CHECK_S, "store host")
    except (OSError, ValueError, KeyError, TypeError, TierUnavailableError):
        return False
    return True
