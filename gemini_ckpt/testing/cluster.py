"""A local Ray cluster of simulated hosts on this machine, for the demo, the chaos harness,
the tests and the benchmarks (``ray.cluster_utils.Cluster``).

A head node plus ``hosts`` nodes; host ``i`` carries the custom resource ``host{i}`` (so a
rank or worker is pinned with ``resources={"host{i}": 1}``) and the label
``gemini-ckpt.io/host=i`` (:data:`~gemini_ckpt.hoststore.slots.HOST_LABEL`: Ray Train's workers are
pinned with ``ScalingConfig(label_selector=gemini_ckpt.ray_train.ranks_on_hosts(n))``; a
replacement added with :meth:`LocalCluster.add_host` carries the label of the host it replaces). Node health checks
(:data:`HEALTH_CHECKS`) tell a dead host from a busy one: a removed host is known dead in about
3 s, while one that stops answering for less than ~15 s (a loaded machine, a paused raylet) is
not declared dead. Removing a host is losing a machine: its raylet, workers and host store die
with it. A host that Ray declares dead without being removed (``unasked_deaths``) is replaced
by :meth:`LocalCluster.heal`. ``Cluster`` is not thread-safe: add and remove
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

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterator, Optional

from ..errors import ConfigError
from .netns import Network, parse_rate
from .netns_node import NetnsNode
from ..hoststore.slots import HOST_LABEL

log = logging.getLogger("gemini_ckpt")

HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 6,
}
"""How the head's GCS decides that a node is dead: 6 failed checks in a row, one every 0.5 s,
each allowed 2 s. A killed raylet refuses the check at once, so a removed host is dead after
~6 x 0.5 s; a stopped or starved one fails a check only after its 2 s timeout, so it must stay
silent for ~6 x 2.5 s = 15 s. Tighter settings declared briefly starved raylets dead, and a
busy test suite lost healthy hosts (the measurements are in docs/recovery.md)."""
DEFAULT_OBJECT_STORE_BYTES = 120 << 20
NETWORKS = ("loopback", "netns")
"""``loopback``: every host on this machine's one interface (the default). ``netns``: each host in
its own network namespace with its own address and link (:mod:`gemini_ckpt.testing.netns`)."""


class LocalCluster:
    """Head + ``hosts`` simulated hosts (see the module docstring). ``head_cpus=0`` keeps
    training workers off the head (it runs Ray Train's controller and the registries)."""

    def __init__(
        self,
        hosts: int,
        *,
        head_cpus: int = 0,
        object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
        namespace: Optional[str] = None,
        cpus_per_host: int = 1,
        network: str = "loopback",
        link: str | int | None = None,
        labels: Optional[Callable[[int], dict[str, str]]] = None,
        qos: bool = False,
    ) -> None:
        if network not in NETWORKS:
            raise ConfigError(f"LocalCluster(network={network!r}): choose one of {', '.join(NETWORKS)}")
        if link is not None and network != "netns":
            raise ConfigError(f"LocalCluster(link={link!r}) shapes the hosts' own links: it needs network='netns'")
        if link is not None:
            parse_rate(link)
        if qos and link is None:
            raise ConfigError(
                "LocalCluster(qos=True) makes the hosts' shaped links honour traffic priority: it needs "
                "network='netns' and a link rate, e.g. link='1gbit'"
            )
        self.qos = qos
        self.hosts, self.head_cpus, self.cpus_per_host = hosts, head_cpus, cpus_per_host
        self.labels = labels  # host i -> extra Ray node labels, e.g. lambda i: {"rack": str(i // 2)}
        self.object_store_bytes, self.namespace = object_store_bytes, namespace
        self.network, self.link = network, link
        self.net = None  # a gemini_ckpt.testing.netns.Network with network="netns"
        self.cluster = None
        self._nodes: dict[int, object] = {}
        self._netns_of: dict[int, int] = {}  # host -> the namespace its node runs in (network="netns")
        self._thread = threading.get_ident()

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self, *, log_to_driver: bool = False) -> "LocalCluster":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError(
                "this process is already connected to Ray; a LocalCluster starts its own: "
                "call ray.shutdown() first (or pass the running LocalCluster along)"
            )
        self._thread = threading.get_ident()
        head = {
            "num_cpus": self.head_cpus,
            "include_dashboard": False,
            "object_store_memory": self.object_store_bytes,
            "_system_config": HEALTH_CHECKS,
        }
        if self.network == "netns":
            self.net = Network.create(link=self.link, qos=self.qos)
            head["node_ip_address"] = self.net.head_address
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
            # connected before the hosts start: a netns host is known alive through the driver
            ray.init(
                address=self.cluster.address,
                log_to_driver=log_to_driver,
                include_dashboard=False,
                namespace=self.namespace,
            )
            for i in range(self.hosts):
                self.add_host(i)
        except BaseException:
            self._stop()
            raise
        return self

    def _main_thread_only(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(f"LocalCluster.{what} must run on the thread that started the cluster")

    def add_host(self, i: int, *, beside: bool = False):
        """Add simulated host ``i`` (a replacement for a removed one, or a new one). ``beside``
        (network='netns'): in a namespace of its own, leaving host ``i``'s old one (and whatever
        still runs there, e.g. a partitioned node Ray declared dead) alone; returns the node, and
        :meth:`netns_index` says where it runs."""
        self._main_thread_only("add_host")
        labels = {**(self.labels(i) if self.labels else {}), HOST_LABEL: str(i)}
        if self.net is not None:
            where = i
            if beside:
                taken = set(self.net.hosts()) | set(self._netns_of.values()) | set(range(self.hosts))
                where = next(k for k in range(self.hosts, 10**6) if k not in taken)
            node = NetnsNode.start(
                self.net,
                where,
                address=self.cluster.address,
                cpus=self.cpus_per_host,
                resources={f"host{i}": 1},
                labels=labels,
                object_store_bytes=self.object_store_bytes,
            )
            self._netns_of[i] = where
        else:
            node = self.cluster.add_node(
                num_cpus=self.cpus_per_host,
                resources={f"host{i}": 1},
                labels=labels,
                object_store_memory=self.object_store_bytes,
            )
        self._nodes[i] = node
        return node

    def _remove(self, i: int) -> None:
        node = self._nodes.pop(i)
        if isinstance(node, NetnsNode):
            node.kill()
        else:
            self.cluster.remove_node(node, allow_graceful=False)

    def remove_hosts(self, hosts: tuple[int, ...], *, wait: bool = True, timeout: float = 60.0) -> None:
        """Hard-remove hosts at once (no graceful drain); with ``wait``, until Ray knows they are dead."""
        import ray

        self._main_thread_only("remove_hosts")
        ids = {self.node_id(i) for i in hosts} if wait else set()
        for i in hosts:
            self._remove(i)
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

    def unasked_deaths(self) -> list[int]:
        """Hosts that were never removed but that Ray reports dead (a false death on a loaded
        machine, or a crashed raylet)."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return sorted(i for i, node in self._nodes.items() if getattr(node, "node_id", None) not in alive)

    def heal(self) -> list[int]:
        """Replace every host in :meth:`unasked_deaths` with a fresh node (same ``host{i}``);
        returns the hosts replaced."""
        self._main_thread_only("heal")
        dead = self.unasked_deaths()
        for i in dead:
            try:
                self._remove(i)
            except Exception:  # noqa: BLE001 - its processes may be gone already
                self._nodes.pop(i, None)
            self.add_host(i)
        return dead

    def raylet_pid(self, i: int) -> int:
        """The process id of host ``i``'s raylet."""
        node = self._nodes[i]
        if isinstance(node, NetnsNode):
            return node.raylet_pid()
        return node.all_processes["raylet"][0].process.pid

    @contextlib.contextmanager
    def paused(self, i: int) -> Iterator[None]:
        """Host ``i``'s raylet stopped (SIGSTOP) inside the block, going on (SIGCONT) after it:
        a node that is alive but does not answer, as on a machine under heavy load."""
        import signal

        pid = self.raylet_pid(i)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def describe(self) -> str:
        """The cluster's state in a few lines: every node (alive or dead, its resources and what
        is free), and the placement groups that are not placed yet (what ``fit()`` waits for)."""
        import ray

        if not ray.is_initialized():
            return "not connected to Ray"
        lines = []
        host_of = {getattr(n, "node_id", None): i for i, n in self._nodes.items()}
        try:
            available = ray.available_resources()
        except Exception:  # noqa: BLE001 - best effort while diagnosing
            available = {}
        for n in ray.nodes():
            name = (
                f"host {host_of[n['NodeID']]}"
                if n["NodeID"] in host_of
                else ("head" if "node:__internal_head__" in n.get("Resources", {}) else "node")
            )
            state = "alive" if n["Alive"] else "DEAD"
            cpus = n.get("Resources", {}).get("CPU", 0)
            lines.append(f"{name:8s} {n['NodeID'][:12]} {state:5s} CPU {cpus:g}")
        lines.append(f"free: CPU {available.get('CPU', 0):g} of {ray.cluster_resources().get('CPU', 0):g}")
        try:
            from ray.util import placement_group_table

            for pg_id, pg in placement_group_table().items():
                if pg.get("state") not in ("CREATED", "REMOVED"):
                    lines.append(
                        f"placement group {pg_id[:12]} {pg.get('state')}: bundles {pg.get('bundles')} "
                        f"({pg.get('strategy')})"
                    )
        except Exception as exc:  # noqa: BLE001
            lines.append(f"placement groups: unknown ({type(exc).__name__})")
        missing = sorted(set(range(self.hosts)) - set(self._nodes))
        if missing:
            lines.append(f"removed and not replaced: hosts {missing}")
        return "\n".join(lines)

    def ensure_hosts(self) -> list[int]:
        """Add back every host of ``0..hosts-1`` that was removed without a replacement, and
        replace any that died without being removed (:meth:`heal`, logged as a warning).
        Returns the hosts added."""
        healed = self.heal()
        if healed:
            log.warning("hosts %s were declared dead by Ray without being removed; replaced", healed)
        missing = [i for i in range(self.hosts) if i not in self._nodes]
        for i in missing:
            self.add_host(i)
        return sorted(healed + missing)

    def sweep(self) -> list[str]:
        """Kill every gemini_ckpt actor (host stores, registries) in the cluster; returns the
        namespaces that had some."""
        import ray

        from ..hoststore.cluster import named_actors, shutdown_host_stores

        if not ray.is_initialized():
            return []
        left = sorted(named_actors())
        for namespace in left:
            shutdown_host_stores(namespace)
        return left

    def shutdown(self) -> None:
        try:
            self.sweep()
        finally:
            self._stop()

    def _stop(self) -> None:
        import ray

        try:
            ray.shutdown()
            for node in self._nodes.values():
                if isinstance(node, NetnsNode):
                    node.kill()
            self._nodes.clear()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
        finally:
            if self.net is not None:
                self.net.destroy()
                self.net = None

    # -- the network (network="netns") ------------------------------------------------------------
    def _netns(self, what: str):
        if self.net is None:
            raise ConfigError(f"LocalCluster.{what} needs the hosts' own links: start it with network='netns'")
        return self.net

    def netns_index(self, i: int) -> int:
        """The namespace (``Network`` host index) host ``i``'s node runs in: ``i`` unless it was
        added ``beside`` its old one."""
        self._netns("netns_index")
        return self._netns_of.get(i, i)

    def host_address(self, i: int) -> str:
        """Host ``i``'s own address (network='netns')."""
        return self._netns("host_address").address(self.netns_index(i))

    def set_link(self, i: int, up: bool) -> None:
        """Host ``i``'s link up or down: cut off from every other host (and the head), but alive."""
        self._netns("set_link").set_link(self.netns_index(i), up)

    @contextlib.contextmanager
    def partitioned(self, i: int) -> Iterator[None]:
        """Host ``i`` cut off inside the block (a switch failure), its link back up after it."""
        with self._netns("partitioned").partitioned(self.netns_index(i)):
            yield

    def shape(self, i: int, rate: str | int) -> None:
        """Host ``i``'s link at ``rate`` from now on, both ways (``"10mbit"``: a slow link)."""
        self._netns("shape").shape(self.netns_index(i), rate)
