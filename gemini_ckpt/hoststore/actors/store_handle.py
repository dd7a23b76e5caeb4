"""Finding or making the host store of a node: :func:`get_or_create_store` (a detached
:class:`~.host_store.HostStore` actor pinned to its node, its budget judged with the other
namespaces' stores there, :mod:`.budget`)."""

from __future__ import annotations

from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...errors import MemoryBudgetError
from ..names import ACTOR_ENV, RAY_NAMESPACE, store_name
from . import budget as budget_rules
from .host_store import HostStore


def get_or_create_store(
    namespace: str,
    node_id: str,
    budget_bytes: Optional[int] = None,
    *,
    timeout_s: float = 120.0,
    named: Optional[dict] = None,
    judge: bool = True,
):
    """The host store of ``node_id`` in ``namespace``, created there (hard node affinity) if
    missing. An existing store keeps its budget unless ``budget_bytes`` is given. Budgets are
    judged with the other namespaces' stores on the node (:mod:`.budget`): an explicit one that
    would pass the node's share raises MemoryBudgetError. ``named``: the cluster's gemini_ckpt
    actors (:func:`~gemini_ckpt.hoststore.names.named_actors`), when the caller looked them up once for many nodes.
    ``judge=False`` (the registry's event loop, placing a running job's store on a replacement
    node): no blocking call, the budget set without the other namespaces' (the job was admitted)."""
    others = None
    try:  # the usual case, a store that exists: one lookup, not an actor class built and shipped again
        handle = ray.get_actor(store_name(namespace, node_id), namespace=RAY_NAMESPACE)
    except ValueError:
        others = budget_rules.other_budgets(namespace, node_id, timeout_s, named) if judge else {}
        handle = (
            ray.remote(HostStore)
            .options(
                name=store_name(namespace, node_id),
                namespace=RAY_NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                max_restarts=0,
                num_cpus=0,
                max_concurrency=64,
                runtime_env={"env_vars": ACTOR_ENV},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(namespace, node_id, budget_bytes, others)
        )
    if budget_bytes is not None and not judge:
        handle.set_budget.remote(budget_bytes)
    elif budget_bytes is not None:
        created = others is not None
        if others is None:
            others = budget_rules.other_budgets(namespace, node_id, timeout_s, named)
        try:
            ray.get(handle.set_budget.remote(budget_bytes, others), timeout=timeout_s)
        except MemoryBudgetError:
            if created:  # refused: the store made for it goes too
                ray.kill(handle, no_restart=True)
            raise
    return handle
