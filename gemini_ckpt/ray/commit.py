"""Commit among the host stores: a message-driven state machine, no I/O.

A version is **committed** when every holder of every shard acknowledged its copy. The host
stores decide it among themselves, with the registry as the one decider; the training
processes take no part once their shards are staged. See ``docs/commit.md`` for the protocol,
its message counts, failure handling and the reader's rule; in short:

- every live host store (by slot) is a :class:`HostCommit`; the registry runs the
  :class:`Coordinator`. For each version they form a fixed ``fanout``-ary heap over the live
  slots, the coordinator above the first ``fanout`` of them;
- an owner store is *locally done* once it has its ranks' shards (:class:`ShardStaged`) and a
  :class:`ReplicaAck` from each of its other holders. A store sends one :class:`Vote` up once
  it and all its children are done (or a veto as soon as anything failed);
- the coordinator decides COMMIT when its children all voted yes, ABORT on any veto, death or
  timeout; the :class:`Decision` flows down the same tree. Only the coordinator ever decides
  COMMIT; a store that has not voted yes may abort on its own (it can never be committed);
- a store whose parent died after it voted asks its nearest live ancestor (:class:`Query`),
  which answers with the decision once it has it: the tree routes around dead stores.

Each participant sends and receives O(replicas + fanout) control messages per version, and a
decision takes O(log_fanout hosts) hops each way.

The participants only *say* what to do: each input returns a list of actions, :class:`Send`
(a control message for another participant, or the coordinator at :data:`COORDINATOR`) and
local effects (:class:`Replicate`, :class:`Committed`, :class:`Aborted`, :class:`Release`)
for the actor to apply in order. This module is stdlib only and imports nothing from the
package. :class:`gemini_ckpt.ray.commit_sim.Simulator` runs a whole cluster of them in-process
(tests, benchmarks).

Example (two hosts, two copies, one rank each)::

    sim = Simulator(hosts=2, replicas=2, holders=lambda slot, dead: (slot, 1 - slot))
    report = sim.run_version(step=0)
    assert report.outcome is True and sim.coordinator.newest_committed() == VersionId(0, 0)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Union

__all__ = [
    "COORDINATOR", "DEFAULT_FANOUT", "Aborted", "Action", "Committed", "Coordinator", "Decision",
    "HostCommit", "Message", "ProtocolError", "Query", "Release", "Replicate", "ReplicaAck", "Send",
    "ShardStaged", "VersionId", "Vote",
]

COORDINATOR = -1
"""Address of the coordinator (the registry actor) in :class:`Send` and the tree."""

DEFAULT_FANOUT = 4
"""Children per node of the commit tree: 1,024 hosts are 5 levels deep."""

_HISTORY = 256  # decided versions a participant remembers, to answer late messages


class ProtocolError(RuntimeError):
    """Participants disagree about a decision: a bug in the protocol or its driver."""


@dataclass(frozen=True, order=True)
class VersionId:
    """One version of the job: ``step`` within slot-table ``epoch``; newer compares greater.
    An id is used once: saving a step again within an epoch needs a new epoch."""

    epoch: int
    step: int


# --- messages (control plane, small, picklable) ----------------------------------------------
@dataclass(frozen=True)
class ShardStaged:
    """A rank of this host staged its shard of ``version`` into this store (local input)."""

    version: VersionId
    rank: int


@dataclass(frozen=True)
class ReplicaAck:
    """Holder ``holder`` keeps (``ok``) or could not keep a complete copy of the owner's
    shards of ``version``: the data plane's acknowledgement, one per holder and version."""

    version: VersionId
    holder: int
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True)
class Vote:
    """Child ``sender`` to its parent: its whole subtree is done (``ok``) or vetoes. ``view`` is
    the set of slots the sender knew dead when the version began: the tree it used."""

    version: VersionId
    sender: int
    view: frozenset
    ok: bool
    reason: str = ""
    shards: int = 0  # shards staged in the sender's subtree (a yes vote)


@dataclass(frozen=True)
class Decision:
    """The outcome of ``version``, flowing down the tree (and to those who asked)."""

    version: VersionId
    commit: bool
    reason: str = ""


@dataclass(frozen=True)
class Query:
    """``sender`` voted but lost its path to the coordinator: send it the decision."""

    version: VersionId
    sender: int


Message = Union[ShardStaged, ReplicaAck, Vote, Decision, Query]
_MESSAGES = (ShardStaged, ReplicaAck, Vote, Decision, Query)


# --- actions (what the actor does with a participant's answer) --------------------------------
@dataclass(frozen=True)
class Send:
    """Deliver ``message`` to slot ``to`` (or the coordinator, :data:`COORDINATOR`)."""

    to: int
    message: Message


@dataclass(frozen=True)
class Replicate:
    """All local shards of ``version`` are staged: push them to ``holders`` (the data plane;
    an actor may start earlier, shard by shard). Each holder then calls
    :meth:`HostCommit.replica_stored`."""

    version: VersionId
    holders: tuple


@dataclass(frozen=True)
class Committed:
    """Mark ``version`` committed here: readers may trust it."""

    version: VersionId


@dataclass(frozen=True)
class Aborted:
    """``version`` will never be committed: free what this store holds of it."""

    version: VersionId
    reason: str


@dataclass(frozen=True)
class Release:
    """A committed version fell out of the newest ``keep``: free it."""

    version: VersionId


Action = Union[Send, Replicate, Committed, Aborted, Release]


# --- the tree ----------------------------------------------------------------------------------
class _Tree:
    """A ``fanout``-ary heap over the live slots of ``0..hosts-1`` in slot order: position
    ``p``'s parent is ``p // fanout - 1``, the coordinator's children are positions
    ``0..fanout-1``. Lookups cost O(dead), nothing is O(hosts)."""

    def __init__(self, hosts: int, dead: frozenset, fanout: int) -> None:
        self.fanout = fanout
        self.dead = tuple(sorted(d for d in dead if 0 <= d < hosts))
        self.live = hosts - len(self.dead)

    def _position(self, slot: int) -> int:
        return slot - bisect.bisect_left(self.dead, slot)

    def _slot_at(self, position: int) -> int:
        slot = position
        for d in self.dead:
            if d > slot:
                break
            slot += 1
        return slot

    def parent(self, slot: int) -> int:
        p = self._position(slot)
        return COORDINATOR if p < self.fanout else self._slot_at(p // self.fanout - 1)

    def children(self, slot: int) -> tuple:
        first = self.fanout * (self._position(slot) + 1)
        return tuple(self._slot_at(q) for q in range(first, min(first + self.fanout, self.live)))

    def top(self) -> tuple:
        return tuple(self._slot_at(q) for q in range(min(self.fanout, self.live)))


@dataclass
class _Round:
    """What one participant knows of one version."""

    view: frozenset  # slots known dead when this participant first heard of the version
    parent: int
    children: tuple
    started: bool = False
    holders: tuple = ()
    shards: int = 0
    staged: set = field(default_factory=set)
    acked: set = field(default_factory=set)
    votes: set = field(default_factory=set)  # children that voted yes
    below: int = 0  # shards their subtrees staged
    voted: bool = False  # this participant voted yes: from now on only the coordinator decides
    replicated: bool = False
    outcome: Optional[bool] = None
    reason: str = ""
    forwarded: bool = False
    adoptees: set = field(default_factory=set)  # orphans that asked for the decision
    asked: Optional[int] = None  # whom this participant asked for the decision


def _check_fanout(fanout: int) -> None:
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 2:
        raise ValueError(f"fanout: expected an int >= 2, got {fanout!r}")


class _Participant:
    """Shared bookkeeping of stores and coordinator: rounds, dead slots, retention."""

    slot: int

    def __init__(self, *, hosts: int, fanout: int, keep: int, dead: Iterable[int],
                 committed: Iterable[VersionId], idle: Iterable[int] = ()) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts: expected an int >= 1, got {hosts!r}")
        _check_fanout(fanout)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: expected an int >= 1 (committed versions kept), got {keep!r}")
        self.hosts, self.fanout, self.keep = hosts, fanout, keep
        self.dead: set = set(dead)
        self.idle = frozenset(idle)  # slots without ranks this epoch: they hold copies but never vote
        self._rounds: dict = {}
        self._trees: dict = {}
        self._committed: list = sorted(committed)[-keep:]
        self._floor: Optional[VersionId] = None  # rounds at or below it were forgotten

    # --- queries ---------------------------------------------------------------------------
    def outcome(self, version: VersionId) -> Optional[bool]:
        """True (committed), False (aborted) or None (undecided or unknown here)."""
        r = self._rounds.get(version)
        if r is not None:
            return r.outcome
        return True if version in self._committed else None

    def committed_versions(self) -> tuple:
        """The newest ``keep`` versions committed here, oldest first."""
        return tuple(self._committed)

    def newest_committed(self) -> Optional[VersionId]:
        return self._committed[-1] if self._committed else None

    def pending(self) -> tuple:
        """Versions heard of but not decided here (an actor times them out)."""
        return tuple(sorted(v for v, r in self._rounds.items() if r.outcome is None))

    # --- helpers ---------------------------------------------------------------------------
    def _tree(self, view: frozenset) -> _Tree:
        tree = self._trees.get(view)
        if tree is None:
            if len(self._trees) > 8:
                self._trees.clear()
            tree = self._trees[view] = _Tree(self.hosts, view | self.idle, self.fanout)
        return tree

    def _round(self, version: VersionId) -> Optional[_Round]:
        r = self._rounds.get(version)
        if r is None:
            if self._floor is not None and version <= self._floor:
                return None  # long decided and forgotten: a late duplicate
            view = frozenset(self.dead)
            tree = self._tree(view)
            if self.slot == COORDINATOR:
                r = _Round(view, COORDINATOR, tree.top())
            else:
                r = _Round(view, tree.parent(self.slot), tree.children(self.slot))
            self._rounds[version] = r
        return r

    def _decide(self, version: VersionId, r: _Round, commit: bool, reason: str, out: list) -> None:
        r.outcome, r.reason = commit, reason
        if commit:
            out.append(Committed(version))
            bisect.insort(self._committed, version)
            while len(self._committed) > self.keep:
                out.append(Release(self._committed.pop(0)))
        else:
            out.append(Aborted(version, reason))
        self._forward(version, r, out)
        self._forget_old()

    def _forward(self, version: VersionId, r: _Round, out: list) -> None:
        if r.forwarded or r.outcome is None:
            return
        r.forwarded = True
        decision = Decision(version, r.outcome, r.reason)
        for to in (*r.children, *sorted(r.adoptees)):
            if to not in self.dead:
                out.append(Send(to, decision))

    def _adopt(self, version: VersionId, r: _Round, sender: int, out: list) -> None:
        """``sender`` waits on this participant for the decision: send it now or once decided."""
        if r.outcome is not None:
            if sender not in r.adoptees:
                out.append(Send(sender, Decision(version, r.outcome, r.reason)))
        r.adoptees.add(sender)

    def _forget_old(self) -> None:
        decided = [v for v, r in self._rounds.items() if r.outcome is not None]
        if len(decided) > 2 * _HISTORY:
            decided.sort()
            for v in decided[:-_HISTORY]:
                del self._rounds[v]
            self._floor = max(self._floor or decided[0], decided[-_HISTORY - 1])


class HostCommit(_Participant):
    """The commit protocol as run by the host store of ``slot`` (see the module docstring).

    ``hosts`` slots in the job, ``replicas`` copies of each shard (the owner's included),
    ``keep`` committed versions kept in memory, ``dead`` slots already known dead,
    ``committed`` versions already committed here (carried over from an earlier epoch).

    Inputs, each returning the actions to carry out in order: :meth:`start_version` (the
    store learns a version is being saved, and where its shards go), :meth:`on_message`
    (a message from a rank or another participant), :meth:`replica_stored` (the data plane
    finished receiving an owner's copy), :meth:`on_peer_dead` (liveness), :meth:`on_timeout`
    and :meth:`on_local_failure`.
    """

    def __init__(self, slot: int, *, hosts: int, replicas: int, keep: int = 2,
                 fanout: int = DEFAULT_FANOUT, dead: Iterable[int] = (),
                 committed: Iterable[VersionId] = (), idle: Iterable[int] = ()) -> None:
        super().__init__(hosts=hosts, fanout=fanout, keep=keep, dead=dead, committed=committed, idle=idle)
        if slot in self.idle:
            raise ValueError(f"slot {slot} has no ranks this epoch (idle): it holds copies but takes no part")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < hosts:
            raise ValueError(f"slot: expected an int in 0..{hosts - 1}, got {slot!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= hosts:
            raise ValueError(f"replicas: expected an int in 1..{hosts}, got {replicas!r}")
        self.slot, self.replicas = slot, replicas

    def state(self, version: VersionId) -> str:
        """``committed``, ``aborted``, ``prepared`` (voted yes, decision not here yet: every
        copy this store owns is acknowledged), ``pending`` or ``unknown``."""
        r = self._rounds.get(version)
        if r is None:
            return "committed" if version in self._committed else "unknown"
        if r.outcome is not None:
            return "committed" if r.outcome else "aborted"
        return "prepared" if r.voted else "pending"

    def in_doubt(self) -> tuple:
        """Versions this store voted for whose decision has not reached it."""
        return tuple(sorted(v for v, r in self._rounds.items() if r.voted and r.outcome is None))

    # --- inputs ----------------------------------------------------------------------------
    def start_version(self, version: VersionId, *, holders: tuple, shards: int) -> list:
        """This store saves ``version``: ``shards`` ranks of this host stage one shard each,
        and ``holders`` (this slot first; ``holders_for`` over :attr:`dead`) keep copies."""
        holders = tuple(holders)
        if (len(holders) != self.replicas or len(set(holders)) != len(holders) or holders[0] != self.slot
                or not all(isinstance(h, int) and 0 <= h < self.hosts for h in holders)):
            raise ValueError(f"holders: expected {self.replicas} distinct slots in 0..{self.hosts - 1} "
                             f"starting with this slot {self.slot}, got {holders!r}")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards: expected an int >= 1 (ranks on this host), got {shards!r}")
        out: list = []
        r = self._round(version)
        if r is None:
            return out
        if r.outcome is False:
            return [Aborted(version, r.reason)]  # decided before this store started it
        if r.started:
            return out
        r.started, r.holders, r.shards = True, holders, shards
        dead = sorted(set(holders) & (self.dead | r.view))
        if dead:
            self._veto(version, r, f"holder slot(s) {dead} of slot {self.slot} are dead", out)
        self._progress(version, r, out)
        return out

    def on_message(self, message: Message) -> list:
        if not isinstance(message, _MESSAGES):
            raise TypeError(f"not a commit protocol message: {message!r}")
        out: list = []
        r = self._round(message.version)
        if r is None:
            return out
        v = message.version
        if isinstance(message, ShardStaged):
            r.staged.add(message.rank)
        elif isinstance(message, ReplicaAck):
            if not message.ok:
                self._veto(v, r, f"holder slot {message.holder} could not keep the copy of slot "
                                 f"{self.slot}: {message.reason}", out)
            r.acked.add(message.holder)
        elif isinstance(message, Vote):
            if message.view != r.view or message.sender not in r.children:
                # A voter that built another tree: it waits on this store for the decision.
                self._adopt(v, r, message.sender, out)
                self._veto(v, r, f"slot {message.sender} began the version knowing dead hosts "
                                 f"{sorted(message.view)}, slot {self.slot} {sorted(r.view)}", out)
            elif not message.ok:
                self._veto(v, r, message.reason, out)
            elif message.sender not in r.votes:
                r.votes.add(message.sender)
                r.below += message.shards
        elif isinstance(message, Decision):
            self._on_decision(v, r, message, out)
        elif isinstance(message, Query):
            self._on_query(v, r, message, out)
        else:
            raise TypeError(f"not a commit protocol message: {message!r}")
        self._progress(v, r, out)
        return out

    def replica_stored(self, version: VersionId, owner: int, *, ok: bool = True, reason: str = "") -> list:
        """The data plane holds a complete copy of ``owner``'s shards of ``version`` here (or,
        ``ok=False``, could not keep it): acknowledge to the owner."""
        if self.outcome(version) is False:
            ok, reason = False, f"slot {self.slot} already aborted this version"
        return [Send(owner, ReplicaAck(version, self.slot, ok, reason))]

    def on_peer_dead(self, slot: int) -> list:
        """The host store of ``slot`` died. Versions this store has not voted for abort; a
        version it voted for whose path to the coordinator broke asks the nearest live
        ancestor for the decision."""
        out: list = []
        if slot in self.dead:
            return out
        self.dead.add(slot)
        now = self._tree(frozenset(self.dead))
        for v, r in sorted(self._rounds.items()):
            if r.outcome is not None or slot in r.view:
                continue
            # Stores that learnt of the death before this version began built the tree
            # without the dead slot: tell this store's parent and children in that tree too,
            # or they would wait for it until their timeout.
            parent = now.parent(self.slot)
            if parent != r.parent and parent not in self.dead:
                out.append(Send(parent, Vote(v, self.slot, r.view, r.voted, f"the host store of slot {slot} died")))
            if not r.voted:
                self._veto(v, r, f"the host store of slot {slot} died", out)
                for child in now.children(self.slot):
                    if child not in r.children and child not in r.adoptees:
                        out.append(Send(child, Decision(v, False, r.reason)))
            elif (r.asked is None and slot == r.parent) or r.asked == slot:
                self._ask(v, r, out)
        return out

    def on_timeout(self, version: VersionId) -> list:
        """``version`` took too long here: abort it if this store has not voted, else ask the
        coordinator for the decision (give stores a longer timeout than the coordinator)."""
        out: list = []
        r = self._rounds.get(version)
        if r is None or r.outcome is not None:
            return out
        if not r.voted:
            self._veto(version, r, f"slot {self.slot} timed out waiting for {self._missing(r)}", out)
        elif r.asked != COORDINATOR:
            r.asked = COORDINATOR
            out.append(Send(COORDINATOR, Query(version, self.slot)))
        return out

    def on_local_failure(self, version: VersionId, reason: str) -> list:
        """Something local failed (a rank died before staging, a copy could not be sent):
        abort ``version`` if this store has not voted yet."""
        out: list = []
        r = self._round(version)
        if r is not None:
            self._veto(version, r, f"slot {self.slot}: {reason}", out)
        return out

    # --- internals -------------------------------------------------------------------------
    def _progress(self, v: VersionId, r: _Round, out: list) -> None:
        if not r.started or r.outcome is not None:
            return
        staged = len(r.staged) >= r.shards
        if staged and not r.replicated:
            r.replicated = True
            out.append(Replicate(v, r.holders[1:]))
        if (not r.voted and staged and r.acked.issuperset(r.holders[1:])
                and r.votes.issuperset(r.children)):
            r.voted = True
            out.append(Send(r.parent, Vote(v, self.slot, r.view, True, shards=r.shards + r.below)))

    def _veto(self, v: VersionId, r: _Round, reason: str, out: list) -> None:
        if r.outcome is not None or r.voted:
            return  # after a yes vote only the coordinator decides
        if r.parent not in self.dead:
            out.append(Send(r.parent, Vote(v, self.slot, r.view, False, reason)))
        self._decide(v, r, False, reason, out)

    def _on_decision(self, v: VersionId, r: _Round, d: Decision, out: list) -> None:
        if r.outcome is None:
            if d.commit and not r.voted:
                raise ProtocolError(f"slot {self.slot}: {v} committed before this store voted for it")
            self._decide(v, r, d.commit, d.reason, out)
        elif r.outcome != d.commit:
            raise ProtocolError(f"slot {self.slot}: {v} was {'committed' if r.outcome else 'aborted'} here "
                                f"but a decision says {'commit' if d.commit else 'abort'}")

    def _on_query(self, v: VersionId, r: _Round, q: Query, out: list) -> None:
        if r.outcome is not None:
            out.append(Send(q.sender, Decision(v, r.outcome, r.reason)))
            return
        self._adopt(v, r, q.sender, out)
        if not r.voted:
            self._veto(v, r, f"slot {q.sender} lost its parent", out)
        elif r.asked is None and r.parent in self.dead:
            self._ask(v, r, out)

    def _ask(self, v: VersionId, r: _Round, out: list) -> None:
        tree = self._tree(r.view)
        target = r.parent
        while target != COORDINATOR and target in self.dead:
            target = tree.parent(target)
        r.asked = target
        out.append(Send(target, Query(v, self.slot)))

    def _missing(self, r: _Round) -> str:
        if not r.started:
            return "its ranks to begin the version"
        parts = []
        if len(r.staged) < r.shards:
            parts.append(f"{r.shards - len(r.staged)} of {r.shards} local shard(s)")
        if not r.acked.issuperset(r.holders[1:]):
            parts.append(f"acks from holder slot(s) {sorted(set(r.holders[1:]) - r.acked)}")
        if not r.votes.issuperset(r.children):
            parts.append(f"votes of child slot(s) {sorted(set(r.children) - r.votes)}")
        return ", ".join(parts) or "nothing"


class Coordinator(_Participant):
    """The one decider (run by the registry): the root of every version's tree, and the place
    a reader asks for the newest committed version (:meth:`newest_committed`).

    ``world_size``, when set, is the number of shards (ranks) every version must have: a
    version whose stores staged fewer (a host store died but its ranks did not) aborts. An
    elastic job sets it again (:attr:`world_size`) when its ranks change."""

    slot = COORDINATOR

    def __init__(self, *, hosts: int, keep: int = 2, fanout: int = DEFAULT_FANOUT, dead: Iterable[int] = (),
                 committed: Iterable[VersionId] = (), world_size: Optional[int] = None,
                 idle: Iterable[int] = ()) -> None:
        super().__init__(hosts=hosts, fanout=fanout, keep=keep, dead=dead, committed=committed, idle=idle)
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                       or world_size < 1):
            raise ValueError(f"world_size: expected None or an int >= 1, got {world_size!r}")
        self.world_size = world_size

    def on_message(self, message: Message) -> list:
        if not isinstance(message, _MESSAGES):
            raise TypeError(f"not a commit protocol message: {message!r}")
        out: list = []
        r = self._round(message.version)
        if r is None:
            return out
        v = message.version
        if isinstance(message, Vote):
            if message.view != r.view or message.sender not in r.children:
                self._adopt(v, r, message.sender, out)
            if r.outcome is not None:
                return out
            if message.view != r.view or message.sender not in r.children:
                self._decide(v, r, False, f"slot {message.sender} began the version with dead hosts "
                                          f"{sorted(message.view)}, the coordinator with {sorted(r.view)}", out)
            elif not message.ok:
                self._decide(v, r, False, message.reason, out)
            elif message.sender not in r.votes:
                r.votes.add(message.sender)
                r.below += message.shards
                if not r.votes.issuperset(r.children):
                    pass
                elif self.world_size is not None and r.below != self.world_size:
                    self._decide(v, r, False, f"{r.below} of {self.world_size} ranks' shards were staged: the "
                                              f"ranks of a host whose store died cannot save", out)
                else:
                    self._decide(v, r, True, "", out)
        elif isinstance(message, Query):
            if r.outcome is not None:
                out.append(Send(message.sender, Decision(v, r.outcome, r.reason)))
            else:
                r.adoptees.add(message.sender)
                self._decide(v, r, False, f"slot {message.sender} lost its path to the coordinator", out)
        else:
            raise TypeError(f"the coordinator takes votes and queries, got {message!r}")
        return out

    def on_peer_dead(self, slot: int) -> list:
        """A host store died: every version in flight over it aborts."""
        out: list = []
        if slot in self.dead:
            return out
        self.dead.add(slot)
        for v, r in sorted(self._rounds.items()):
            if r.outcome is None and slot not in r.view:
                self._decide(v, r, False, f"the host store of slot {slot} died", out)
        return out

    def on_timeout(self, version: VersionId) -> list:
        out: list = []
        r = self._round(version)
        if r is not None and r.outcome is None:
            missing = sorted(set(r.children) - r.votes)
            self._decide(version, r, False, f"timed out waiting for the votes of slot(s) {missing}", out)
        return out
