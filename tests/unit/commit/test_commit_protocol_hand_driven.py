"""The commit protocol (``gemini_ckpt.commit``) driven by hand, in-process, no Ray: the test
feeds a coordinator votes, or holds chosen messages of a small network of stores and releases
them later (a prepared copy without the coordinator's word, orphans of a dead parent, a store
that missed a death).
"""

from __future__ import annotations

from gemini_ckpt.commit import (
    COORDINATOR,
    Coordinator,
    Decision,
    HostCommit,
    Query,
    Replicate,
    Send,
    ShardStaged,
    VersionId,
    Vote,
)


def test_a_host_whose_store_died_but_ranks_live_blocks_the_commit():
    coord = Coordinator(hosts=4, fanout=4, world_size=8)
    v = VersionId(0, 0)
    out = []
    for slot in range(4):  # slot 3's store lost its ranks' shards: it stages only 1 of 2
        out += coord.on_message(Vote(v, slot, frozenset(), True, shards=1 if slot == 3 else 2))
    assert coord.outcome(v) is False and "7 of 8" in coord.reason(v)


class _Net:
    """A hand-driven network of participants: messages wait until released."""

    def __init__(self, hosts: int, replicas: int, fanout: int) -> None:
        self.coord = Coordinator(hosts=hosts, fanout=fanout)
        self.stores = {s: HostCommit(s, hosts=hosts, replicas=replicas, fanout=fanout) for s in range(hosts)}
        self.queue: list = []

    def feed(self, actions, sender: int = COORDINATOR) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.queue.append(a)
            elif isinstance(a, Replicate):
                for h in a.holders:
                    self.feed(self.stores[h].replica_stored(a.version, sender), h)

    def run(self, hold=lambda send: False) -> None:
        while True:
            ready = [s for s in self.queue if not hold(s)]
            if not ready:
                return
            send = ready[0]
            self.queue.remove(send)
            to = self.coord if send.to == COORDINATOR else self.stores.get(send.to)
            if to is not None:
                self.feed(to.on_message(send.message), send.to)

    def start(self, v: VersionId, holders=None) -> None:
        for s, p in self.stores.items():
            self.feed(p.start_version(v, holders=holders[s] if holders else (s, (s + 1) % 8), shards=1), s)
            self.feed(p.on_message(ShardStaged(v, s)), s)


def test_a_reader_trusts_a_prepared_copy_only_with_the_coordinators_word():
    net, v = _Net(8, 2, 2), VersionId(0, 3)
    net.start(v)
    held = lambda send: isinstance(send.message, Decision) and send.to == 7  # noqa: E731
    net.run(hold=held)
    assert net.coord.outcome(v) is True and net.coord.newest_committed() == v
    assert net.stores[7].state(v) == "prepared"  # every copy it owns is acknowledged, no decision yet
    assert net.stores[7].committed_versions() == ()
    net.run()
    assert net.stores[7].state(v) == "committed"


def test_orphans_learn_the_decision_from_the_nearest_live_ancestor():
    net, v = _Net(8, 2, 2), VersionId(0, 0)
    net.start(v)
    # slot 1 has children 4 and 5 (fanout 2); hold every decision sent to them, then kill 1
    net.run(hold=lambda send: isinstance(send.message, Decision) and send.to in (1, 4, 5))
    assert net.coord.outcome(v) is True and net.stores[4].state(v) == "prepared"
    del net.stores[1]
    net.queue = [s for s in net.queue if s.to != 1]
    for p in [*net.stores.values(), net.coord]:
        net.feed(p.on_peer_dead(1))
    asks = [s for s in net.queue if isinstance(s.message, Query)]
    assert sorted(s.message.sender for s in asks) == [4, 5] and {s.to for s in asks} == {COORDINATOR}
    net.run()
    assert all(p.state(v) == "committed" for p in net.stores.values())


def test_a_store_that_missed_a_death_aborts_the_version_and_the_next_commits():
    net, v = _Net(8, 2, 2), VersionId(0, 0)
    del net.stores[6]
    for s, p in net.stores.items():
        if s != 2:  # slot 2 has not heard yet
            p.on_peer_dead(6)
    net.coord.on_peer_dead(6)
    holders = {s: (s, (s + 1) % 8 if (s + 1) % 8 != 6 else 7) for s in net.stores}
    net.start(v, holders)
    net.run()
    net.feed(net.stores[2].on_peer_dead(6))
    net.run()
    assert net.coord.outcome(v) is False
    assert {p.state(v) for p in net.stores.values()} == {"aborted"}
    w = VersionId(0, 1)
    net.start(w, holders)
    net.run()
    assert {p.state(w) for p in net.stores.values()} == {"committed"}
