"""An in-process cluster of commit-protocol participants, for tests and benchmarks.

See :mod:`gemini_ckpt.commit` for the protocol; :class:`Simulator` delivers every message
in a seeded random order (no FIFO assumed), kills stores on cue, and checks as it runs that no
store commits before the coordinator decided COMMIT and that no two participants disagree.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from ..errors import CommitProtocolError
from ..commit import (
    COORDINATOR,
    DEFAULT_FANOUT,
    Aborted,
    Committed,
    Coordinator,
    HostCommit,
    Release,
    ReplicaAck,
    Replicate,
    Send,
    ShardStaged,
    VersionId,
)

__all__ = ["Simulator", "VersionReport", "placed_holders"]


def placed_holders(hosts: int, replicas: int, strategy: str) -> Callable:
    """The ``holders(slot, dead)`` a :class:`Simulator` takes: ``holders_for``, with the placement
    built once (hosts whose holders all live keep their placement, the rule's first clause; the
    others go through ``holders_for``), fast enough for 1,024 hosts."""
    import placement

    from ..hoststore.slots import holders_for

    base = placement.make(strategy, hosts=hosts, replicas=replicas)
    table = [base.holders(s) for s in range(hosts)]

    def holders(slot: int, dead: frozenset) -> tuple:
        if dead.isdisjoint(table[slot]):
            return table[slot]
        return holders_for(slot, hosts=hosts, replicas=replicas, strategy=strategy, dead=dead)

    return holders


@dataclass(frozen=True)
class VersionReport:
    """What :meth:`Simulator.run_version` saw of one version."""

    version: VersionId
    outcome: Optional[bool]  # the coordinator's decision
    outcomes: Mapping[int, Optional[bool]]  # live store -> its outcome
    sent: Mapping[int, int]  # participant (slot or COORDINATOR) -> control messages sent
    received: Mapping[int, int]  # ... and received (messages to a dead participant are lost)
    local: Mapping[int, int]  # store -> local inputs (rank stagings, data-plane completions)
    liveness: Mapping[int, int]  # participant -> death notices received
    acknowledged: bool  # every owner live at the start got all shards and every holder's ack
    died: tuple  # (slot, deliveries before it died) of stores killed during this version
    decided_at: Optional[int]  # deliveries before the coordinator decided
    timed_out: bool  # the version needed timeouts to be decided everywhere
    deliveries: int

    def handled(self, participant: int) -> int:
        return self.sent.get(participant, 0) + self.received.get(participant, 0)


class Simulator:
    """A whole job's host stores and coordinator in one process, messages delivered in a
    seeded random order (no FIFO assumed). Checks as it runs that no store commits before the
    coordinator decided COMMIT and that no two participants decide differently.

    ``holders(slot, dead)`` is the placement rule (``gemini_ckpt.hoststore.slots.holders_for``).
    """

    def __init__(
        self,
        *,
        hosts: int,
        replicas: int,
        holders: Callable,
        ranks_per_host: int = 1,
        keep: int = 2,
        fanout: int = DEFAULT_FANOUT,
        seed: int = 0,
        epoch: int = 0,
        idle: Iterable[int] = (),
    ) -> None:
        self.hosts, self.replicas, self.ranks_per_host, self.epoch = hosts, replicas, ranks_per_host, epoch
        self._holders = holders
        self.rng = random.Random(seed)
        self.idle = frozenset(idle)  # slots without ranks: they keep copies and acknowledge them, nothing more
        self.stores: dict = {
            s: HostCommit(s, hosts=hosts, replicas=replicas, keep=keep, fanout=fanout, idle=self.idle)
            for s in range(hosts)
            if s not in self.idle
        }
        self.coordinator = Coordinator(hosts=hosts, keep=keep, fanout=fanout, idle=self.idle)
        self.dead: set = set()
        self.committed_at: set = set()  # (slot, version): stores that marked a version committed
        self.unhealthy_at: set = set()  # (slot, version): ... and said its state is unhealthy
        self.checked_at: set = set()  # (slot, version): ... and said every shard carries a verdict
        self.released: dict = {}  # slot -> versions it let go of (retention), in order
        self.aborted: set = set()  # versions some participant aborted
        self._v = VersionId(epoch, -1)
        self._decided_at = None
        self._queue: list = []
        self._deliveries = 0

    @property
    def live(self) -> list:
        return sorted(self.stores)

    def kill(self, slot: int) -> None:
        """Kill a store between versions; every participant hears of it before the next one."""
        self._queue = []
        self._kill(slot)
        self._drain()

    def run_version(
        self,
        step: int,
        *,
        kill_after: Mapping[int, int] = (),
        unstaged: Mapping[int, int] = (),
        rank_failures: Iterable[int] = (),
        replica_failures: Iterable[tuple] = (),
        unhealthy: Mapping[int, str] = (),
        unchecked: Iterable[int] = (),
    ) -> VersionReport:
        """Save ``VersionId(epoch, step)`` until every participant is quiet, then time out
        whatever is undecided. ``kill_after={slot: n}`` kills that store after ``n``
        deliveries of this version (0: before it starts); ``unstaged={slot: k}``: ``k`` ranks
        of that host die before staging (silently, or reported with ``on_local_failure``
        when the slot is in ``rank_failures``); ``replica_failures`` are ``(holder, owner)``
        pairs whose copy cannot be kept; ``unhealthy={rank: reason}`` stages those ranks' shards
        as failing their health checks; ``unchecked`` ranks' shards carry no verdict (the
        others' do)."""
        v = VersionId(self.epoch, step)
        self._v = v
        self._sent: dict = {}
        self._received: dict = {}
        self._local: dict = {}
        self._liveness: dict = {}
        self._acked: dict = {}  # owner -> holders whose ack reached it
        self._staged: dict = {}  # owner -> shards staged into it
        self._deliveries = 0
        self._queue = []
        kill_after = dict(kill_after)
        bad_copies = set(replica_failures)
        self._bad_copies = bad_copies
        died = []
        self._decided_at: Optional[int] = None
        for slot in [s for s, n in kill_after.items() if n <= 0]:
            self._kill(slot)
            died.append((slot, 0))
        self._drain()  # deaths before the version are known to all
        starting = self.live
        self.coordinator.world_size = self.ranks_per_host * len(starting)  # ranks die with their host
        unstaged = dict(unstaged)
        unhealthy, unchecked = dict(unhealthy), set(unchecked)
        self._plans: dict = {}
        for s in starting:
            plan = self._holders(s, frozenset(self.stores[s].dead))
            self._plans[s] = plan
            self._queue.append(("start", s, plan))
            for rank in range(self.ranks_per_host - unstaged.get(s, 0)):
                global_rank = s * self.ranks_per_host + rank
                self._queue.append(
                    (
                        "msg",
                        None,
                        s,
                        ShardStaged(
                            v, global_rank, unhealthy.get(global_rank, ""), checked=global_rank not in unchecked
                        ),
                    )
                )
            if unstaged.get(s) and s in set(rank_failures):
                self._queue.append(("fail", s, f"{unstaged[s]} rank(s) died before staging"))
        pending_kills = sorted((n, s) for s, n in kill_after.items() if n > 0)
        self._drain(pending_kills, died)
        timed_out = False
        if self.coordinator.outcome(v) is None or any(p.outcome(v) is None for p in self.stores.values()):
            timed_out = True
            self._apply(COORDINATOR, self.coordinator.on_timeout(v))
            self._drain()
            for s in self.live:
                self._apply(s, self.stores[s].on_timeout(v))
            self._drain()
        acknowledged = all(
            self._staged.get(s, 0) >= self.ranks_per_host and self._acked.get(s, set()) >= set(self._plans[s][1:])
            for s in starting
        )
        return VersionReport(
            v,
            self.coordinator.outcome(v),
            {s: p.outcome(v) for s, p in self.stores.items()},
            dict(self._sent),
            dict(self._received),
            dict(self._local),
            dict(self._liveness),
            acknowledged,
            tuple(died),
            self._decided_at,
            timed_out,
            self._deliveries,
        )

    # --- internals -------------------------------------------------------------------------
    def _kill(self, slot: int) -> None:
        if slot not in self.stores:
            return
        del self.stores[slot]
        self.dead.add(slot)
        for p in [*self.stores, COORDINATOR]:
            self._queue.append(("dead", p, slot))

    def _drain(self, kills: list = (), died: Optional[list] = None) -> None:
        kills = list(kills)
        queue, rng = self._queue, self.rng
        while queue or kills:
            while kills and (kills[0][0] <= self._deliveries or not queue):
                _, slot = kills.pop(0)
                if slot in self.stores:
                    died.append((slot, self._deliveries))
                    self._kill(slot)
            if not queue:
                continue
            i = rng.randrange(len(queue))
            queue[i], queue[-1] = queue[-1], queue[i]
            self._deliver(queue.pop())

    def _deliver(self, event: tuple) -> None:
        kind, to = event[0], event[1]
        if kind == "msg":
            sender, to, message = event[1], event[2], event[3]
            participant = self.coordinator if to == COORDINATOR else self.stores.get(to)
            if participant is None:
                return  # lost with its receiver
            self._deliveries += 1
            if sender is None:
                self._local[to] = self._local.get(to, 0) + 1
                self._staged[to] = self._staged.get(to, 0) + 1
            else:
                self._received[to] = self._received.get(to, 0) + 1
                if isinstance(message, ReplicaAck) and message.ok:
                    self._acked.setdefault(to, set()).add(message.holder)
            self._apply(to, participant.on_message(message))
            return
        if kind == "stored" and to in self.idle:  # a copy on a slot without ranks: just its ack
            self._deliveries += 1
            self._queue.append(("msg", to, event[2], ReplicaAck(self._v, to)))
            return
        participant = self.coordinator if to == COORDINATOR else self.stores.get(to)
        if participant is None:
            return
        self._deliveries += 1
        if kind == "dead":
            self._liveness[to] = self._liveness.get(to, 0) + 1
            self._apply(to, participant.on_peer_dead(event[2]))
        elif kind == "start":
            self._local[to] = self._local.get(to, 0) + 1
            self._apply(to, participant.start_version(self._v, holders=event[2], shards=self.ranks_per_host))
        elif kind == "fail":
            self._apply(to, participant.on_local_failure(self._v, event[2]))
        elif kind == "stored":
            self._local[to] = self._local.get(to, 0) + 1
            owner = event[2]
            bad = (to, owner) in self._bad_copies
            self._apply(to, participant.replica_stored(self._v, owner, ok=not bad, reason="over budget" if bad else ""))

    def _apply(self, sender: int, actions: list) -> None:
        if sender == COORDINATOR and self._decided_at is None and self.coordinator.outcome(self._v) is not None:
            self._decided_at = self._deliveries
        for a in actions:
            if isinstance(a, Send):
                self._sent[sender] = self._sent.get(sender, 0) + 1
                self._queue.append(("msg", sender, a.to, a.message))
            elif isinstance(a, Replicate):
                for h in a.holders:
                    self._queue.append(("stored", h, sender))
            elif isinstance(a, Committed):
                if self.coordinator.outcome(a.version) is not True:
                    raise CommitProtocolError(
                        f"slot {sender} marked {a.version} committed before the coordinator decided COMMIT"
                    )
                if a.version in self.aborted:
                    raise CommitProtocolError(f"{a.version} was aborted somewhere, yet slot {sender} committed it")
                self.committed_at.add((sender, a.version))
                if a.unhealthy:
                    self.unhealthy_at.add((sender, a.version))
                if a.checked:
                    self.checked_at.add((sender, a.version))
            elif isinstance(a, Release):
                self.released.setdefault(sender, []).append(a.version)
            elif isinstance(a, Aborted):
                if self.coordinator.outcome(a.version) is True:
                    raise CommitProtocolError(f"slot {sender} aborted {a.version}, which the coordinator committed")
                self.aborted.add(a.version)
