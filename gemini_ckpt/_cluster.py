"""Host stores on a Ray cluster: names, slots, and starting, finding and stopping the actors.

**Names.** Every actor lives in the Ray namespace ``gemini_ckpt`` (whatever namespace the
job's driver runs in, so a restarted driver, ``python -m gemini_ckpt status`` and the
training ranks all find the same actors); the job is told apart by
``CheckpointConfig.namespace``: ``{ns}::store::{node_id}`` is the host store of a node and
``{ns}::registry`` the slot registry.

**Slots.** Placement works on hosts ``0..N-1`` ("slots"), which must mean the same nodes to
every rank and stay stable for the job. The registry (a small detached actor on the head
node) assigns them at a rendezvous: every rank joins with its node id; once all
``world_size`` ranks have joined, nodes that have no slot yet get one, in the order of the
lowest rank they host (slot 0 is rank 0's host). A node that joins later (a replacement
machine) takes over the lowest slot whose node is dead; only if there is none is a slot
appended. Slots are never renumbered, so holders of older versions stay where they were.

**Dead holders.** :func:`holders_for` is the rule for where a version goes: the placement's
holders of the owner's slot, with each dead slot replaced by the next live slot after the
owner in ring order that is not already a holder. Hosts whose holders are all alive keep
their placement; fewer than ``replicas`` live slots is an error (a version counts only when
every copy is acknowledged). A slot is dead for a rank once its store fails to answer (or did
not exist when the rank connected). A store that dies while its node lives is not replaced
during a run: the ranks of that host create a fresh one when they connect again (a job
restart), as does :func:`start_host_stores`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import placement

from . import _host_store
from .ray import transport
from ._config import CheckpointConfig
from ._errors import ConfigError
from ._host_store import HostStore, Registry

log = logging.getLogger("gemini_ckpt")

RAY_NAMESPACE = "gemini_ckpt"
_STORE, _REGISTRY = "::store::", "::registry"


def store_name(namespace: str, node_id: str) -> str:
    return f"{namespace}{_STORE}{node_id}"


def registry_name(namespace: str) -> str:
    return f"{namespace}{_REGISTRY}"


def ensure_ray(address: Optional[str] = None) -> None:
    """Connect this process to Ray if it is not yet (``address``, else ``RAY_ADDRESS``, else
    a new local instance)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(log_to_driver=False, include_dashboard=False)


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def alive_node_ids() -> list[str]:
    return _host_store.alive_node_ids()


# --- slots and placement -----------------------------------------------------------------------
@dataclass(frozen=True)
class SlotTable:
    """Slot ``i`` is the host with Ray node id ``nodes[i]``; ``epoch`` counts rendezvous."""

    namespace: str
    nodes: tuple[str, ...]
    epoch: int = 0
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> node id, at the last rendezvous

    @classmethod
    def from_registry(cls, namespace: str, data: dict) -> "SlotTable":
        return cls(namespace, tuple(data["nodes"]), data["epoch"], dict(data.get("ranks", {})))

    @property
    def hosts(self) -> int:
        return len(self.nodes)

    def slot_of(self, node_id: str) -> int:
        try:
            return self.nodes.index(node_id)
        except ValueError:
            raise LookupError(f"node {node_id[:12]} has no slot in namespace {self.namespace!r}") from None


def holders_for(slot: int, *, hosts: int, replicas: int, strategy: str = "auto",
                dead: Iterable[int] = ()) -> tuple[int, ...]:
    """The slots that keep ``slot``'s shards of the next version (see the module docstring).

    >>> holders_for(2, hosts=4, replicas=2, strategy="group")
    (2, 3)
    >>> holders_for(2, hosts=4, replicas=2, strategy="group", dead={3})
    (2, 0)
    """
    dead = frozenset(dead)
    if replicas > hosts:
        raise ConfigError(
            f"CheckpointConfig.replicas={replicas} needs {replicas} hosts but the job spans {hosts}; "
            f"lower replicas to at most {hosts} or run on more hosts")
    base = placement.make(strategy, hosts=hosts, replicas=replicas).holders(slot)
    chosen = [h for h in base if h not in dead]
    for k in range(1, hosts):
        if len(chosen) >= replicas:
            break
        candidate = (slot + k) % hosts
        if candidate not in dead and candidate not in chosen:
            chosen.append(candidate)
    if len(chosen) < replicas:
        live = hosts - len(dead)
        raise ConfigError(
            f"only {live} of {hosts} host stores are alive but CheckpointConfig.replicas={replicas}; "
            f"restart the dead hosts' stores (start_host_stores) or lower replicas")
    return tuple(chosen)


# --- starting, finding and stopping actors -----------------------------------------------------
def _ship_actors_by_value() -> None:
    # The actor module imports nothing from gemini_ckpt; shipping it by value keeps the actor
    # processes from importing the package (and torch): they start fast and stay small.
    ray.cloudpickle.register_pickle_by_value(_host_store)
    ray.cloudpickle.register_pickle_by_value(transport)


def get_or_create_registry(namespace: str):
    """The registry of ``namespace`` (created, detached, on the head node, on first use)."""
    _ship_actors_by_value()
    return (ray.remote(Registry)
            .options(name=registry_name(namespace), namespace=RAY_NAMESPACE, get_if_exists=True,
                     lifetime="detached", max_restarts=0, num_cpus=0,
                     resources={"node:__internal_head__": 0.001})
            .remote(namespace))


def get_or_create_store(namespace: str, node_id: str, budget_bytes: Optional[int] = None):
    """The host store of ``node_id`` in ``namespace``, created there (hard node affinity) if
    missing. An existing store keeps its budget unless ``budget_bytes`` is given."""
    _ship_actors_by_value()
    handle = (ray.remote(HostStore)
              .options(name=store_name(namespace, node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
                       lifetime="detached", max_restarts=0, num_cpus=0, max_concurrency=32,
                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
              .remote(namespace, node_id, budget_bytes))
    if budget_bytes is not None:
        handle.set_budget.remote(budget_bytes)
    return handle


def find_store(namespace: str, node_id: str):
    """The host store of ``node_id``, or None when it does not exist (never started, or dead)."""
    try:
        return ray.get_actor(store_name(namespace, node_id), namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def find_registry(namespace: str):
    try:
        return ray.get_actor(registry_name(namespace), namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def named_actors() -> dict[str, dict[str, list[str]]]:
    """``{namespace: {"stores": [node ids], "registry": [name]}}`` of every gemini_ckpt actor."""
    out: dict[str, dict[str, list[str]]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != RAY_NAMESPACE:
            continue
        name = entry["name"]
        if _STORE in name:
            ns, node = name.split(_STORE, 1)
            out.setdefault(ns, {"stores": [], "registry": []})["stores"].append(node)
        elif name.endswith(_REGISTRY):
            ns = name[: -len(_REGISTRY)]
            out.setdefault(ns, {"stores": [], "registry": []})["registry"].append(name)
    return out


def start_host_stores(config: CheckpointConfig, node_ids: Optional[Iterable[str]] = None,
                      *, timeout_s: Optional[float] = None) -> dict[str, object]:
    """Start (or find) the host store of every alive node, or of ``node_ids``, and the registry.

    Call it on the driver before training to create the stores with the job's budget; ranks
    also create their own host's store on first use, so this is optional. Returns
    ``{node_id: actor handle}`` once every store answers.

    Example::

        start_host_stores(CheckpointConfig(namespace="run-7"))
        ...
        shutdown_host_stores("run-7")
    """
    ensure_ray()
    namespace = config.resolved_namespace
    nodes = sorted(node_ids) if node_ids is not None else alive_node_ids()
    get_or_create_registry(namespace)
    handles = {n: get_or_create_store(namespace, n, config.host_memory_budget_bytes) for n in nodes}
    ray.get([h.ping.remote() for h in handles.values()], timeout=timeout_s or config.timeout_s)
    return handles


def shutdown_host_stores(namespace: Optional[str] = None) -> list[str]:
    """Kill the host stores and registry of ``namespace`` (default: the default namespace);
    their kept versions are gone. Returns the names of the actors killed."""
    ensure_ray()
    namespace = namespace or CheckpointConfig().resolved_namespace
    found = named_actors().get(namespace, {"stores": [], "registry": []})
    names = [store_name(namespace, n) for n in found["stores"]] + found["registry"]
    killed = []
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
            killed.append(name)
        except ValueError:
            pass  # died meanwhile
    return killed
