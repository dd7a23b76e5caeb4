"""The commit protocol as a host store runs it (see :mod:`gemini_ckpt.commit`)."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CommitProtocolError
from .messages import (
    COORDINATOR,
    DEFAULT_FANOUT,
    Aborted,
    Decision,
    Message,
    Query,
    ReplicaAck,
    Replicate,
    Send,
    ShardStaged,
    VersionId,
    VersionState,
    Vote,
)
from .participant import Participant, Round


class HostCommit(Participant):
    """The commit protocol as run by the host store of ``slot`` (see the module docstring).

    ``hosts`` slots in the job, ``replicas`` copies of each shard (the owner's included),
    ``keep`` healthy committed versions kept in memory, ``dead`` slots already known dead,
    ``committed`` healthy versions already committed here (carried over from an earlier
    epoch), ``unhealthy`` committed ones kept for inspection.

    Inputs, each returning the actions to carry out in order: :meth:`start_version` (the
    store learns a version is being saved, and where its shards go), :meth:`on_message`
    (a message from a rank or another participant), :meth:`replica_stored` (the data plane
    finished receiving an owner's copy), :meth:`on_peer_dead` (liveness), :meth:`on_timeout`
    and :meth:`on_local_failure`.
    """

    def __init__(
        self,
        slot: int,
        *,
        hosts: int,
        replicas: int,
        keep: int = 2,
        fanout: int = DEFAULT_FANOUT,
        dead: Iterable[int] = (),
        committed: Iterable[VersionId] = (),
        idle: Iterable[int] = (),
        unhealthy: Iterable[VersionId] = (),
    ) -> None:
        super().__init__(
            hosts=hosts, fanout=fanout, keep=keep, dead=dead, committed=committed, idle=idle, unhealthy=unhealthy
        )
        if slot in self.idle:
            raise ValueError(f"slot {slot} has no ranks this epoch (idle): it holds copies but takes no part")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < hosts:
            raise ValueError(f"slot: expected an int in 0..{hosts - 1}, got {slot!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= hosts:
            raise ValueError(f"replicas: expected an int in 1..{hosts}, got {replicas!r}")
        self.slot, self.replicas = slot, replicas

    def state(self, version: VersionId) -> VersionState:
        """Where ``version`` stands here (:class:`VersionState`)."""
        r = self._rounds.get(version)
        if r is None:
            return VersionState.COMMITTED if version in self._committed else VersionState.UNKNOWN
        if r.outcome is not None:
            return VersionState.COMMITTED if r.outcome else VersionState.ABORTED
        return VersionState.PREPARED if r.voted else VersionState.PENDING

    # --- inputs ----------------------------------------------------------------------------
    def start_version(self, version: VersionId, *, holders: tuple, shards: int) -> list:
        """This store saves ``version``: ``shards`` ranks of this host stage one shard each,
        and ``holders`` (this slot first; ``holders_for`` over :attr:`dead`) keep copies."""
        holders = tuple(holders)
        if (
            len(holders) != self.replicas
            or len(set(holders)) != len(holders)
            or holders[0] != self.slot
            or not all(isinstance(h, int) and 0 <= h < self.hosts for h in holders)
        ):
            raise ValueError(
                f"holders: expected {self.replicas} distinct slots in 0..{self.hosts - 1} "
                f"starting with this slot {self.slot}, got {holders!r}"
            )
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

    def _on_message(self, v: VersionId, r: Round, message: Message, out: list) -> None:
        if isinstance(message, ShardStaged):
            if message.rank not in r.staged:
                r.checked_below += bool(message.checked)
            r.staged.add(message.rank)
            r.unhealthy = r.unhealthy or message.unhealthy
        elif isinstance(message, ReplicaAck):
            if not message.ok:
                self._veto(
                    v,
                    r,
                    f"holder slot {message.holder} could not keep the copy of slot {self.slot}: {message.reason}",
                    out,
                )
            r.acked.add(message.holder)
        elif isinstance(message, Vote):
            if message.view != r.view or message.sender not in r.children:
                # A voter that built another tree: it waits on this store for the decision.
                self._adopt(v, r, message.sender, out)
                self._veto(
                    v,
                    r,
                    f"slot {message.sender} began the version knowing dead hosts "
                    f"{sorted(message.view)}, slot {self.slot} {sorted(r.view)}",
                    out,
                )
            elif not message.ok:
                self._veto(v, r, message.reason, out)
            elif message.sender not in r.votes:
                r.votes.add(message.sender)
                r.below += message.shards
                r.unhealthy = r.unhealthy or message.unhealthy
                r.checked_below += message.checked
        elif isinstance(message, Decision):
            self._on_decision(v, r, message, out)
        elif isinstance(message, Query):
            self._on_query(v, r, message, out)
        else:
            raise TypeError(f"not a commit protocol message: {message!r}")
        self._progress(v, r, out)

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
    def _progress(self, v: VersionId, r: Round, out: list) -> None:
        if not r.started or r.outcome is not None:
            return
        staged = len(r.staged) >= r.shards
        if staged and not r.replicated:
            r.replicated = True
            out.append(Replicate(v, r.holders[1:]))
        if not r.voted and staged and r.acked.issuperset(r.holders[1:]) and r.votes.issuperset(r.children):
            r.voted = True
            out.append(
                Send(
                    r.parent,
                    Vote(
                        v,
                        self.slot,
                        r.view,
                        True,
                        shards=r.shards + r.below,
                        unhealthy=r.unhealthy,
                        checked=r.checked_below,
                    ),
                )
            )

    def _veto(self, v: VersionId, r: Round, reason: str, out: list) -> None:
        if r.outcome is not None or r.voted:
            return  # after a yes vote only the coordinator decides
        if r.parent not in self.dead:
            out.append(Send(r.parent, Vote(v, self.slot, r.view, False, reason)))
        self._decide(v, r, False, reason, out)

    def _on_decision(self, v: VersionId, r: Round, d: Decision, out: list) -> None:
        if r.outcome is None:
            if d.commit and not r.voted:
                raise CommitProtocolError(f"slot {self.slot}: {v} committed before this store voted for it")
            self._decide(v, r, d.commit, d.reason, out, unhealthy=d.unhealthy, checked=d.checked)
        elif r.outcome != d.commit:
            raise CommitProtocolError(
                f"slot {self.slot}: {v} was {'committed' if r.outcome else 'aborted'} here "
                f"but a decision says {'commit' if d.commit else 'abort'}"
            )

    def _on_query(self, v: VersionId, r: Round, q: Query, out: list) -> None:
        if r.outcome is not None:
            out.append(Send(q.sender, Decision(v, r.outcome, r.reason, r.unhealthy, r.checked)))
            return
        self._adopt(v, r, q.sender, out)
        if not r.voted:
            self._veto(v, r, f"slot {q.sender} lost its parent", out)
        elif r.asked is None and r.parent in self.dead:
            self._ask(v, r, out)

    def _ask(self, v: VersionId, r: Round, out: list) -> None:
        tree = self._tree(r.view)
        target = r.parent
        while target != COORDINATOR and target in self.dead:
            target = tree.parent(target)
        r.asked = target
        out.append(Send(target, Query(v, self.slot)))

    def _missing(self, r: Round) -> str:
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
