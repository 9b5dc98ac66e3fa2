"""A Mooncake cluster on one machine: one `mooncake_master` and several store hosts (`mooncake_client`),
each on free loopback ports, for the tests and benchmarks of engines sharing one store (issue 39).

    with MooncakeCluster(hosts=3, client_ttl_s=3) as cluster:
        spec = cluster.tier_spec(replica_num=2)   # a connector's Mooncake tier
        cluster.hosts[0].kill()                   # a lost host (SIGKILL)
        cluster.restart_host(0)                   # back on its port once the master forgot it
        cluster.restart_master()                  # a crashed master started again (every object lost)

The processes are the launcher's (MooncakeMaster, MooncakeStoreHost): forked by the one spawner thread,
stopped by process_spawner.stop_process.
"""

from __future__ import annotations

import time

from bsr_harness.mooncake_launcher import HOST, MooncakeMaster, MooncakeMasterError
from bsr_harness.mooncake_store_host import MooncakeStoreHost


class MooncakeCluster:
    """A master and `hosts` store hosts of `segment_bytes` each. `client_ttl_s`: the master's
    --client_ttl, how long it lists a lost host's objects (Mooncake's default 10 s)."""

    def __init__(self, hosts: int = 3, segment_bytes: int = 256 << 20, *, client_ttl_s: int | None = None,
                 remount_timeout_s: float = 30.0) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
        self.master = MooncakeMaster(client_ttl_s=client_ttl_s)
        self.hosts = [MooncakeStoreHost(self.master, segment_bytes, wait_forgotten=False,
                                        forget_timeout_s=max(20.0, 3.0 * (client_ttl_s or 10)))
                      for _ in range(hosts)]
        self.remount_timeout_s = remount_timeout_s

    def start(self) -> MooncakeCluster:
        self.master.start()
        try:
            for host in self.hosts:
                host.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for host in self.hosts:
            host.stop()
        self.master.stop()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def tier_spec(self, **options) -> dict:
        """A connector's Mooncake tier on this cluster (an engine mounts no segment of its own)."""
        return {"type": "mooncake", "master_address": self.master.master_address,
                "metadata_server": self.master.metadata_server, "protocol": "tcp", "local_hostname": HOST, **options}

    def segment_of(self, host: MooncakeStoreHost) -> str:
        (segment,) = host.segments
        return segment

    def host_named(self, segment: str) -> MooncakeStoreHost:
        (host,) = [h for h in self.hosts if segment in h.segments]
        return host

    def restart_host(self, i: int) -> MooncakeStoreHost:
        """Host i started again on its port (after kill(): once the master forgot the lost segment)."""
        return self.hosts[i].start()

    def restart_master(self) -> None:
        """SIGKILL the master and start it again on its ports: every object and mount is lost; the store
        hosts mount their segments again by themselves (returns once all did, or raises)."""
        self.master.kill()
        self.master.start()
        self.wait_mounted()

    def wait_mounted(self) -> None:
        """Until the master lists every running host's segment (at most remount_timeout_s)."""
        want = {s for h in self.hosts if h.running() for s in h.segments}
        deadline = time.monotonic() + self.remount_timeout_s
        while not want <= self.master.segments():
            if time.monotonic() > deadline:
                missing = sorted(want - self.master.segments())
                raise MooncakeMasterError(f"store hosts not mounted within {self.remount_timeout_s:.0f} s: {missing}")
            time.sleep(0.2)
