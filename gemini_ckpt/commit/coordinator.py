"""The commit protocol's one decider, run by the registry (see :mod:`gemini_ckpt.commit`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from .messages import (
    COORDINATOR,
    DEFAULT_FANOUT,
    Decision,
    Message,
    Query,
    Send,
    VersionId,
    Vote,
)
from .participant import Participant, Round


class Coordinator(Participant):
    """The one decider (run by the registry): the root of every version's tree, and the place
    a reader asks for the newest committed version (:meth:`newest_committed`).

    ``world_size``, when set, is the number of shards (ranks) every version must have: a
    version whose stores staged fewer (a host store died but its ranks did not) aborts. An
    elastic job sets it again (:attr:`world_size`) when its ranks change."""

    slot = COORDINATOR

    def __init__(
        self,
        *,
        hosts: int,
        keep: int = 2,
        fanout: int = DEFAULT_FANOUT,
        dead: Iterable[int] = (),
        committed: Iterable[VersionId] = (),
        world_size: Optional[int] = None,
        idle: Iterable[int] = (),
    ) -> None:
        super().__init__(hosts=hosts, fanout=fanout, keep=keep, dead=dead, committed=committed, idle=idle)
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise ValueError(f"world_size: expected None or an int >= 1, got {world_size!r}")
        self.world_size = world_size

    def _on_message(self, v: VersionId, r: Round, message: Message, out: list) -> None:
        if isinstance(message, Vote):
            if message.view != r.view or message.sender not in r.children:
                self._adopt(v, r, message.sender, out)
            if r.outcome is not None:
                return
            if message.view != r.view or message.sender not in r.children:
                self._decide(
                    v,
                    r,
                    False,
                    f"slot {message.sender} began the version with dead hosts "
                    f"{sorted(message.view)}, the coordinator with {sorted(r.view)}",
                    out,
                )
            elif not message.ok:
                self._decide(v, r, False, message.reason, out)
            elif message.sender not in r.votes:
                r.votes.add(message.sender)
                r.below += message.shards
                r.unhealthy = r.unhealthy or message.unhealthy
                r.checked_below += message.checked
                if not r.votes.issuperset(r.children):
                    pass
                elif self.world_size is not None and r.below != self.world_size:
                    self._decide(
                        v,
                        r,
                        False,
                        f"{r.below} of {self.world_size} ranks' shards were staged: the "
                        f"ranks of a host whose store died cannot save",
                        out,
                    )
                else:
                    self._decide(v, r, True, "", out, unhealthy=r.unhealthy, checked=r.checked_below == r.below)
        elif isinstance(message, Query):
            if r.outcome is not None:
                out.append(Send(message.sender, Decision(v, r.outcome, r.reason, r.unhealthy, r.checked)))
            else:
                r.adoptees.add(message.sender)
                self._decide(v, r, False, f"slot {message.sender} lost its path to the coordinator", out)
        else:
            raise TypeError(f"the coordinator takes votes and queries, got {message!r}")

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
