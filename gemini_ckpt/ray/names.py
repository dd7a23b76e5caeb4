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

import logging
import os
import threading
import time
from typing import Optional

import ray

RAY_NAMESPACE = "gemini_ckpt"
_STORE, _REGISTRY = "::store::", "::registry"

ACTOR_ENV = {"RAY_task_events_report_interval_ms": "0", "MALLOC_ARENA_MAX": "2"}
"""The environment of host-store and registry processes. They make and take a few Ray calls per
version for as long as the job runs, and Ray's per-call bookkeeping grew their private memory
without end: an actor sending 20,000 small calls grew 59.7 -> 134.8 MB, ~3 KB per call, and kept
growing. Measured on Ray 2.60: without task events (nothing of ours reads them; the state API
just lists fewer tasks) the same actor grew 59.6 -> 65.2 MB, and with two malloc arenas (its
threads no longer spread the garbage over one arena each) 59.6 -> 84.3 MB, flat after the
first 5,000 calls."""


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


FENCE_CHECK_S = 3.0


def exit_when_node_declared_dead(what: str, *, period_s: float = FENCE_CHECK_S) -> threading.Thread:
    """End this process once the GCS says its own node is dead (a daemon thread asking every
    ``period_s``): a machine cut off from the cluster, declared dead and replaced, whose link
    comes back. Ray itself ends a dead node's workers when their raylet exits, but that check
    (the raylet's pid, every second) let two of them run on for more than 30 s once in three
    chaos runs (issue 24); a process that keeps shards or trains must not outlive its node. While
    the GCS cannot be reached, nothing happens; a GCS never brings a dead node back."""
    node_id = current_node_id()
    log = logging.getLogger("gemini_ckpt")

    def watch() -> None:
        while True:
            time.sleep(period_s)
            try:
                dead = any(n["NodeID"] == node_id and not n.get("Alive") for n in ray.nodes())
            except Exception:  # noqa: BLE001 - unreachable GCS (a partition): ask again later
                continue
            if dead:
                log.error("%s on node %s: the cluster declared this node dead; exiting (fenced)", what,
                          node_id[:12])
                logging.shutdown()
                os._exit(1)

    thread = threading.Thread(target=watch, name="gemini-fence", daemon=True)
    thread.start()
    return thread


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
