"""Restore on a 4-host Ray cluster (replicas=2, group placement: groups {0,1} and {2,3}):
what the planner calls survivable restores the newest committed version from memory and
continues bit-identically; a fatal set falls back to the newest durable version; a new world
size reshards from peer memory; ranks never mix versions."""

from __future__ import annotations

import itertools
import time
import uuid

import pytest
import ray
import torch

import placement
from ray_helpers import Ranks, corrupt_shard_copy, holds_own_shard, wait_for

HOSTS = 4
LAYOUT = placement.make("group", hosts=HOSTS, replicas=2)
SURVIVABLE = [set(s) for k in (1, 2) for s in itertools.combinations(range(HOSTS), k) if placement.survives(LAYOUT, s)]
FATAL = [set(s) for s in itertools.combinations(range(HOSTS), 2) if not placement.survives(LAYOUT, s)]
# The default run has one single loss; CI's slow set adds one cross-group pair (~33 s on a busy
# machine); the rest are slow only.
FAST = ({1},)
CI = ({0, 3},)


def _marks(failed):
    if failed in FAST:
        return ()
    return (pytest.mark.slow, pytest.mark.ci) if failed in CI else pytest.mark.slow


@pytest.fixture(scope="module")
def reference(ranks):
    """An uninterrupted run: per rank, the digest after each of steps 0..7."""
    ranks.restart(f"ref-{uuid.uuid4().hex[:8]}")
    return [[r["digest"] for r in per_rank] for per_rank in ranks.train(range(8))]


def _lose_hosts(cluster, ranks, hosts: set[int]) -> None:
    """Hard-remove whole hosts (their processes die with them), then add replacements."""
    cluster.remove_hosts(tuple(sorted(hosts)), wait=False)
    for h in sorted(hosts):
        wait_for(lambda h=h: not ranks.alive(h), timeout=60, what=f"rank {h} to die with its host")
    for h in sorted(hosts):
        cluster.add_host(h)


def _scenario(cluster, ranks, reference, failed: set[int], tmp_path) -> None:
    ns = f"surv-{uuid.uuid4().hex[:8]}"
    durable = str(tmp_path / ns)
    ranks.restart(ns, persist_every=3, durable_uri=durable)
    before = ranks.train(range(5))
    assert all(r["committed"] for per_rank in before for r in per_rank)
    plan = placement.plan_recovery(LAYOUT, failed)
    _lose_hosts(cluster, ranks, failed)
    ranks.restart(ns, persist_every=3, durable_uri=durable)
    restored = ranks.call("restore")
    expected_tier = "memory" if plan.from_memory else "durable"
    expected_step = 4 if plan.from_memory else 2
    for rank, r in enumerate(restored):
        assert (r["step"], r["source"]) == (expected_step, expected_tier), (failed, rank, r)
        assert r["digest"] == reference[rank][expected_step], f"rank {rank} restored different bytes"
    if plan.from_memory:
        # Hosts that died read their shards from the surviving holder the planner named.
        for h in failed:
            assert restored[h]["sources"][h] in ("peer", "local"), restored[h]
        # A survivor reads its own shard through the mapping it staged it with (no new mmap).
        for rank in set(range(HOSTS)) - failed:
            assert restored[rank]["kept_maps_reused"] >= 1, (rank, restored[rank])
    after = ranks.train(range(expected_step + 1, 8))
    for rank in range(HOSTS):
        assert after[rank][-1]["digest"] == reference[rank][7], f"rank {rank} diverged after restore"


@pytest.mark.ray
@pytest.mark.parametrize(
    "failed",
    [pytest.param(f, marks=_marks(f), id="lose-" + "-".join(map(str, sorted(f)))) for f in SURVIVABLE],
)
def test_survivable_failures_restore_newest_committed_from_memory(ray_cluster, ranks, reference, failed, tmp_path):
    assert placement.plan_recovery(LAYOUT, failed).from_memory
    _scenario(ray_cluster, ranks, reference, failed, tmp_path)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_losing_a_whole_group_restores_the_newest_durable_version(ray_cluster, ranks, reference, tmp_path):
    failed = {2, 3}
    assert failed in FATAL and placement.plan_recovery(LAYOUT, failed).tier == "durable"
    _scenario(ray_cluster, ranks, reference, failed, tmp_path)


@pytest.mark.ray
def test_persisted_versions_are_written_by_the_host_stores_and_load_with_stock_dcp(ranks, reference, tmp_path):
    import torch.distributed.checkpoint as dcp
    from gemini_ckpt.toy import mlp

    ns = f"persist-{uuid.uuid4().hex[:8]}"
    durable = tmp_path / ns
    ranks.restart(ns, persist_every=3, durable_uri=str(durable))
    ranks.train(range(6))
    ranks.teardown()  # close(): waits for persists
    complete = sorted(p.name for p in durable.iterdir() if (p / ".gemini_complete").exists())
    assert complete == ["step_000000002", "step_000000005"]
    assert sorted(f.name for f in (durable / "step_000000005").iterdir()) == [".gemini_complete", ".metadata"] + [
        f"__{r}_0.distcp" for r in range(HOSTS)
    ]
    torch.manual_seed(0)
    model = mlp(64)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(durable / "step_000000005"), no_dist=True)
    assert not torch.equal(sd["model"]["0.weight"], mlp(64)[0].weight)


@pytest.mark.ray
def test_restore_at_world_size_2_from_peer_memory_has_identical_tensors(ray_cluster, ranks, reference):
    ns = f"resize-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns)
    ranks.train(range(4))
    full_before = ranks.call("full_digest")[0]
    ranks.teardown()
    small = Ranks(2)
    try:
        small.setup(ns)
        restored = small.call("restore")
        assert [r["step"] for r in restored] == [3, 3]
        assert all(r["source"] == "memory" for r in restored)
        assert small.call("full_digest") == [full_before, full_before]
        assert any(r["read_peer"] for r in restored)  # shards of ranks 2 and 3 came from other hosts
        small.teardown()
    finally:
        small.kill()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # ~38 s on a busy machine: CI runs it after the default suite
def test_ranks_never_mix_versions_when_one_dies_mid_save(ray_cluster, ranks, reference):
    ns = f"mixed-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns)
    ranks.train(range(4))
    # Rank 3 dies just before handing its shard of step 4 to its store: hosts 0-2 hold shards of
    # step 4 that are never committed.
    ray.get(ranks.workers[3].die_at.remote("replicate", 4))
    for w in ranks.workers:
        w.train.remote([4], 60.0)
    wait_for(lambda: not ranks.alive(3), timeout=60, what="rank 3 to die")

    wait_for(
        lambda: all(holds_own_shard(ns, h, 4) for h in range(3)),
        timeout=60,
        what="ranks 0-2 to hand their shards of step 4 to their stores",
    )
    # The job is torn down (as Ray Train does when a worker dies) and started again.
    for w in ranks.workers[:3]:
        ray.kill(w, no_restart=True)
    ranks.restart(ns)
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [3] * HOSTS
    assert [r["digest"] for r in restored] == [reference[r][3] for r in range(HOSTS)]


@pytest.mark.ray
@pytest.mark.parametrize("when", ["while the job runs", "after the restart, right before the restore"])
def test_a_corrupt_local_copy_is_read_from_the_other_holder(ray_cluster, ranks, reference, when):
    ns = f"corrupt-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns)
    ranks.train(range(4))
    # Flip a byte in the middle of rank 1's shard of step 3, in host 1's own store (the local copy).
    # Also once the job went down and came back: memory can change after any earlier check (the
    # stores used to certify their copies then, and a reader copied a certified one unchecked).
    if when == "while the job runs":
        corrupt_shard_copy(ns, host=1, step=3, rank=1)
        ranks.restart(ns)
    else:
        ranks.restart(ns)
        time.sleep(2.0)
        corrupt_shard_copy(ns, host=1, step=3, rank=1)
    restored = ranks.call("restore")
    # Same step, still from memory: only the bad item came from host 0, the other holder.
    assert [(r["step"], r["source"]) for r in restored] == [(3, "memory")] * HOSTS
    assert restored[1]["sources"][1] == "peer" and restored[1]["read_peer"] > 0
    assert [r["digest"] for r in restored] == [reference[rank][3] for rank in range(HOSTS)]


@pytest.mark.ray
def test_a_training_process_killed_right_after_save_returned_still_commits_its_version(ray_cluster, ranks, reference):
    ns = f"afterkill-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns)
    ranks.train(range(3))
    # Rank 2 is SIGKILLed the moment save(3) returns: its shard is with its host store already,
    # which replicates it and votes without the process.
    dying = ranks.workers[2].save_then_die.remote(3)
    others = [ranks.workers[r].train.remote([3], 60.0) for r in (0, 1, 3)]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(dying, timeout=120)
    for per_rank in ray.get(others, timeout=120):
        assert per_rank[0]["committed"], per_rank
    ranks.restart(ns)
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [3] * HOSTS  # every committed version is found
    assert [r["digest"] for r in restored] == [reference[r][3] for r in range(HOSTS)]


@pytest.mark.ray
def test_ranks_naming_different_steps_all_raise_and_naming_the_same_one_load_it(ranks, reference):
    """The start's collective carries each rank's ``restore(step=...)``: ranks that disagree all
    raise (none waits for the others), and ranks that agree load that step, not the newest."""
    from gemini_ckpt import ConfigError

    ns = f"named-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns)
    ranks.train(range(4))
    ranks.restart(ns)
    asked = [2, None, 2, 2]
    calls = [w.restore.remote(step) for w, step in zip(ranks.workers, asked)]
    for call in calls:
        with pytest.raises(ray.exceptions.RayTaskError) as caught:
            ray.get(call, timeout=120)
        assert isinstance(caught.value.as_instanceof_cause(), ConfigError), caught.value
        assert "different steps" in str(caught.value)
    ranks.restart(ns)
    restored = ray.get([w.restore.remote(2) for w in ranks.workers], timeout=120)
    assert [r["step"] for r in restored] == [2] * HOSTS
    assert [r["digest"] for r in restored] == [reference[r][2] for r in range(HOSTS)]
