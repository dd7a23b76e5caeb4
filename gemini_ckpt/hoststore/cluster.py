"""Host stores on a Ray cluster: starting (or finding) a job's host stores and registry, and
stopping them. Names, lookup and the actors' environment are in :mod:`gemini_ckpt.hoststore.names`
(re-exported here); making one actor is :func:`~gemini_ckpt.hoststore.actors.store_handle.get_or_create_store`
and :func:`~gemini_ckpt.hoststore.actors.registry.get_or_create_registry`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable
from typing import Optional

import ray

from ..config import CheckpointConfig
from .actors.store_handle import get_or_create_store
from .actors.registry import get_or_create_registry
from .names import (
    ACTOR_ENV,
    RAY_NAMESPACE,
    alive_node_ids,
    current_node_id,
    ensure_ray,
    find_registry,
    find_store,
    named_actors,
    registry_name,
    store_name,
)

__all__ = [
    "ACTOR_ENV",
    "RAY_NAMESPACE",
    "alive_node_ids",
    "current_node_id",
    "ensure_ray",
    "find_registry",
    "find_store",
    "get_or_create_registry",
    "get_or_create_store",
    "named_actors",
    "registry_name",
    "shutdown_host_stores",
    "start_host_stores",
    "store_name",
]

log = logging.getLogger("gemini_ckpt")


def start_host_stores(
    config: CheckpointConfig, node_ids: Optional[Iterable[str]] = None, *, timeout_s: Optional[float] = None
) -> dict[str, object]:
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
    named = named_actors()  # once: each store's budget is judged with the other namespaces' on its node
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes)))) as pool:
        futures = {
            n: pool.submit(
                get_or_create_store,
                namespace,
                n,
                config.host_memory_budget_bytes,
                timeout_s=timeout_s or config.timeout_s,
                named=named,
            )
            for n in nodes
        }
        handles = {n: f.result() for n, f in futures.items()}
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
