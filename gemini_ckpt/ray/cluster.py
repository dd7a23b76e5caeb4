"""Host stores on a Ray cluster: names, slots, and starting, finding and stopping the actors.

**Names.** Every actor lives in the Ray namespace ``gemini_ckpt`` (whatever namespace the
job's driver runs in, so a restarted driver, ``python -m gemini_ckpt status`` and the
training ranks all find the same actors); the job is told apart by
``CheckpointConfig.namespace``: ``{ns}::store::{node_id}`` is the host store of a node and
``{ns}::registry`` the slot registry.

"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..config import CheckpointConfig

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
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


# --- starting, finding and stopping actors -----------------------------------------------------
ACTOR_ENV = {"RAY_task_events_report_interval_ms": "0", "MALLOC_ARENA_MAX": "2"}
"""The environment of host-store and registry processes. They make and take a few Ray calls per
version for as long as the job runs, and Ray's per-call bookkeeping grew their private memory
without end: an actor sending 20,000 small calls grew 59.7 -> 134.8 MB, ~3 KB per call, and kept
growing. Measured on Ray 2.60: without task events (nothing of ours reads them; the state API
just lists fewer tasks) the same actor grew 59.6 -> 65.2 MB, and with two malloc arenas (its
threads no longer spread the garbage over one arena each) 59.6 -> 84.3 MB, flat after the
first 5,000 calls."""


def get_or_create_registry(namespace: str):
    """The registry of ``namespace`` (created, detached, on the head node, on first use).
    The actors import ``gemini_ckpt`` (which imports nothing heavy: never torch)."""
    from .actors.registry import Registry

    return (ray.remote(Registry)
            .options(name=registry_name(namespace), namespace=RAY_NAMESPACE, get_if_exists=True,
                     lifetime="detached", max_restarts=0, num_cpus=0, runtime_env={"env_vars": ACTOR_ENV},
                     resources={"node:__internal_head__": 0.001})
            .remote(namespace))


def get_or_create_store(namespace: str, node_id: str, budget_bytes: Optional[int] = None):
    """The host store of ``node_id`` in ``namespace``, created there (hard node affinity) if
    missing. An existing store keeps its budget unless ``budget_bytes`` is given."""
    from .actors.host_store import HostStore

    handle = (ray.remote(HostStore)
              .options(name=store_name(namespace, node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
                       lifetime="detached", max_restarts=0, num_cpus=0, max_concurrency=64,
                       runtime_env={"env_vars": ACTOR_ENV},
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
