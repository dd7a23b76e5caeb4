"""A node's memory across namespaces: every job (namespace) has its own host store on a node,
and detached stores outlive their jobs, so the budgets are judged together.

- The stores of all namespaces on one node budget at most :data:`NODE_FRACTION` of its RAM;
  a store may take what the other namespaces' stores there leave of that share, or
  :data:`DEFAULT_FLOOR_BYTES` where they leave less: a job is not refused for a finished job's
  stores, and each store past the share adds at most that much.
- A store without an explicit budget gets :data:`DEFAULT_FRACTION` of the RAM, or less where
  that is all it may take (then with a warning that names the others).
- An explicit budget (``CheckpointConfig.host_memory_budget_bytes``) larger than it may take is
  refused (:class:`~gemini_ckpt.errors.MemoryBudgetError`, naming the others and the fixes).

The host store measures its node's RAM and is told the others' budgets (:func:`other_budgets`)
by whoever starts it (:func:`gemini_ckpt.hoststore.actors.store_handle.get_or_create_store`).
"""

from __future__ import annotations

from typing import Optional

from ...errors import MemoryBudgetError

DEFAULT_FRACTION = 0.3
"""A store's default budget: this fraction of its node's RAM, when the node has room."""
NODE_FRACTION = 0.6
"""What the stores of every namespace on one node may budget together (two default stores)."""
DEFAULT_FLOOR_BYTES = 1 << 30
"""What a store may take however much the others took (a default budget gets it then)."""


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _others(others: dict[str, int]) -> str:
    return ", ".join(f"{ns!r} {_gb(b)}" for ns, b in sorted(others.items())) or "none"


def choose(
    requested: Optional[int], others: dict[str, int], ram_bytes: int, *, namespace: str
) -> tuple[int, Optional[str]]:
    """(the budget, a warning or None) of ``namespace``'s store on a node of ``ram_bytes``, whose
    other namespaces' stores budget ``others`` (namespace -> bytes)."""
    share = int(NODE_FRACTION * ram_bytes)
    taken = sum(others.values())
    room = max(share - taken, DEFAULT_FLOOR_BYTES)
    if requested is not None:
        if requested > room:
            raise MemoryBudgetError(
                f"host_memory_budget_bytes={requested:,} for namespace {namespace!r}: the other namespaces' host "
                f"stores on this node ({_others(others)}) leave {_gb(room)} of the {NODE_FRACTION:.0%} of its "
                f"{_gb(ram_bytes)} of RAM that all stores on a node may budget. Give a smaller budget, or stop the "
                f"stores of finished jobs (gemini_ckpt.hoststore.cluster.shutdown_host_stores(namespace); their versions go)"
            )
        return int(requested), None
    default = int(DEFAULT_FRACTION * ram_bytes)
    budget = min(default, room)
    if budget >= default:
        return budget, None
    return budget, (
        f"host store of namespace {namespace!r}: the other namespaces' stores on this node budget "
        f"{_gb(taken)} ({_others(others)}), so this one gets {_gb(budget)}, not {DEFAULT_FRACTION:.0%} of the "
        f"node's {_gb(ram_bytes)}. Stop the stores of finished jobs "
        f"(gemini_ckpt.hoststore.cluster.shutdown_host_stores(namespace)) or set host_memory_budget_bytes"
    )


def other_budgets(namespace: str, node_id: str, timeout_s: float, named: Optional[dict] = None) -> dict[str, int]:
    """namespace -> budget of the other namespaces' live host stores on ``node_id`` (one that
    does not answer in time is left out: it cannot be using much). ``named``: what
    :func:`~gemini_ckpt.hoststore.names.named_actors` returned, to look it up once for many nodes."""
    import ray

    from ..names import RAY_NAMESPACE, named_actors, store_name

    calls = {}
    for ns, found in (named if named is not None else named_actors()).items():
        if ns != namespace and node_id in found["stores"]:
            try:
                calls[ns] = ray.get_actor(store_name(ns, node_id), namespace=RAY_NAMESPACE).budget.remote()
            except ValueError:
                continue  # ended meanwhile
    out = {}
    for ns, ref in calls.items():
        try:
            out[ns] = int(ray.get(ref, timeout=min(10.0, timeout_s)))
        except Exception:  # noqa: BLE001 - a dead or stuck store of another job
            continue
    return out
