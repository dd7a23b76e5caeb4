"""Where gemini_ckpt's actors live: their Ray namespace and names, finding them, and the
environment they run in. Imports nothing of ours, so the actors and the code that starts them
can both use it.

**Names.** Every actor lives in the Ray namespace ``gemini_ckpt`` (whatever namespace the
job's driver runs in, so a restarted driver, ``python -m gemini_ckpt status`` and the
training ranks all find the same actors); the job is told apart by
``CheckpointConfig.namespace``: ``{ns}::store::{node_id}`` is the host store of a node and
``{ns}::registry`` the slot registry.
"""

from __future__ import annotations

import os
from typing import Optional

import ray

RAY_NAMESPACE = "gemini_ckpt"
_STORE, _REGISTRY = "::store::", "::registry"

SETUP_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray's (ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)

ACTOR_ENV = {"RAY_task_events_report_interval_ms": "0", "MALLOC_ARENA_MAX": "2", SETUP_HOOK_VAR: ""}
"""The environment of host-store and registry processes. No setup hook: an actor inherits the
runtime env of the worker that creates it, and a Ray Train worker's may name a warm-up hook
(:func:`gemini_ckpt.integrations.ray_train.warm_runtime_env`) that imports torch and Ray Train,
several times the CPU a host store's own start takes, taken from the replacement worker it
serves while a replacement host starts. No task events and two malloc arenas: these actors make
and take a few Ray calls per version for as long as the job runs, and Ray's per-call bookkeeping
grew their private memory without end; nothing of ours reads task events (the state API just
lists fewer tasks), and with two arenas the threads no longer spread their garbage over one
arena each (the growth measured, with and without, is in docs/benchmarks.md)."""


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
