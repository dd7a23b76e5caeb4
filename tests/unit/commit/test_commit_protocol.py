"""The commit protocol among host stores (``gemini_ckpt.commit``), in-process, no Ray.

1,024 simulated stores per run; messages are delivered in a seeded random order. The
simulator itself raises ``CommitProtocolError`` if a store marks a version committed before the
coordinator decided COMMIT, or if two participants decide a version differently.
"""

from __future__ import annotations

import math
import random

import pytest

from gemini_ckpt.hoststore.slots import holders_for
from gemini_ckpt.commit import (
    COORDINATOR,
    Committed,
    DEFAULT_FANOUT,
    Coordinator,
    Decision,
    HostCommit,
    Send,
    ShardStaged,
    VersionId,
    Vote,
)
from gemini_ckpt.commit.participant import Tree
from gemini_ckpt.testing.commit_sim import Simulator, placed_holders

HOSTS = 1024
C = 2  # per-participant bound: C * (replicas + ceil(log2 hosts)) control messages per version
CONFIGS = [("group", 2), ("ring", 2), ("mixed", 3), ("ring", 3)]  # 3 does not divide 1,024: mixed


make_holders = placed_holders


def bound(replicas: int, hosts: int = HOSTS) -> int:
    return C * (replicas + math.ceil(math.log2(hosts)))


def decided_everywhere(sim: Simulator, report) -> None:
    assert report.outcome is not None
    assert not report.timed_out, "a live store needed its timeout to learn the decision"
    assert set(report.outcomes.values()) == {report.outcome}


def test_holders_shortcut_matches_the_rule():
    holders = make_holders(64, 3, "mixed")
    for dead in (frozenset(), frozenset({5}), frozenset({0, 1, 62})):
        for slot in set(range(64)) - dead:
            assert holders(slot, dead) == holders_for(slot, hosts=64, replicas=3, strategy="mixed", dead=dead)


@pytest.mark.parametrize("fanout", [2, 3, DEFAULT_FANOUT, 10])
@pytest.mark.parametrize("dead", [(), (0,), (3, 4, 99), tuple(range(0, 200, 7))])
def test_tree_covers_every_live_slot_once(fanout, dead):
    tree = Tree(200, frozenset(dead), fanout)
    live = sorted(set(range(200)) - set(dead))
    seen = list(tree.top())
    for slot in live:
        children = tree.children(slot)
        assert all(tree.parent(c) == slot for c in children)
        seen.extend(children)
    assert sorted(seen) == live
    assert all(tree.parent(s) == COORDINATOR for s in tree.top())
    depth = max(_depth(tree, s) for s in live)
    assert depth <= math.ceil(math.log(len(live), fanout)) + 1


def _depth(tree: Tree, slot: int) -> int:
    d = 1
    while (slot := tree.parent(slot)) != COORDINATOR:
        d += 1
    return d


@pytest.mark.parametrize("strategy,replicas", CONFIGS)
def test_every_version_commits_within_the_message_bound(strategy, replicas):
    sim = Simulator(
        hosts=HOSTS,
        replicas=replicas,
        holders=make_holders(HOSTS, replicas, strategy),
        ranks_per_host=2,
        keep=2,
        seed=7,
    )
    for step in range(3):
        report = sim.run_version(step)
        decided_everywhere(sim, report)
        assert report.outcome is True and report.acknowledged
        handled = [report.handled(p) for p in [*range(HOSTS), COORDINATOR]]
        assert max(handled) <= bound(replicas), (max(handled), bound(replicas))
        # exactly: acks out and in (replicas - 1 each), one vote up, <= fanout votes in, one
        # decision in, <= fanout decisions out; the coordinator 2 * fanout
        assert max(handled[:-1]) <= 2 * (replicas - 1) + 2 + 2 * DEFAULT_FANOUT
        assert handled[-1] == 2 * DEFAULT_FANOUT
        # rank inputs and data-plane completions: a start, 2 stagings, replicas - 1 copies
        assert set(report.local.values()) == {1 + 2 + replicas - 1}
    versions = (VersionId(0, 1), VersionId(0, 2))
    assert sim.coordinator.newest_committed() == VersionId(0, 2)
    assert sim.coordinator.committed_versions() == versions
    assert all(p.committed_versions() == versions for p in sim.stores.values())  # step 0 released


@pytest.mark.parametrize("strategy,replicas,seed", [("group", 2, 1), ("mixed", 3, 2), ("ring", 3, 3)])
def test_random_kills_commit_iff_every_copy_was_acknowledged(strategy, replicas, seed):
    rng = random.Random(seed)
    sim = Simulator(hosts=HOSTS, replicas=replicas, holders=make_holders(HOSTS, replicas, strategy), seed=seed)
    committed = 0
    for step in range(6):
        kills = {}
        if step % 2 == 0:  # kills at random points of even versions; odd versions run clean
            for _ in range(rng.randint(1, 3)):
                kills[rng.choice(sim.live)] = rng.randint(0, 3 * HOSTS * (replicas + 1))
        report = sim.run_version(step, kill_after=kills)
        decided_everywhere(sim, report)
        if report.outcome:
            committed += 1
            assert report.acknowledged
        elif not report.died:
            pytest.fail(f"step {step} aborted without a failure")
        if step % 2:
            assert report.outcome is True, "the version after a death commits over the live slots"
        slack = (4 * DEFAULT_FANOUT + 4) * len(report.died)  # per death: notices, adoptions, queries
        assert max(report.handled(p) for p in [*sim.live, COORDINATOR]) <= bound(replicas) + slack
        for slot in sim.live:  # no store marks a version the coordinator did not commit
            assert set(sim.stores[slot].committed_versions()) <= set(sim.coordinator.committed_versions())
    assert committed >= 3


def test_small_clusters_many_seeds():
    """The same invariants over many orders and kill points, where trees are shallow and
    deaths hit near the root (the coordinator's children) more often."""
    for seed in range(25):
        rng = random.Random(seed)
        for hosts, replicas, strategy, fanout in [(16, 2, "ring", 2), (50, 3, "mixed", 4), (64, 2, "group", 3)]:
            sim = Simulator(
                hosts=hosts,
                replicas=replicas,
                holders=make_holders(hosts, replicas, strategy),
                seed=seed,
                fanout=fanout,
            )
            for step in range(4):
                kills = (
                    {rng.choice(sim.live): rng.randint(0, 4 * hosts * (replicas + 1)) for _ in range(rng.randint(0, 2))}
                    if step % 2 == 0
                    else {}
                )
                report = sim.run_version(step, kill_after=kills)
                decided_everywhere(sim, report)
                if report.outcome:
                    assert report.acknowledged
                else:
                    assert report.died or not report.acknowledged
                if step % 2:
                    assert report.outcome is True


def test_a_dead_holder_aborts_the_version_everywhere_and_the_next_commits():
    holders = make_holders(HOSTS, 2, "group")
    sim = Simulator(hosts=HOSTS, replicas=2, holders=holders, seed=11)
    assert sim.run_version(0).outcome is True
    report = sim.run_version(1, kill_after={301: 1})  # 301 holds 300's copy; dies before acking
    decided_everywhere(sim, report)
    assert report.outcome is False and not report.acknowledged
    assert all(p.state(VersionId(0, 1)) == "aborted" for p in sim.stores.values())
    assert "301" in sim.coordinator.reason(VersionId(0, 1))  # the death is named
    report = sim.run_version(2)
    decided_everywhere(sim, report)
    assert report.outcome is True
    assert holders(300, frozenset({301})) == (300, 302)  # 300's copy went around the dead slot
    assert sim.coordinator.newest_committed() == VersionId(0, 2)


def test_unhealthy_versions_commit_but_every_store_releases_them_alike_and_keeps_its_healthy_ones():
    """One rank's shard of versions 2, 3 and 5 fails its health checks. They commit
    (the copies exist), every participant hears why, and retention counts healthy versions only:
    each keeps the newest ``keep`` healthy ones plus the first of the latest run of unhealthy ones."""
    hosts = 64
    sim = Simulator(hosts=hosts, replicas=2, holders=make_holders(hosts, 2, "group"), ranks_per_host=2, keep=2, seed=3)
    why = '{"check":"finite","detail":"1 NaN","item":"model.w","rank":37,"status":"unhealthy"}'
    for step in range(7):
        report = sim.run_version(step, unhealthy={37: why} if step in (2, 3, 5) else {})
        decided_everywhere(sim, report)
        assert report.outcome is True
    live = set(sim.stores)
    assert {(s, v.step) for s, v in sim.unhealthy_at} == {(s, step) for s in live | {COORDINATOR} for step in (2, 3, 5)}
    for p in [*sim.stores.values(), sim.coordinator]:
        assert p.committed_versions() == (VersionId(0, 4), VersionId(0, 6))
        assert p.unhealthy_versions() == (VersionId(0, 5),)
    # Every store let go of the same versions in the same order: 3 at once (2 began the run), 0
    # when 4 came, 2 when 5 began a new run, 1 when 6 came.
    assert {tuple(v.step for v in sim.released[s]) for s in live} == {(3, 0, 2, 1)}


def test_every_participant_hears_whether_every_shard_carries_a_verdict_and_a_missing_one_is_never_assumed():
    """A store that gives no verdict for a shard (one of another gemini_ckpt
    version, which leaves the field out: the message's default) makes the version unchecked at
    every participant, never healthy; with every verdict present, every participant says so."""
    hosts = 16
    sim = Simulator(hosts=hosts, replicas=2, holders=make_holders(hosts, 2, "ring"), ranks_per_host=2, keep=2, seed=5)
    for step, unchecked in ((0, ()), (1, (13,)), (2, ()), (3, (0, 31))):
        report = sim.run_version(step, unchecked=unchecked)
        decided_everywhere(sim, report)
        assert report.outcome is True
        v = VersionId(0, step)
        at = {s for s, w in sim.checked_at if w == v}
        assert at == (set() if unchecked else set(sim.stores) | {COORDINATOR}), (step, at)
    assert ShardStaged(VersionId(0, 0), 0).checked is False and Vote(VersionId(0, 0), 0, frozenset(), True).checked == 0
    assert Decision(VersionId(0, 0), True).checked is False and Committed(VersionId(0, 0)).checked is False


def test_the_trainer_is_not_needed_after_staging():
    """A training process killed right after ``save()`` returned: its shard is in its host
    store, and the stores commit without any further input from a rank."""
    sim = Simulator(hosts=HOSTS, replicas=2, holders=make_holders(HOSTS, 2, "group"), ranks_per_host=4, seed=5)
    report = sim.run_version(0)  # the only rank inputs are the 4 ShardStaged of each host
    decided_everywhere(sim, report)
    assert report.outcome is True
    assert set(report.local.values()) == {1 + 4 + 1}  # start, 4 stagings, one copy received


@pytest.mark.parametrize("reported", [False, True])
def test_a_rank_that_dies_before_staging_fails_the_version_cleanly(reported):
    sim = Simulator(hosts=HOSTS, replicas=2, holders=make_holders(HOSTS, 2, "ring"), ranks_per_host=2, seed=9)
    report = sim.run_version(0, unstaged={17: 1}, rank_failures=[17] if reported else [])
    assert report.outcome is False
    assert set(report.outcomes.values()) == {False}
    assert report.timed_out is not reported  # a reported death aborts at once, else the timeout does
    assert sim.run_version(1).outcome is True


def test_a_refused_copy_aborts_everywhere():
    sim = Simulator(hosts=HOSTS, replicas=3, holders=make_holders(HOSTS, 3, "ring"), seed=4)
    report = sim.run_version(0, replica_failures=[(41, 40)])
    decided_everywhere(sim, report)
    assert report.outcome is False
    assert "over budget" in sim.stores[40].reason(VersionId(0, 0))


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError, match="fanout"):
        Coordinator(hosts=4, fanout=1)
    store = HostCommit(0, hosts=4, replicas=2)
    with pytest.raises(ValueError, match="holders"):
        store.start_version(VersionId(0, 0), holders=(1, 0), shards=1)
    with pytest.raises(ValueError, match="shards"):
        store.start_version(VersionId(0, 0), holders=(0, 1), shards=0)
    with pytest.raises(TypeError):
        store.on_message(Send(1, None))


def test_slots_without_ranks_hold_copies_and_take_no_part_in_the_vote():
    # A job restarted on fewer hosts: slots 2 and 3 keep their stores but run no rank. They
    # still hold copies (ring placement sends slot 1's copy to slot 2), and the tree is built
    # over the other slots only, on every participant alike.
    holders = make_holders(4, 2, "ring")
    sim = Simulator(hosts=4, replicas=2, holders=holders, idle={2, 3}, seed=3)
    for step in range(3):
        report = sim.run_version(step)
        assert report.outcome is True and report.acknowledged and not report.timed_out, report
        assert set(report.outcomes) == {0, 1} and all(o is True for o in report.outcomes.values())
    assert sim.coordinator.committed_versions() == (VersionId(0, 1), VersionId(0, 2))
    with pytest.raises(ValueError, match="idle"):
        HostCommit(2, hosts=4, replicas=2, idle={2})


def test_a_step_of_the_wall_clock_does_not_fail_the_versions_in_flight(monkeypatch):
    """A host store times its versions on the monotonic clock. A wall clock
    stepped an hour ahead (NTP, an operator) fails nothing; an hour of real waiting does, with a
    veto sent up the tree. The store's real parts (its state, version table, commit participant
    and driver); its parent is a fake peer that records what it is sent."""
    import time as time_module

    from gemini_ckpt.hoststore.actors.commit_driver import CommitDriver
    from gemini_ckpt.hoststore.actors.state import EpochConfig, StoreState
    from gemini_ckpt.hoststore.actors.versions import VersionTable

    class Peer:
        def __init__(self):
            self.sent = []
            self.commit_message = self

        def remote(self, message):
            self.sent.append(message)
            return None

    state = StoreState("clock-step", "n" * 56, VersionTable(1 << 20))
    state.cfg = EpochConfig(
        epoch=0,
        slot=1,
        nodes=("a" * 56, "b" * 56),
        ranks_here=(1,),
        world_size=2,
        replicas=2,
        strategy="group",
        keep=2,
        dead=frozenset(),
        idle=frozenset(),
        timeout_s=60.0,
    )
    state.commit = HostCommit(1, hosts=2, replicas=2)
    driver = CommitDriver(state)
    coordinator = driver.registry = Peer()
    peer = driver.peers[0] = Peer()
    v = VersionId(0, 5)
    state.table.version(0, 5, world_size=2)
    driver.apply(state.commit.start_version(v, holders=(1, 0), shards=1))
    real_time, real_mono = time_module.time, time_module.monotonic
    monkeypatch.setattr(time_module, "time", lambda: real_time() + 3600.0)
    driver.check_timeouts()
    assert state.commit.outcome(v) is None and not coordinator.sent and not peer.sent
    monkeypatch.setattr(time_module, "monotonic", lambda: real_mono() + 61.0)
    driver.check_timeouts()
    assert state.commit.outcome(v) is False
    sent = coordinator.sent + peer.sent
    assert any(isinstance(m, Vote) and not m.ok and "timed out" in m.reason for m in sent), sent
    state.pool.shutdown(wait=False)
