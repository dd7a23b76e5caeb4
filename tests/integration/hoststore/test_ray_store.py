"""Host stores on Ray: copies follow the placement, only fully acknowledged versions count,
host memory outlives a killed worker, a dead holder fails one version and not the job, a
replacement host takes over the dead host's slot, and the data plane and the attach socket let
nobody in without the namespace's secret.

One rank and its store: test_ray_store_one_rank.py. The Ray scenarios here share one cluster
(head + 4 simulated hosts) and one set of 4 rank actors
(rank i on host i, so slot i is host i); each scenario (re)starts the job in its own namespace.
Run: ``RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python -m pytest tests/integration/hoststore/test_ray_store.py -q -x``
(the holders rule and what counts as committed: tests/unit/hoststore/test_holders_and_resolve.py)
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

from gemini_ckpt import CheckpointConfig, ConfigError
from gemini_ckpt.settings import store_settings
from gemini_ckpt.hoststore.client import _start_local_store
from gemini_ckpt.hoststore.cluster import find_store
from gemini_ckpt.hoststore.fence import ALIVE, DEAD, asker, declared_dead, gcs_address, second_look
from gemini_ckpt.hoststore.slots import holders_for
from ray_helpers import node_id_of_host, status, wait_for

HOSTS = 4


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
    dead = find_store("holder", node_id_of_host(3))
    ray.kill(dead, no_restart=True)  # host 3's memory is gone
    failed = ranks.train([2])  # rank 3 has no store to stage into; the others' holders lost a peer
    assert not any(r[0]["committed"] for r in failed)
    assert any("slot 3" in (r[0]["error"] or "") or "host store" in (r[0]["error"] or "") for r in failed), failed
    st = status("holder")
    assert st.committed_steps == [0, 1] and not st.host(3).store_alive
    wait_for(lambda: any("slot 3" in f["message"] for f in status("holder").failures), what="the death reported")
    # A rank that looked up the store a moment before it died (its ping already sent) starts a new one.
    settings = store_settings(CheckpointConfig(store="ray", namespace="holder", timeout_s=30))
    fresh = _start_local_store(settings, node_id_of_host(3), dead, dead.ping.remote())
    assert fresh._actor_id != dead._actor_id and ray.get(fresh.ping.remote(), timeout=30) == node_id_of_host(3)

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
    # joined (tests/integration/recovery/test_ray_recovery.py), so rank 1 reads its shard locally.
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
    from gemini_ckpt.settings import store_settings
    from gemini_ckpt.dataplane import AuthenticationError, Header, PeerLostError, TcpTransport
    from tier_contract import save_filled

    tier = connect(
        store_settings(CheckpointConfig(namespace="dataplane-auth", replicas=1, timeout_s=60)), rank=0, world_size=1
    )
    try:
        save_filled(tier, 1, 2.0)  # the job's own save goes through
        actor = find_store("dataplane-auth", tier.node_id)
        endpoint = ray.get(actor.endpoint.remote())
        before = ray.get(actor.index.remote())
        for secret, namespace in ((b"not-the-secret" * 3, "dataplane-auth"), (tier.secret, "other")):
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
    from gemini_ckpt.settings import store_settings
    from gemini_ckpt.dataplane import Header, TcpTransport, TransferRejectedError
    from tier_contract import save_filled

    tier = connect(
        store_settings(CheckpointConfig(namespace="dataplane-meta", replicas=1, timeout_s=60)), rank=0, world_size=1
    )
    try:
        save_filled(tier, 1, 2.0)
        actor = find_store("dataplane-meta", tier.node_id)
        endpoint = ray.get(actor.endpoint.remote())
        peer = TcpTransport(tier.secret, "dataplane-meta")  # the secret: an authenticated peer
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
    from gemini_ckpt.settings import store_settings

    def join(rank: int, key):
        cfg = CheckpointConfig(namespace="mixed-keys", replicas=1, timeout_s=60, signing_key=key)
        return connect(store_settings(cfg), rank=rank, world_size=2)

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
