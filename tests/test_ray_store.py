"""Host stores on Ray: copies follow the placement, only fully acknowledged versions count,
host memory outlives a killed worker, a dead holder fails one version and not the job, and a
replacement host takes over the dead host's slot.

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

import numpy as np
import pytest
import ray

from gemini_ckpt import CheckpointConfig, ConfigError, MemoryBudgetError
from gemini_ckpt._cluster import find_store, holders_for
from gemini_ckpt._store import MemoryStore, VersionManifest
from ray_helpers import Ranks, add_host, host_node, node_id_of_host, ray_cluster, status, wait_for  # noqa: F401
from store_contract import check_store_contract

HOSTS = 4


def _name(rank: int) -> str:
    return f"__{rank}_0.distcp"


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


def _index(step, *, commit=None, unix=1.0, needs=None, files=()):
    """One store's ``index()`` entry for ``step``: files given as (name, nbytes, put_id, holders)."""
    return {step: {"committed": commit is not None, "commit_id": commit or "", "committed_unix": unix,
                   "needs": dict(needs or {}) if commit else {},
                   "files": {n: {"nbytes": b, "complete": True, "owner": h[0], "holders": h, "put_id": p,
                                 "put_unix": unix} for n, b, p, h in files}}}


def test_a_step_counts_only_when_one_commit_has_every_file_on_live_stores():
    from gemini_ckpt._ray_store import resolve_versions

    needs = {"a": 10, "b": 20}
    whole = {0: _index(7, commit="c1", needs=needs, files=[("a", 10, "pa", (0, 1))]),
             1: _index(7, commit="c1", needs=needs, files=[("a", 10, "pa", (0, 1)), ("b", 20, "pb", (1, 0))])}
    v = resolve_versions(whole, local_slot=0)[7]
    assert v.committed and v.files == {"a": (10, (0, 1)), "b": (20, (1,))}
    v = resolve_versions(whole, local_slot=1)[7]
    assert v.files["a"] == (10, (1, 0))  # the local copy first
    lost = {0: whole[0]}  # slot 1 is dead: "b" has no copy left
    v = resolve_versions(lost)[7]
    assert not v.committed and v.had_commit
    # Slot 1 got a put of a new version of step 7 (so it is uncommitted there): slot 0 alone
    # still holds commit c1, but without "b" -> the step is not listed, never a mix.
    resaving = {0: whole[0], 1: _index(7, unix=2.0, files=[("a", 10, "pa2", (1, 0))])}
    assert not resolve_versions(resaving)[7].committed
    # Two complete commits of one step: the newer one wins, and only its stores are read.
    newer = {0: _index(7, commit="c1", needs=needs, files=[("a", 10, "pa", (0,)), ("b", 20, "pb", (0,))]),
             1: _index(7, commit="c2", unix=3.0, needs=needs,
                       files=[("a", 10, "pa3", (1,)), ("b", 20, "pb3", (1,))])}
    assert resolve_versions(newer)[7].commit_slots == (1,)


def test_memory_store_contract():
    check_store_contract(MemoryStore())


# --- Ray: the store on its own ---------------------------------------------------------------------
@pytest.mark.ray
def test_ray_store_contract(ray_cluster):
    from gemini_ckpt._ray_store import connect_ray_store

    store = connect_ray_store(CheckpointConfig(namespace="contract", replicas=1, timeout_s=120),
                              rank=0, world_size=1)
    assert store.holders() == (0,)
    check_store_contract(store)
    assert store.stats.bytes_read_peer == 0 and store.stats.bytes_read_local > 0
    # Store actors are shipped by value and never import the package (or torch): small, fast to start.
    actor = find_store("contract", store.node_id)
    imported = ray.get(actor.__ray_call__.remote(lambda self: [m for m in ("torch", "gemini_ckpt") if m in sys.modules]))
    assert imported == []


@pytest.mark.ray
def test_reads_through_the_read_ahead_stream_are_exact_in_any_order(ray_cluster):
    from gemini_ckpt._ray_store import READ_BLOCK_BYTES, connect_ray_store
    from store_contract import _manifest

    store = connect_ray_store(CheckpointConfig(namespace="readahead", replicas=1, timeout_s=120),
                              rank=0, world_size=1)
    arr = np.random.default_rng(7).integers(0, 256, size=2 * READ_BLOCK_BYTES + 12345, dtype=np.uint8)
    store.put_file(5, "__0_0.distcp", arr)
    store.commit(5, _manifest(5, {"__0_0.distcp": arr}, world_size=1))
    B = READ_BLOCK_BYTES
    ranges = [(0, 100), (100, B - 200), (B - 100, 300),  # in order, one straddling a block edge
              (B + 200, B + 1), (2 * B + 12000, 345),  # a range bigger than a block; the tail
              (10, 20), (2 * B - 5, 10), (0, arr.nbytes), (arr.nbytes, 0)]  # backwards, whole file, empty
    for offset, length in ranges:
        got = store.read_range(5, "__0_0.distcp", offset, length)
        assert bytes(got) == arr[offset : offset + length].tobytes(), (offset, length)
    assert store.stats.bytes_read_local == sum(n for _, n in ranges)
    store.drop(5)


@pytest.mark.ray
def test_put_over_the_memory_budget_is_refused_before_anything_is_dropped(ray_cluster):
    from gemini_ckpt._ray_store import connect_ray_store

    store = connect_ray_store(CheckpointConfig(namespace="budget", replicas=1, host_memory_budget_bytes=10_000,
                                               timeout_s=120), rank=0, world_size=1)
    data = np.arange(6000, dtype=np.uint8)
    store.put_file(1, "__0_0.distcp", data)
    with pytest.raises(MemoryBudgetError) as info:
        store.put_file(2, "__0_0.distcp", data)
    message = str(info.value)
    assert "10,000" in message and "host_memory_budget_bytes" in message and "keep_in_memory" in message
    assert bytes(store.read_range(1, "__0_0.distcp", 0, 6000)) == data.tobytes()  # nothing was dropped


@pytest.mark.ray
def test_start_and_shutdown_host_stores(ray_cluster):
    from gemini_ckpt._cluster import alive_node_ids, named_actors, shutdown_host_stores, start_host_stores

    handles = start_host_stores(CheckpointConfig(namespace="started", host_memory_budget_bytes=1 << 20,
                                                 timeout_s=120))
    assert sorted(handles) == alive_node_ids() and len(handles) == HOSTS + 1  # the head node too
    st = status("started")
    assert len(st.hosts) == HOSTS + 1
    assert all(h.slot is None and h.store_alive and h.budget_bytes == 1 << 20 for h in st.hosts)  # no ranks yet
    assert "spare" in st.format()
    assert len(shutdown_host_stores("started")) == HOSTS + 2  # the stores and the registry
    wait_for(lambda: "started" not in named_actors(), what="the actors to be gone")


# --- Ray: a training job of 4 ranks on 4 hosts ---------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(ray_cluster):
    group = Ranks(HOSTS)
    yield group
    group.teardown()
    group.kill()


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
    manifest = ranks.call("store_call", "manifest", 4)[0]
    for slot in range(HOSTS):
        host = st.host(slot)
        assert host.node_id == node_id_of_host(slot) and host.store_alive
        assert host.versions == (3, 4)
        assert (host.own_shards, host.replica_shards) == (2, 2)
    for version in st.versions:
        assert version.state == "committed"
        assert [s.name for s in version.shards] == [_name(r) for r in range(HOSTS)]
        for shard in version.shards:
            assert shard.copies == holders_for(shard.owner, hosts=HOSTS, replicas=2)
            if version.step == 4:
                assert shard.nbytes == manifest.file_sizes[shard.name]
    for slot in range(HOSTS):
        held = sum(s.nbytes for v in st.versions for s in v.shards if slot in s.copies)
        assert st.host(slot).held_bytes == held


@pytest.mark.ray
def test_status_cli(trained, ray_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-m", "gemini_ckpt", "status", "--namespace", "repl", "--json",
                          "--address", ray_cluster.address], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (ns,) = doc["namespaces"]
    assert ns["committed_steps"] == [3, 4] and len(ns["hosts"]) == HOSTS
    text = status("repl").format()
    print(text)
    assert "committed" in text and "__3_0.distcp" in text


@pytest.mark.ray
def test_saving_a_committed_step_again_replaces_it_on_every_host(trained, ranks):
    step = 1  # released by retention long ago; the job's own steps are 3 and 4
    names = [_name(r) for r in range(HOSTS)]

    def put(ranks_, fill):
        ray.get([ranks.workers[r].store_call.remote("put_file", step, names[r], np.full(1000 + r, fill, np.uint8))
                 for r in ranks_])

    manifest = VersionManifest(step=step, world_size=HOSTS, metadata=b"v", checksums=(),
                               file_sizes={n: 1000 + r for r, n in enumerate(names)})
    try:
        put(range(HOSTS), 1)
        ray.get(ranks.workers[0].store_call.remote("commit", step, manifest))
        assert status("repl").committed_steps == [step, 3, 4]
        put([0], 2)  # rank 0 saves step 1 again: hosts 2 and 3 still hold the old commit, but
        assert all(step not in s for s in ranks.call("store_call", "committed_steps"))  # not whole
        put([1, 2, 3], 2)
        ray.get(ranks.workers[0].store_call.remote("commit", step, manifest))
        assert all(step in s for s in ranks.call("store_call", "committed_steps"))
        for r in range(HOSTS):  # every rank reads the new bytes of every file
            got = ray.get([w.store_call.remote("read_range", step, names[r], 0, 1000) for w in ranks.workers])
            assert set(got) == {b"\x02" * 1000}
        assert [s.copies for s in status("repl").versions[0].shards] == \
            [holders_for(r, hosts=HOSTS, replicas=2) for r in range(HOSTS)]
    finally:
        ray.get(ranks.workers[0].store_call.remote("drop", step))


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
    assert restored[2]["read_local"] > restored[2]["read_peer"]
    after = ranks.train([5])
    assert all(r[0]["committed"] for r in after)
    assert status("repl").committed_steps == [4, 5]


@pytest.mark.ray
def test_a_dead_holder_fails_the_version_and_the_next_goes_to_survivors(ranks):
    ranks.restart("holder")
    first = ranks.train([0, 1])
    assert all(r["committed"] for per_rank in first for r in per_rank)
    # Host 3's store dies after every copy of a version arrived, before the commit: refused.
    lost = 50
    ray.get([ranks.workers[r].store_call.remote("put_file", lost, _name(r), np.full(100, r, np.uint8))
             for r in range(HOSTS)])
    ray.kill(find_store("holder", node_id_of_host(3)), no_restart=True)
    manifest = VersionManifest(step=lost, world_size=HOSTS, metadata=b"m", checksums=(),
                               file_sizes={_name(r): 100 for r in range(HOSTS)})
    with pytest.raises(ValueError, match="slot"):
        ray.get(ranks.workers[0].store_call.remote("commit", lost, manifest))
    assert status("holder").committed_steps == [0, 1]
    ray.get(ranks.workers[0].store_call.remote("drop", lost))

    failed = ranks.train([2])  # the next save finds the holder dead
    assert not any(r[0]["committed"] for r in failed)
    assert any("slot 3" in (r[0]["error"] or "") for r in failed), failed
    st = status("holder")
    assert st.committed_steps == [0, 1]
    assert not st.host(3).store_alive
    assert any("slot 3" in f["message"] for f in st.failures)

    restored = ranks.call("restore")  # the previous version is still whole on the survivors
    assert [r["step"] for r in restored] == [1] * HOSTS
    assert [r["digest"] for r in restored] == [first[r][1]["digest"] for r in range(HOSTS)]

    again = ranks.train([2, 3])  # training goes on; the dead slot's copies go to its ring successor
    assert all(r["committed"] for per_rank in again for r in per_rank), again
    st = status("holder")
    assert st.committed_steps == [2, 3]
    copies = {s.name: s.copies for s in st.versions[-1].shards}
    assert copies == {_name(0): (0, 1), _name(1): (1, 0), _name(2): (2, 0), _name(3): (2, 0)}


@pytest.mark.ray
def test_a_replacement_host_takes_over_the_dead_hosts_slot(ray_cluster, ranks):
    ranks.restart("takeover")
    before = ranks.train([0, 1])
    assert all(r["committed"] for per_rank in before for r in per_rank)
    old_node = node_id_of_host(1)
    ray_cluster.remove_node(host_node(ray_cluster, 1))
    wait_for(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == old_node), what="node death")
    add_host(ray_cluster, 1)
    new_node = node_id_of_host(1)

    ranks.restart("takeover")
    restored = ranks.call("restore")  # host 1's memory is gone; its shard comes from slot 0
    assert [r["digest"] for r in restored] == [before[r][1]["digest"] for r in range(HOSTS)]
    assert restored[1]["read_peer"] > 0
    st = status("takeover")
    assert st.host(1).node_id == new_node and st.host(1).store_alive
    assert any("took over slot 1" in e["message"] for e in st.events)

    after = ranks.train([2])
    assert all(r[0]["committed"] for r in after)
    copies = {s.name: s.copies for s in status("takeover").versions[-1].shards}
    assert copies[_name(1)] == (1, 0)


# --- the data plane ------------------------------------------------------------------------------
@pytest.mark.ray
def test_the_data_plane_gives_nothing_to_and_takes_nothing_from_a_peer_without_the_secret(ray_cluster):
    from gemini_ckpt._ray_store import connect_ray_store
    from gemini_ckpt.ray.transport import AuthenticationError, Header, PeerLostError, TcpTransport

    store = connect_ray_store(CheckpointConfig(namespace="dataplane-auth", replicas=1, timeout_s=60),
                              rank=0, world_size=1)
    store.put_file(1, "__0_0.distcp", np.full(1000, 7, np.uint8))  # the job's own put goes through
    actor = find_store("dataplane-auth", store.node_id)
    endpoint = ray.get(actor.start_data_plane.remote(store._secret))
    before = ray.get(actor.index.remote())
    for secret, namespace in ((b"not-the-secret" * 3, "dataplane-auth"), (bytes.fromhex(store._secret), "other")):
        intruder = TcpTransport(secret, namespace)
        with pytest.raises((AuthenticationError, PeerLostError)):
            channel = intruder.connect(endpoint)
            channel.send(Header(namespace, 1, "__0_0.distcp", 0, 1000, total=1000, put_id="x",
                                meta=b'{"owner": 0, "holders": [0], "epoch": 99}'),
                         np.zeros(1000, np.uint8), timeout=10)
        intruder.close()
    assert ray.get(actor.index.remote()) == before  # not a byte written
    store.close()


@pytest.mark.ray
def test_a_holder_that_dies_mid_transfer_fails_the_put_in_about_a_second(ray_cluster, ranks):
    import time

    ranks.restart("dataplane-death", replicas=2, placement="group",
                  replication_bandwidth=16 << 20)  # 64 MiB take 4 s: the kill lands mid-transfer
    assert all(r["committed"] for per_rank in ranks.train([0]) for r in per_rank)  # every rank connected
    put = ranks.workers[0].store_call.remote("put_file", 7, _name(0), np.ones(64 << 20, np.uint8))
    time.sleep(1.5)
    ray.kill(find_store("dataplane-death", node_id_of_host(1)), no_restart=True)  # slot 0's other holder
    killed = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="slot 1.*died while receiving"):
        ray.get(put, timeout=60)
    assert time.monotonic() - killed < 3.0  # noticed by the transport, not by timeout_s (120 s)
