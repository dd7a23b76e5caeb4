"""What every participant of the commit protocol shares: the tree over the live slots, one
round per version, dead slots, retention (see :mod:`gemini_ckpt.commit`).

Retention follows :class:`gemini_ckpt.retention.KeepNewest` (its one home, standard library
only): the newest ``keep`` healthy committed versions, plus the first unhealthy version of the
latest run of them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from ..retention import KeepNewest
from .messages import (
    COORDINATOR,
    HISTORY,
    MESSAGES,
    Aborted,
    Committed,
    Decision,
    Message,
    Release,
    Send,
    VersionId,
)


# --- the tree ----------------------------------------------------------------------------------
class Tree:
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
class Round:
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
    unhealthy: str = ""  # why a shard is unhealthy (the subtree's, then the decision's); empty: none
    checked_below: int = 0  # shards of the subtree (this store's included) whose records carry a verdict
    checked: bool = False  # the decision's: every shard carries a verdict
    forwarded: bool = False
    adoptees: set = field(default_factory=set)  # orphans that asked for the decision
    asked: Optional[int] = None  # whom this participant asked for the decision


def _check_fanout(fanout: int) -> None:
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 2:
        raise ValueError(f"fanout: expected an int >= 2, got {fanout!r}")


class Participant:
    """Shared bookkeeping of stores and coordinator: rounds, dead slots, retention."""

    slot: int

    def __init__(
        self,
        *,
        hosts: int,
        fanout: int,
        keep: int,
        dead: Iterable[int],
        committed: Iterable[VersionId],
        idle: Iterable[int] = (),
        unhealthy: Iterable[VersionId] = (),
    ) -> None:
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
        self._committed: list = sorted(committed)[-keep:]  # healthy ones only
        self._unhealthy: list = sorted(unhealthy)[:1]  # committed, kept for inspection
        self._retention = KeepNewest(keep)
        self._floor: Optional[VersionId] = None  # rounds at or below it were forgotten

    # --- queries ---------------------------------------------------------------------------
    def outcome(self, version: VersionId) -> Optional[bool]:
        """True (committed), False (aborted) or None (undecided or unknown here)."""
        r = self._rounds.get(version)
        if r is not None:
            return r.outcome
        return True if version in self._committed or version in self._unhealthy else None

    def reason(self, version: VersionId) -> str:
        """Why ``version`` was decided as it was here ("" while undecided, unknown or forgotten)."""
        r = self._rounds.get(version)
        return r.reason if r is not None else ""

    def committed_versions(self) -> tuple:
        """The newest ``keep`` healthy versions committed here, oldest first."""
        return tuple(self._committed)

    def unhealthy_versions(self) -> tuple:
        """Committed unhealthy versions kept here for inspection (at most one)."""
        return tuple(self._unhealthy)

    def newest_committed(self) -> Optional[VersionId]:
        return self._committed[-1] if self._committed else None

    def pending(self) -> tuple:
        """Versions heard of but not decided here (an actor times them out)."""
        return tuple(sorted(v for v, r in self._rounds.items() if r.outcome is None))

    # --- inputs ----------------------------------------------------------------------------
    def on_message(self, message: Message) -> list:
        """The actions ``message`` calls for, in order (none for a round forgotten here)."""
        if not isinstance(message, MESSAGES):
            raise TypeError(f"not a commit protocol message: {message!r}")
        out: list = []
        r = self._round(message.version)
        if r is not None:
            self._on_message(message.version, r, message, out)
        return out

    def _on_message(self, v: VersionId, r: Round, message: Message, out: list) -> None:
        raise NotImplementedError

    # --- helpers ---------------------------------------------------------------------------
    def _tree(self, view: frozenset) -> Tree:
        tree = self._trees.get(view)
        if tree is None:
            if len(self._trees) > 8:
                self._trees.clear()
            tree = self._trees[view] = Tree(self.hosts, view | self.idle, self.fanout)
        return tree

    def _round(self, version: VersionId) -> Optional[Round]:
        r = self._rounds.get(version)
        if r is None:
            if self._floor is not None and version <= self._floor:
                return None  # long decided and forgotten: a late duplicate
            view = frozenset(self.dead)
            tree = self._tree(view)
            if self.slot == COORDINATOR:
                r = Round(view, COORDINATOR, tree.top())
            else:
                r = Round(view, tree.parent(self.slot), tree.children(self.slot))
            self._rounds[version] = r
        return r

    def _decide(
        self,
        version: VersionId,
        r: Round,
        commit: bool,
        reason: str,
        out: list,
        unhealthy: str = "",
        checked: bool = False,
    ) -> None:
        r.outcome, r.reason = commit, reason
        if commit:
            r.unhealthy, r.checked = unhealthy, checked
            out.append(Committed(version, unhealthy, checked))
            bisect.insort(self._unhealthy if unhealthy else self._committed, version)
            held = self._committed + self._unhealthy
            for doomed in self._retention.doomed(held, unhealthy=self._unhealthy):
                (self._unhealthy if doomed in self._unhealthy else self._committed).remove(doomed)
                out.append(Release(doomed))
        else:
            out.append(Aborted(version, reason))
        self._forward(version, r, out)
        self._forget_old()

    def _forward(self, version: VersionId, r: Round, out: list) -> None:
        if r.forwarded or r.outcome is None:
            return
        r.forwarded = True
        decision = Decision(version, r.outcome, r.reason, r.unhealthy, r.checked)
        for to in (*r.children, *sorted(r.adoptees)):
            if to not in self.dead:
                out.append(Send(to, decision))

    def _adopt(self, version: VersionId, r: Round, sender: int, out: list) -> None:
        """``sender`` waits on this participant for the decision: send it now or once decided."""
        if r.outcome is not None:
            if sender not in r.adoptees:
                out.append(Send(sender, Decision(version, r.outcome, r.reason, r.unhealthy, r.checked)))
        r.adoptees.add(sender)

    def _forget_old(self) -> None:
        decided = [v for v, r in self._rounds.items() if r.outcome is not None]
        if len(decided) > 2 * HISTORY:
            decided.sort()
            for v in decided[:-HISTORY]:
                del self._rounds[v]
            self._floor = max(self._floor or decided[0], decided[-HISTORY - 1])
