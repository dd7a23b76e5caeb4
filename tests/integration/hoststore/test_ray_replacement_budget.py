"""A replacement node is judged with the other jobs' host stores on it (issue 61, 10): the registry
starts the job's store there with the node's memory share in view, and passes over a node that
other jobs' stores fill (before, a node of the right kind took the lost host's copies whatever
else ran there: the budget was judged against nothing)."""

from __future__ import annotations

import pytest
import ray

from gemini_ckpt.hoststore.actors.budget import NODE_FRACTION
from gemini_ckpt.hoststore.actors.host_store import _ram_bytes
from gemini_ckpt.hoststore.actors.store_handle import get_or_create_store
from gemini_ckpt.hoststore.cluster import find_registry, find_store, shutdown_host_stores
from ray_helpers import node_id_of_host, status, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.ci]  # ~25 s: run by CI after the default suite

BUDGET = 2 << 30  # the job's explicit budget per host store


def test_a_node_other_jobs_fill_is_passed_over_as_a_replacement(ray_cluster, ranks):
    ns, other = "crowded", "crowded-other"
    ranks.restart(ns, host_memory_budget_bytes=BUDGET)
    before = ranks.train([0, 1])
    assert all(r["committed"] for per_rank in before for r in per_rank)
    registry = find_registry(ns)
    ray.get(registry.hold_rereplication.remote(), timeout=60)  # nothing adopted until the node is crowded
    try:
        old = node_id_of_host(1)
        ray_cluster.remove_hosts((1,))
        ray_cluster.add_host(1)
        new = node_id_of_host(1)
        # Another job's store on the new node, budgeting all but 256 MB of the node's share.
        share = int(NODE_FRACTION * _ram_bytes())
        get_or_create_store(other, new, share - (256 << 20))
        wait_for(lambda: not status(ns).host(1).store_alive, timeout=60, what="host 1's store known dead")
    finally:
        ray.get(registry.release_rereplication.remote(), timeout=60)
    try:
        wait_for(
            lambda: any("passed over for slot 1" in e["message"] for e in status(ns).events),
            timeout=60,
            what="the crowded node passed over",
        )
        st = status(ns)
        assert st.host(1).node_id == old and not st.host(1).store_alive  # the slot waits for a node with room
        assert not any("took over slot 1" in e["message"] for e in st.events)
        assert find_store(ns, new) is None  # the store made there for the job went with the refusal
    finally:
        shutdown_host_stores(other)
