"""Host stores on Ray: copies follow the placement, only fully acknowledged versions count,
host memory outlives a killed worker, a dead holder fails one version and not the job, a
replacement host takes over the dead host's slot, and the data plane and the attach socket let
nobody in without the namespace's secret.

The Ray scenarios share one cluster (head + 4 simulated hosts) and one set of 4 rank actors
(rank i on host i, so slot i is host i); each scenario (re)starts the job in its own namespace.
Run: ``RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python -m pytest tests/test_ray_store.py -q -x``
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from gemini_ckpt import CheckpointConfig, ConfigError, MemoryBudgetError
from gemini_ckpt.hoststore.cluster import find_store
from gemini_ckpt.hoststore.fence import ALIVE, DEAD, asker, declared_dead, gcs_address, second_look
from gemini_ckpt.hoststore.resolve import resolve
from gemini_ckpt.hoststore.slots import holders_for
from ray_helpers import node_id_of_host, status, wait_for

HOSTS = 4


# --- no Ray ------------------------------------------------------------------------------------
def test_holders_rule_keeps_placement_and_replaces_dead_slots_by_ring_successors():
    group = [holders_for(s, hosts=4, replicas=2, strategy="group") for s in range(4)]
    assert group == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert holders_for(2, hosts=4, replicas=2, strategy="group", dead={3}) == (2, 0)
    assert holders_for(3, hosts=4, replicas=2, strategy="group", dead={3}) == (2, 0)
    assert holders_for(0, hosts=4, replicas=2, strategy="group", dead={3}) == (0, 1)  # untouched
    assert holders_for(0, hosts=5, replicas=3, strategy="ring", dead={1}) == (0, 2, 3)
    assert holders_for(4, hosts=5, replicas=3, strategy="ring", dead={0, 1}) == (4, 2, 3)
    with pytest.raises(ConfigError, match="replicas=2"):
        holders_for(0, hosts=4, replicas=2, dead={1, 2, 3})
    with pytest.raises(ConfigError, match="needs 3 hosts"):
        holders_for(0, hosts=2, replicas=3)


def _entry(epoch, state, shards, world=2):
    """One store's ``index()`` entry: shards given as rank -> owner slot (all complete)."""
    return {
        "epoch": epoch,
        "state": state,
        "world_size": world,
        "shards": {r: {"owner": o, "complete": True, "plan_id": "p", "nbytes": 10} for r, o in shards.items()},
    }


def test_a_step_counts_only_when_committed_somewhere_with_every_shard_on_a_live_store():
    whole = {0: {7: _entry(1, "committed", {0: 0, 1: 1})}, 1: {7: _entry(1, "prepared", {1: 1, 0: 0})}}
    v = resolve(whole, local_slot=1)[7]
    assert v.committed and v.copies == {0: (1, 0), 1: (1, 0)}  # this node first, then the owner
    assert resolve(whole, local_slot=0)[7].copies == {0: (0, 1), 1: (0, 1)}
    lost = {0: {7: _entry(1, "committed", {0: 0})}}  # slot 1 is gone with the only copy of rank 1's shard
    assert not resolve(lost)[7].committed and resolve(lost)[7].lost
    nobody = {0: {7: _entry(1, "prepared", {0: 0, 1: 1})}}  # voted, never decided: not trusted
    assert not resolve(nobody)[7].committed
    # A step saved again in a newer epoch: the newest committed epoch wins, and copies of
    # another epoch are never mixed in.
    again = {0: {7: _entry(1, "committed", {0: 0, 1: 1})}, 1: {7: _entry(2, "committed", {0: 0, 1: 1})}}
    assert resolve(again)[7].epoch == 2 and resolve(again)[7].copies == {0: (1,), 1: (1,)}
    aborted = {0: {7: _entry(2, "committed", {0: 0})}, 1: {7: _entry(2, "aborted", {1: 1})}}
    assert not resolve(aborted)[7].committed


# --- Ray: one rank and its store ------------------------------------------------------------------
@pytest.mark.ray
def test_the_host_stores_keep_the_memory_tier_contract(ray_cluster):
    from gemini_ckpt.hoststore.client import connect
    from tier_contract import check_tier_contract

    tier = connect(
        CheckpointConfig(namespace="contract", replicas=1, keep_in_memory=2, timeout_s=120), rank=0, world_size=1
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
    from gemini_ckpt.hoststore.readahead import PeerCopy
    from tier_contract import save_filled

    tier = connect(CheckpointConfig(namespace="readahead", replicas=1, timeout_s=120), rank=0, world_size=1)
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
    from gemini_ckpt.hoststore.readahead import PeerCopy

    tier = connect(
        CheckpointConfig(namespace="readahead-skip", replicas=1, timeout_s=120, replication_bandwidth=1 << 20),
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
    from gemini_ckpt.hoststore.readahead import PeerCopy

    tier = connect(
        CheckpointConfig(namespace="readahead-refuse", replicas=1, timeout_s=120, replication_bandwidth=1 << 20),
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
    from tier_contract import save_filled

    tier = connect(
        CheckpointConfig(
            namespace="budget", replicas=1, keep_in_memory=1, host_memory_budget_bytes=12_000, timeout_s=120
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


# --- Ray: a training job of 4 ranks on 4 hosts ---------------------------------------------------------
@pytest.fixture(scope="module")
def trained(ranks):
    """Namespace "repl": 5 saves with replicas=2, keep_in_memory=2 (group placement)."""
    ranks.restart("repl")
    return ranks.train(range(5))


@pytest.mark.ray
def test_each_host_holds_its_own_and_its_peers_shards_of_the_newest_versions(trained, ranks):
    assert all(r["committed"] for per_rank in trained for r in per_rank), trained
    st = status("repl")
    assert st.committed_steps == [3, 4]
    assert [v.step for v in st.versions] == [3, 4]  # older versions are gone everywhere
    for slot in range(HOSTS):
        host = st.host(slot)
        assert host.node_id == node_id_of_host(slot) and host.store_alive
        assert host.versions == (3, 4)
        assert (host.own_shards, host.replica_shards) == (2, 2)
    for version in st.versions:
        assert version.state == "committed"
        assert [s.rank for s in version.shards] == list(range(HOSTS))
        for shard in version.shards:
            assert shard.owner == shard.rank
            assert sorted(shard.copies) == sorted(holders_for(shard.owner, hosts=HOSTS, replicas=2))
    for slot in range(HOSTS):
        held = sum(s.nbytes for v in st.versions for s in v.shards if slot in s.copies)
        assert st.host(slot).held_bytes == held


@pytest.mark.ray
def test_status_cli(trained, ray_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemini_ckpt",
            "status",
            "--namespace",
            "repl",
            "--json",
            "--address",
            ray_cluster.address,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (ns,) = doc["namespaces"]
    assert ns["committed_steps"] == [3, 4] and len(ns["hosts"]) == HOSTS
    text = status("repl").format()
    print(text)
    assert "committed" in text and "rank 3" in text


@pytest.mark.ray
def test_a_killed_worker_restores_from_its_hosts_memory(trained, ranks):
    os.kill(ranks.infos[2]["pid"], signal.SIGKILL)
    wait_for(lambda: not ranks.alive(2), what="rank 2 to die")
    ranks.restart("repl")  # the job restarts: a new rank-2 process on host 2, a new process group
    restored = ranks.call("restore")
    for rank in range(HOSTS):
        assert restored[rank]["step"] == 4
        assert restored[rank]["digest"] == trained[rank][-1]["digest"], f"rank {rank} is not bit-identical"
    assert restored[2]["slot"] == 2
    assert restored[2]["read_local"] > restored[2]["read_peer"]  # mapped from its own host's store
    # every shard a restore mapped from its host's store was given back when the version closed
    for host in range(HOSTS):
        store = find_store(CheckpointConfig(namespace="repl").resolved_namespace, node_id_of_host(host))
        held = ray.get(store.__ray_call__.remote(lambda self: sum(map(len, self.ranks.maps.values()))), timeout=60)
        assert held == 0, f"host {host}'s store still lends {held} mapped shard(s) after the restore"
    after = ranks.train([5])
    assert all(r[0]["committed"] for r in after)
    assert status("repl").committed_steps == [4, 5]


@pytest.mark.ray
def test_saving_a_step_again_in_a_new_run_replaces_it_on_every_host(trained, ranks):
    ranks.restart("repl", overwrite=True)  # a new run that does not restore: steps >= 3 are discarded
    again = ranks.train([3])
    assert all(r[0]["committed"] for r in again), again
    st = status("repl")
    assert st.committed_steps == [3] and all(v.state == "committed" for v in st.versions)
    ranks.restart("repl")
    restored = ranks.call("restore")  # every rank reads the new version, never a mix with the old
    assert [r["step"] for r in restored] == [3] * HOSTS
    assert [r["digest"] for r in restored] == [again[r][0]["digest"] for r in range(HOSTS)]


@pytest.mark.ray
def test_a_dead_store_fails_the_version_and_the_restarted_job_goes_on(ranks):
    ranks.restart("holder")
    first = ranks.train([0, 1])
    assert all(r["committed"] for per_rank in first for r in per_rank)
    ray.kill(find_store("holder", node_id_of_host(3)), no_restart=True)  # host 3's memory is gone
    failed = ranks.train([2])  # rank 3 has no store to stage into; the others' holders lost a peer
    assert not any(r[0]["committed"] for r in failed)
    assert any("slot 3" in (r[0]["error"] or "") or "host store" in (r[0]["error"] or "") for r in failed), failed
    st = status("holder")
    assert st.committed_steps == [0, 1] and not st.host(3).store_alive
    wait_for(lambda: any("slot 3" in f["message"] for f in status("holder").failures), what="the death reported")

    ranks.restart("holder")  # the job restarts: host 3 gets a fresh store, its old copies come from slot 2
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [1] * HOSTS
    assert [r["digest"] for r in restored] == [first[r][1]["digest"] for r in range(HOSTS)]
    assert restored[3]["read_peer"] > 0
    again = ranks.train([2, 3])
    assert all(r["committed"] for per_rank in again for r in per_rank), again
    assert status("holder").committed_steps == [2, 3]


@pytest.mark.ray
def test_a_replacement_host_takes_over_the_dead_hosts_slot(ray_cluster, ranks):
    ranks.restart("takeover")
    before = ranks.train([0, 1])
    assert all(r["committed"] for per_rank in before for r in per_rank)
    old_node = node_id_of_host(1)
    ray_cluster.remove_hosts((1,))  # until Ray knows host 1 is dead
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == old_node)
    ray_cluster.add_host(1)
    new_node = node_id_of_host(1)
    # what a fenced host store asks the GCS (gemini_ckpt.hoststore.fence) reads the real node table right
    assert declared_dead(ray.nodes(), old_node) and not declared_dead(ray.nodes(), new_node)
    assert asker(old_node)() and not asker(new_node)()  # and the one-node question it asks now
    address, cluster = gcs_address()  # the second look, once a lease ran out: on new connections
    assert second_look(address, cluster, old_node) == DEAD and second_look(address, cluster, new_node) == ALIVE

    ranks.restart("takeover")
    # Host 1's memory is gone; the replacement's store was given its copies by slot 0 when it
    # joined (tests/integration/test_ray_recovery.py), so rank 1 reads its shard locally.
    wait_for(lambda: status("takeover").host(1).node_id == new_node, timeout=60, what="the replacement's slot")
    restored = ranks.call("restore")
    assert [r["digest"] for r in restored] == [before[r][1]["digest"] for r in range(HOSTS)]
    st = status("takeover")
    assert st.host(1).node_id == new_node and st.host(1).store_alive
    assert any("took over slot 1" in e["message"] for e in st.events)

    after = ranks.train([2])
    assert all(r[0]["committed"] for r in after)
    shard = next(s for s in status("takeover").versions[-1].shards if s.rank == 1)
    assert sorted(shard.copies) == [0, 1]


# --- the data plane and the attach socket --------------------------------------------------------------
@pytest.mark.ray
def test_without_the_secret_a_peer_gets_nothing_and_writes_nothing(ray_cluster):
    from gemini_ckpt.errors import AttachError
    from gemini_ckpt.hoststore.attach_client import AttachClient
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.dataplane import AuthenticationError, Header, PeerLostError, TcpTransport
    from tier_contract import save_filled

    tier = connect(CheckpointConfig(namespace="dataplane-auth", replicas=1, timeout_s=60), rank=0, world_size=1)
    try:
        save_filled(tier, 1, 2.0)  # the job's own save goes through
        actor = find_store("dataplane-auth", tier.node_id)
        endpoint = ray.get(actor.endpoint.remote())
        before = ray.get(actor.index.remote())
        for secret, namespace in ((b"not-the-secret" * 3, "dataplane-auth"), (tier._secret, "other")):
            intruder = TcpTransport(secret, namespace)
            with pytest.raises((AuthenticationError, PeerLostError)):
                channel = intruder.connect(endpoint)
                channel.send(
                    Header(
                        namespace,
                        1,
                        "region/0",
                        0,
                        1000,
                        total=1000,
                        meta=json.dumps(
                            {"epoch": tier.epoch, "owner": 1, "rank": 0, "shards": 1, "plan_id": "x"}
                        ).encode(),
                    ),
                    np.zeros(1000, np.uint8),
                    timeout=10,
                )
            intruder.close()
        # The attach socket of the store: a process of this node without the secret is refused.
        address = ray.get(actor.attach.remote(tier.epoch, {}))["attach"]
        with pytest.raises(AttachError, match="proof does not match"):
            AttachClient(address, b"wrong" * 8, rank=0, epoch=tier.epoch, timeout_s=10)
        assert ray.get(actor.index.remote()) == before  # not a byte written
    finally:
        tier.close()


@pytest.mark.ray
def test_an_authenticated_peer_cannot_make_a_store_allocate_past_its_limits(ray_cluster):
    """Plans and records land in buffers of their own, not budgeted segments: one past
    MAX_META_TRANSFER_BYTES, a piece of one, or an unknown kind is refused before a byte of
    it is allocated, and the store goes on with the job's versions."""
    from gemini_ckpt.hoststore.actors.replication import MAX_META_TRANSFER_BYTES
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.dataplane import Header, TcpTransport, TransferRejectedError
    from tier_contract import save_filled

    tier = connect(CheckpointConfig(namespace="dataplane-meta", replicas=1, timeout_s=60), rank=0, world_size=1)
    try:
        save_filled(tier, 1, 2.0)
        actor = find_store("dataplane-meta", tier.node_id)
        endpoint = ray.get(actor.endpoint.remote())
        peer = TcpTransport(tier._secret, "dataplane-meta")  # the secret: an authenticated peer
        meta = json.dumps({"epoch": tier.epoch, "owner": 1, "rank": 0, "shards": 1, "plan_id": "x"}).encode()
        huge = MAX_META_TRANSFER_BYTES + 1
        cases = [
            (Header("dataplane-meta", 2, "plan/0", 0, 16, total=huge, meta=meta), "one piece"),
            (Header("dataplane-meta", 2, "record/0", 0, huge, total=huge, meta=meta), "refused"),
            (Header("dataplane-meta", 2, "blob/0", 0, 16, total=16, meta=meta), "unknown transfer"),
        ]
        try:
            channel = peer.connect(endpoint)
            for header, why in cases:
                data = np.zeros(header.length, np.uint8)
                with pytest.raises(TransferRejectedError, match=why):
                    channel.send(header, data, timeout=30)
        finally:
            peer.close()
        save_filled(tier, 3, 4.0)  # the store goes on
        assert 3 in tier.committed_steps()
    finally:
        tier.close()


@pytest.mark.ray
def test_ranks_with_different_signing_keys_are_refused_when_they_connect(ray_cluster):
    """A key set on only some ranks (or two keys) would make every version one rank writes
    unreadable to another, found out only at restore: the rendezvous refuses it at once."""
    import concurrent.futures

    from gemini_ckpt.hoststore.client import connect

    def join(rank: int, key):
        cfg = CheckpointConfig(namespace="mixed-keys", replicas=1, timeout_s=60, signing_key=key)
        return connect(cfg, rank=rank, world_size=2)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(join, 0, "the-secret"), pool.submit(join, 1, None)]
        for fut in futures:
            with pytest.raises(ConfigError, match=r"do not share one signing key \(ranks \[1\] no key; ranks \[0\]"):
                fut.result(timeout=120)


@pytest.mark.ray
def test_a_holder_that_dies_mid_transfer_fails_the_version_in_about_a_second(ray_cluster, ranks):
    ranks.restart(
        "dataplane-death", ballast_mb=64, replication_bandwidth=16 << 20
    )  # 64 MiB per shard take 4 s: the kill lands mid-transfer
    assert all(r["committed"] for per_rank in ranks.train([0]) for r in per_rank)  # every rank connected
    timed = [w.save_timed.remote(1) for w in ranks.workers]
    time.sleep(1.5)
    ray.kill(find_store("dataplane-death", node_id_of_host(1)), no_restart=True)  # slot 0's other holder
    killed = time.monotonic()
    outcome = ray.get(timed[0], timeout=120)
    # The copy to slot 1 breaks (or the registry sees slot 1's store gone): the version fails
    # at once, not at timeout_s (120 s).
    assert outcome["error"] is not None and ("slot 1" in outcome["error"] or "store died" in outcome["error"])
    assert outcome["done"] - killed < 3.0, outcome


@pytest.mark.ray
def test_abort_returns_without_waiting_for_the_version_in_flight(ranks):
    ranks.restart("abort", timeout_s=60.0)
    assert all(r["committed"] for per_rank in ranks.train([0]) for r in per_rank)
    host0 = find_store("abort", node_id_of_host(0))
    ray.get(host0.hold_vote.remote(1), timeout=60)  # step 1 cannot commit until released
    try:
        out = ranks.call("save_then_abort", 1, timeout=120)
    finally:
        ray.get(host0.release_vote.remote(), timeout=60)
    # abort() used to track the version to its commit first: timeout_s (60 s) here
    assert all(o["abort_s"] < 10 for o in out), out
    # and every handle resolved, as failed: the Checkpointer stopped tracking it
    assert all(o["error"] and ("not committed" in o["error"] or "not tracked" in o["error"]) for o in out), out
    assert all(o["resolved_s"] < 15 for o in out), out


@pytest.mark.ray
def test_interleaving_marks_reach_the_host_store_and_a_rank_stuck_in_a_collective_holds_nothing(ranks):
    ranks.restart("interleave")
    ranks.call("interleave")
    results = ranks.train(range(2))
    assert all(r["committed"] for per_rank in results for r in per_rank), results
    stats = ray.get(find_store("interleave", node_id_of_host(0)).describe.remote(), timeout=60)["interleave"]
    assert status("interleave").host(0).interleave["collectives"] >= stats["collectives"]  # status --json has them
    # FSDP2's all-gathers and reduce-scatters, marked through the page the store lent over the attach socket
    assert stats["enabled"] and stats["engaged"] and stats["collectives"] >= 8 and stats["collective_s"] > 0
    assert stats["marked_now"] == 0
    assert set(_data_plane_tos("interleave")) == {0} and stats["dscp"] is None  # the gate does not mark
    ray.get(ranks.workers[1].mark.remote(), timeout=60)  # rank 1 stays "inside a collective"
    host1 = find_store("interleave", node_id_of_host(1))
    assert ray.get(host1.describe.remote(), timeout=60)["interleave"]["marked_now"] == 1
    results = ranks.train([2])  # its host's copies still go (a piece per patience), the version commits
    assert all(r["committed"] for per_rank in results for r in per_rank), results
    held = ray.get(host1.describe.remote(), timeout=60)["interleave"]
    assert held["forced"] >= 1 and held["waited_s"] >= 0.9  # it did wait for the collective to end
    ranks.teardown()  # its attach socket closes: the store forgets the mark
    wait_for(
        lambda: ray.get(host1.describe.remote(), timeout=60)["interleave"]["marked_now"] == 0,
        what="the detached rank's mark to be cleared",
    )


def _data_plane_tos(namespace: str, end: str = "both") -> list[int]:
    """The TOS byte (``ss --tos``) of every established connection to or from host 0's data-plane
    listener (all hosts share this machine's kernel under loopback): ``end`` "sending" (the peers'
    dialed ends), "receiving" (host 0's accepted ends) or "both"."""
    port = ray.get(find_store(namespace, node_id_of_host(0)).endpoint.remote(), timeout=60).port
    out = subprocess.run(["ss", "-tnH", "--tos", "state", "established"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, peer = fields[2].endswith(f":{port}"), fields[3].endswith(f":{port}")
        if (local and end != "sending") or (peer and end != "receiving"):
            found.append(next((int(f.split(":", 1)[1], 0) for f in fields if f.startswith("tos:")), 0))
    return found


@pytest.mark.ray
def test_interleave_off_sends_regardless(ranks):
    ranks.restart("no-interleave", interleave=False)
    results = ranks.train(range(2))
    assert all(r["committed"] for per_rank in results for r in per_rank), results
    stats = ray.get(find_store("no-interleave", node_id_of_host(0)).describe.remote(), timeout=60)["interleave"]
    assert not stats["enabled"] and "pieces" not in stats
    assert stats["mode"] == "off" and stats["dscp"] is None
    tos = _data_plane_tos("no-interleave")
    assert tos and set(tos) == {0}, tos  # unmarked


@pytest.mark.ray
def test_interleave_by_the_network_marks_the_data_plane_and_needs_no_marks(ranks):
    ranks.restart("net-interleave", interleave="network")
    ranks.call("interleave")  # the hooks are installed, but with no gate they ask for no comm page
    results = ranks.train(range(2))
    assert all(r["committed"] for per_rank in results for r in per_rank), results
    stats = ray.get(find_store("net-interleave", node_id_of_host(0)).describe.remote(), timeout=60)["interleave"]
    assert stats["mode"] == "network" and stats["dscp"] == 8 and not stats["enabled"]
    assert stats.get("collectives", 0) == 0  # no rank marked a collective
    sending, receiving = _data_plane_tos("net-interleave", "sending"), _data_plane_tos("net-interleave", "receiving")
    assert sending and set(sending) == {0x20}, sending  # the bulk bytes' end of every connection: DSCP CS1
    assert receiving and set(receiving) == {0}, receiving  # acknowledgements and progress go unmarked
