"""A local Ray cluster of simulated hosts on this machine, for the demo, the chaos harness,
the tests and the benchmarks (``ray.cluster_utils.Cluster``).

A head node plus ``hosts`` nodes; host ``i`` carries the custom resource ``host{i}`` (so a
rank or worker is pinned with ``resources={"host{i}": 1}``). Node health checks are fast, so a
removed host is known dead within about a second. Removing a host is losing a machine: its
raylet, workers and host store die with it. ``Cluster`` is not thread-safe: add and remove
hosts from the thread that started the cluster. ``shutdown`` also kills every detached
gemini_ckpt actor (host stores, registries), which would otherwise outlive the test.

Example::

    cluster = LocalCluster(4).start()
    try:
        ...
        cluster.remove_hosts((2,))   # machine 2 is lost
        cluster.add_host(2)          # a replacement joins
    finally:
        cluster.shutdown()
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}
DEFAULT_OBJECT_STORE_BYTES = 120 << 20


class LocalCluster:
    """Head + ``hosts`` simulated hosts (see the module docstring). ``head_cpus=0`` keeps
    training workers off the head (it runs Ray Train's controller and the registries)."""

    def __init__(self, hosts: int, *, head_cpus: int = 0, object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
                 namespace: Optional[str] = None) -> None:
        self.hosts, self.head_cpus = hosts, head_cpus
        self.object_store_bytes, self.namespace = object_store_bytes, namespace
        self.cluster = None
        self._nodes: dict[int, object] = {}
        self._thread = threading.get_ident()

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> "LocalCluster":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError("this process is already connected to Ray; a LocalCluster starts its own: "
                               "call ray.shutdown() first (or pass the running LocalCluster along)")
        self._thread = threading.get_ident()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": self.head_cpus, "include_dashboard": False, "object_store_memory": self.object_store_bytes,
            "_system_config": FAST_HEALTH_CHECKS})
        try:
            for i in range(self.hosts):
                self.add_host(i)
            ray.init(address=self.cluster.address, log_to_driver=False, include_dashboard=False,
                     namespace=self.namespace)
        except BaseException:
            self.cluster.shutdown()
            raise
        return self

    def _main_thread_only(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(f"LocalCluster.{what} must run on the thread that started the cluster")

    def add_host(self, i: int):
        """Add simulated host ``i`` (a replacement for a removed one, or a new one)."""
        self._main_thread_only("add_host")
        node = self.cluster.add_node(num_cpus=1, resources={f"host{i}": 1},
                                     object_store_memory=self.object_store_bytes)
        self._nodes[i] = node
        return node

    def remove_hosts(self, hosts: tuple[int, ...], *, wait: bool = True, timeout: float = 60.0) -> None:
        """Hard-remove hosts at once (no graceful drain); with ``wait``, until Ray knows they are dead."""
        import ray

        self._main_thread_only("remove_hosts")
        ids = {self.node_id(i) for i in hosts} if wait else set()
        for i in hosts:
            self.cluster.remove_node(self._nodes.pop(i), allow_graceful=False)
        deadline = time.monotonic() + timeout
        while ids and any(n["Alive"] for n in ray.nodes() if n["NodeID"] in ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hosts {list(hosts)} were not reported dead within {timeout:.0f}s")
            time.sleep(0.2)

    def node_id(self, i: int) -> str:
        """The Ray node id of the live simulated host ``i``."""
        import ray

        for n in ray.nodes():
            if n["Alive"] and n["Resources"].get(f"host{i}"):
                return n["NodeID"]
        raise LookupError(f"no alive node with resource host{i}")

    def present(self) -> set[int]:
        """Hosts added and not removed."""
        return set(self._nodes)

    def ensure_hosts(self) -> list[int]:
        """Add back every host of ``0..hosts-1`` that was removed without a replacement."""
        added = [i for i in range(self.hosts) if i not in self._nodes]
        for i in added:
            self.add_host(i)
        return added

    def sweep(self) -> list[str]:
        """Kill every gemini_ckpt actor (host stores, registries) in the cluster; returns the
        namespaces that had some."""
        import ray

        from .cluster import named_actors, shutdown_host_stores

        if not ray.is_initialized():
            return []
        left = sorted(named_actors())
        for namespace in left:
            shutdown_host_stores(namespace)
        return left

    def shutdown(self) -> None:
        import ray

        try:
            self.sweep()
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
