"""Reads of objects that live in the fetching client's own Mooncake segment.

When a MooncakeTier client also hosts a segment of the store (global_segment_size > 0), some
objects of a window may sit in its own memory. Mooncake's get then copies them with one memcpy,
and the tier has to read every payload again for its CRC-32C: two passes over memory. Here the
tier asks the master where each object is (`batch_get_replica_desc`, one RPC for the window,
which leases the objects as a get does), and for every complete memory replica in this client's
segment it copies header and payload itself with the CPU library's checksumming copy
(bsr_kernels.host_crc.copy_crc32c): each piece is checksummed as it lands, one pass.

Why reading the segment in place is safe: the segment is this process's memory for the client's
lifetime; the lease keeps the object from being evicted while it is read; and whatever might still
change under the copy (an overwrite by another writer, say) cannot pass the header check (key,
tenant, registration, length) and the CRC of the bytes that landed. Objects elsewhere, missing or
in any doubt take the normal get path.
"""

from __future__ import annotations

from collections.abc import Sequence

from .mooncake_object import HEADER_SIZE


class LocalSegmentReader:
    """Finds the objects of a window held in this client's segment (mooncake_reads.py copies them)."""

    def __init__(self, store) -> None:
        self._store = store
        self.endpoint = store.get_hostname()
        from mooncake.store import ReplicaStatus  # the client is up, so the package is there

        self._complete = ReplicaStatus.COMPLETE  # (comparing enums: .name costs 2.6 us a call)

    def addresses(self, keys: Sequence[str], payload_sizes: Sequence[int]) -> dict[int, int]:
        """{index in keys: address of the object} for keys with a complete memory replica in this
        client's segment of HEADER_SIZE + payload_sizes[i] bytes; any failure of the lookup means
        {} (the get path reports it)."""
        try:
            descs = self._store.batch_get_replica_desc(list(keys))
        except Exception:  # noqa: BLE001 - the get path reports unreachable masters and missing keys
            return {}
        out: dict[int, int] = {}
        me, complete, get = self.endpoint, self._complete, descs.get
        try:  # ~3 us a key with the RPC: this loop is the path's Python cost, so it stays flat
            for i, key in enumerate(keys):
                for replica in get(key, ()):
                    if replica.status == complete and replica.is_memory_replica():
                        buf = replica.get_memory_descriptor().buffer_descriptor
                        if buf.transport_endpoint == me and buf.size == HEADER_SIZE + payload_sizes[i]:
                            out[i] = buf.buffer_address
                            break
        except Exception:  # noqa: BLE001 - an unexpected descriptor: the get path serves everything
            return {}
        return out
