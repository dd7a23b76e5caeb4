"""Host stores of several namespaces on one node share its memory: their budgets together stay
within 60% of its RAM (gemini_ckpt.hoststore.actors.budget), judged on a real cluster with the stores
that are there."""

from __future__ import annotations

import psutil
import pytest
import ray

from gemini_ckpt import CheckpointConfig, MemoryBudgetError
from gemini_ckpt.hoststore.cluster import alive_node_ids, find_store, shutdown_host_stores, start_host_stores


@pytest.mark.ray
def test_budgets_are_judged_per_node_across_namespaces(ray_cluster):
    ram = psutil.virtual_memory().total  # every simulated host is this machine
    node = alive_node_ids()[-1]
    names = ["budget-a", "budget-b", "budget-c"]
    try:
        start_host_stores(CheckpointConfig(namespace="budget-a", host_memory_budget_bytes=int(0.5 * ram)), [node])
        with pytest.raises(MemoryBudgetError, match=r"'budget-a'.*leave .* of the 60%.*shutdown_host_stores"):
            start_host_stores(CheckpointConfig(namespace="budget-b", host_memory_budget_bytes=int(0.2 * ram)), [node])
        # a default budget takes what is left of the node's 60%: 10%, not 30%
        start_host_stores(CheckpointConfig(namespace="budget-c"), [node])
        left = ray.get(find_store("budget-c", node).budget.remote(), timeout=60)
        assert left == max(int(0.6 * ram) - int(0.5 * ram), min(int(0.3 * ram), 1 << 30))
        shutdown_host_stores("budget-a")  # a finished job's stores ended: room again
        start_host_stores(CheckpointConfig(namespace="budget-b", host_memory_budget_bytes=int(0.2 * ram)), [node])
        assert ray.get(find_store("budget-b", node).budget.remote(), timeout=60) == int(0.2 * ram)
    finally:
        for ns in names:
            shutdown_host_stores(ns)
