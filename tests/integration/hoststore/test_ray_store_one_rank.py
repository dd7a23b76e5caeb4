"""Host stores on Ray, one rank and its store: the memory tier's contract, reads from a peer
through the read-ahead blocks (in any order, skipped, refused), the memory budget and the
footprint refused before anything is staged, and starting and stopping host stores.

These scenarios use the session's cluster (head + 4 simulated hosts) and no rank actors; each
connects a tier of its own, in its own namespace."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import ray

from gemini_ckpt import CheckpointConfig, MemoryBudgetError
from gemini_ckpt.hoststore.cluster import find_store
from ray_helpers import status, wait_for

HOSTS = 4


# --- Ray: one rank and its store ------------------------------------------------------------------
@pytest.mark.ray
def test_the_host_stores_keep_the_memory_tier_contract(ray_cluster):
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings
    from tier_contract import check_tier_contract

    tier = connect(
        store_settings(CheckpointConfig(namespace="contract", replicas=1, keep_in_memory=2, timeout_s=120)),
        rank=0,
        world_size=1,
    )
    try:
        check_tier_contract(tier, keep=2)
        # The store actors never import torch: small, and fast to start.
        actor = find_store("contract", tier.node_id)
        assert not ray.get(actor.__ray_call__.remote(lambda self: "torch" in sys.modules))
    finally:
        tier.close()


@pytest.mark.ray
def test_reads_from_a_peer_through_the_read_ahead_blocks_are_exact_in_any_order(ray_cluster):
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings
    from gemini_ckpt.hoststore.readahead import PeerCopy
    from tier_contract import save_filled

    tier = connect(
        store_settings(CheckpointConfig(namespace="readahead", replicas=1, timeout_s=120)), rank=0, world_size=1
    )
    try:
        plan = save_filled(tier, 5, 3.0)
        size = plan.shard.region_bytes
        local = tier.open(5)
        expected = np.asarray(local.copies[0][0].fetch(0, size)).copy()
        local.close()
        # The same copy read as a peer's is (pushed over the data plane), in blocks of 1 kB.
        slot = tier.reads.where(5).copies[0][0]
        peer = PeerCopy(tier.peer_reads, slot, tier.hosts.live()[slot], 5, 0, size, block_bytes=1024)
        ranges = [(0, 100), (100, 900), (1000, 48), (2000, 3000), (size - 7, 7), (10, 20), (0, size), (size, 0)]
        for offset, length in ranges:
            got = np.asarray(peer.fetch(offset, length))
            assert got.tobytes() == expected[offset : offset + length].tobytes(), (offset, length)
    finally:
        tier.close()


def _save_4mib(tier, step: int) -> int:
    """Hand ``step`` to ``tier``: one 4 MiB tensor (a read at a 1 MiB/s cap takes seconds); wait
    for its commit; returns the shard's region size."""
    import pickle

    import torch

    from gemini_ckpt.save.plan import make_plan
    from gemini_ckpt.save.stager import Stager

    w = torch.arange(1 << 20, dtype=torch.float32)
    state = {"model": {"w": w}, "rank_local": {"0": {"extra": pickle.dumps({})}}}
    plan, _ = make_plan(state, rank=0, world_size=1, group=None, job={"test": True})
    seg = tier.segment(plan.shard)
    Stager().stage(plan.shard, seg, [w])
    assert tier.hand_off(step, plan.shard, seg, [state["rank_local"]["0"]["extra"]]).result(timeout=120).committed
    return plan.shard.region_bytes


@pytest.mark.ray
def test_a_reader_that_skips_read_ahead_blocks_still_in_flight_reads_on(ray_cluster):
    """The reader jumps past blocks it asked for ahead while a slow peer (a bandwidth cap) still
    sends them, and back: every range it reads is exact, and no push it wants fails (the blocks
    it skipped are refused, and that must not close the channel the wanted ones share)."""
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings
    from gemini_ckpt.hoststore.readahead import PeerCopy

    tier = connect(
        store_settings(
            CheckpointConfig(namespace="readahead-skip", replicas=1, timeout_s=120, replication_bandwidth=1 << 20)
        ),
        rank=0,
        world_size=1,
    )
    try:
        size = _save_4mib(tier, 5)  # blocks of 256 KiB take ~0.25 s each at the cap
        local = tier.open(5)
        expected = np.asarray(local.copies[0][0].fetch(0, size)).copy()
        local.close()
        slot = tier.reads.where(5).copies[0][0]
        block = 256 << 10
        for _ in range(2):
            peer = PeerCopy(tier.peer_reads, slot, tier.hosts.live()[slot], 5, 0, size, block_bytes=block)
            for offset, length in [(0, 10), (size - 7, 7), (3 * block, 10), (size - 1, 1), (0, 5)]:
                got = np.asarray(peer.fetch(offset, length))
                assert got.tobytes() == expected[offset : offset + length].tobytes(), (offset, length)
    finally:
        tier.close()


@pytest.mark.ray
def test_a_range_the_reader_refuses_leaves_its_other_pushes_landing(ray_cluster):
    """A reader's pushes share one channel from the store. The reader refuses a range it no
    longer wants (its buffer is gone: a skipped read-ahead block) while another is still being
    sent at a bandwidth cap: the refused push reports nothing landed, and the other one lands,
    exact. (Before, the refusal closed the shared channel and failed the wanted push: the rare
    "the channel ... was closed" of the read-ahead tests.)"""
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings
    from gemini_ckpt.hoststore.readahead import PeerCopy

    tier = connect(
        store_settings(
            CheckpointConfig(namespace="readahead-refuse", replicas=1, timeout_s=120, replication_bandwidth=1 << 20)
        ),
        rank=0,
        world_size=1,
    )
    try:
        size = _save_4mib(tier, 5)  # ~4 s at the cap
        local = tier.open(5)
        expected = np.asarray(local.copies[0][0].fetch(0, size)).copy()
        local.close()
        slot = tier.reads.where(5).copies[0][0]
        peer = PeerCopy(tier.peer_reads, slot, tier.hosts.live()[slot], 5, 0, size)
        assert np.asarray(peer.fetch(0, 8)).tobytes() == expected[:8].tobytes()  # the channel is made
        wanted = np.zeros(size, np.uint8)
        landing = peer.receive_into([(0, wanted)])
        time.sleep(0.3)  # the wanted push is being sent
        refused = peer.receive_into([(0, np.empty(1024, np.uint8))])
        refused.buffers.clear()  # the reader lets go of that buffer at once: the range is refused
        landing.result()
        assert wanted.tobytes() == expected.tobytes()
        with pytest.raises(LookupError, match="sent 0 of the 1024 bytes"):
            refused.result()
    finally:
        tier.close()


@pytest.mark.ray
def test_a_save_over_the_memory_budget_is_refused_before_anything_is_dropped(ray_cluster):
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings
    from tier_contract import save_filled

    tier = connect(
        store_settings(
            CheckpointConfig(
                namespace="budget", replicas=1, keep_in_memory=1, host_memory_budget_bytes=12_000, timeout_s=120
            )
        ),
        rank=0,
        world_size=1,
    )
    try:
        plan = save_filled(tier, 1, 1.0)  # one version of ~8.5 kB fits; a second segment does not
        with pytest.raises(MemoryBudgetError) as info:
            tier.segment(plan.shard)
        assert "12,000" in str(info.value)
        assert tier.committed_steps() == [1]  # nothing was dropped to make room
    finally:
        tier.close()


@pytest.mark.ray
def test_the_footprint_is_known_before_the_first_save_and_over_budget_is_refused(ray_cluster):
    import dataclasses

    import torch

    from gemini_ckpt import Checkpointer, TrainState

    state = TrainState(model=torch.nn.Linear(64, 64))  # a shard of ~16.7 kB
    config = CheckpointConfig(
        namespace="footprint",
        replicas=1,
        keep_in_memory=2,
        max_inflight=1,
        host_memory_budget_bytes=40_000,
        timeout_s=120,
    )
    ckpt = Checkpointer(state, config)
    try:  # 3 versions (keep_in_memory + max_inflight) need ~50 kB: refused before a byte is staged
        with pytest.raises(MemoryBudgetError, match="host_memory_budget_bytes") as info:
            ckpt.save(0)
        assert "budget 40,000" in str(info.value) and ckpt.inflight == 0
        assert ckpt.store.committed_steps() == []
    finally:
        ckpt.close()
    ok = dataclasses.replace(config, namespace="footprint-ok", host_memory_budget_bytes=1 << 20)
    ckpt = Checkpointer(state, ok)
    try:
        ckpt.save(0).committed.result(timeout=120)
        (need,) = ckpt.stats.footprint.values()
        assert need == 3 * ckpt.stats.staging_bytes  # what the DESIGN says: K x m x shard + staging
    finally:
        ckpt.close()
    assert [h.footprint_bytes for h in status("footprint-ok").hosts if h.footprint_bytes] == [need]


@pytest.mark.ray
def test_start_and_shutdown_host_stores(ray_cluster):
    from gemini_ckpt.hoststore.cluster import alive_node_ids, named_actors, shutdown_host_stores, start_host_stores

    handles = start_host_stores(CheckpointConfig(namespace="started", host_memory_budget_bytes=1 << 20, timeout_s=120))
    assert sorted(handles) == alive_node_ids() and len(handles) == HOSTS + 1  # the head node too
    st = status("started")
    assert len(st.hosts) == HOSTS + 1
    assert all(h.slot is None and h.store_alive and h.budget_bytes == 1 << 20 for h in st.hosts)  # no ranks yet
    assert "spare" in st.format()
    assert len(shutdown_host_stores("started")) == HOSTS + 2  # the stores and the registry
    wait_for(lambda: "started" not in named_actors(), what="the actors to be gone")
