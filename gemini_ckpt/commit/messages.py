"""The commit protocol's vocabulary: version ids, control messages between participants, and
the actions a participant answers with (see :mod:`gemini_ckpt.commit`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Union

COORDINATOR = -1
"""Address of the coordinator (the registry actor) in :class:`Send` and the tree."""

DEFAULT_FANOUT = 4
"""Children per node of the commit tree: 1,024 hosts are 5 levels deep."""

HISTORY = 256  # decided versions a participant remembers, to answer late messages


class VersionState(StrEnum):
    """Where a version stands at one store: ``pending`` (its shards or copies not all there),
    ``prepared`` (voted yes: every copy this store owns is acknowledged, no decision yet),
    ``committed``, ``aborted``, or ``unknown`` (forgotten, or never heard of). A ``str``: the
    status index and its JSON carry the plain words."""

    PENDING = "pending"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ABORTED = "aborted"
    UNKNOWN = "unknown"


@dataclass(frozen=True, order=True)
class VersionId:
    """One version of the job: ``step`` within slot-table ``epoch``; newer compares greater.
    An id is used once: saving a step again within an epoch needs a new epoch."""

    epoch: int
    step: int


# --- messages (control plane, small, picklable) ----------------------------------------------
@dataclass(frozen=True)
class ShardStaged:
    """A rank of this host staged its shard of ``version`` into this store (local input).
    ``unhealthy``: why the shard failed its health checks (opaque text; empty: it did not).
    ``checked``: the shard's record carries a verdict (False: health checks off, or a store
    that did not say: a missing verdict is never a healthy one)."""

    version: VersionId
    rank: int
    unhealthy: str = ""
    checked: bool = False


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
    unhealthy: str = ""  # a yes vote: why a shard of the subtree is unhealthy (empty: none is)
    checked: int = 0  # a yes vote: how many of the subtree's shards carry a verdict


@dataclass(frozen=True)
class Decision:
    """The outcome of ``version``, flowing down the tree (and to those who asked). A committed
    version that is ``unhealthy`` (the reason; empty: healthy) is kept by retention only for
    inspection and never counts as one of the ``keep`` newest. ``checked``: every shard's record
    carries a verdict (False: some shard's health is unknown)."""

    version: VersionId
    commit: bool
    reason: str = ""
    unhealthy: str = ""
    checked: bool = False


@dataclass(frozen=True)
class Query:
    """``sender`` voted but lost its path to the coordinator: send it the decision."""

    version: VersionId
    sender: int


Message = Union[ShardStaged, ReplicaAck, Vote, Decision, Query]
MESSAGES = (ShardStaged, ReplicaAck, Vote, Decision, Query)


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
    """Mark ``version`` committed here: readers may trust its bytes (``unhealthy``: but not its
    state, which failed its health checks; empty: healthy if ``checked``, else unchecked)."""

    version: VersionId
    unhealthy: str = ""
    checked: bool = False


@dataclass(frozen=True)
class Aborted:
    """``version`` will never be committed: free what this store holds of it."""

    version: VersionId
    reason: str


@dataclass(frozen=True)
class Release:
    """A committed version fell out of the newest ``keep`` healthy ones (or is an unhealthy one
    not kept for inspection): free it."""

    version: VersionId


Action = Union[Send, Replicate, Committed, Aborted, Release]
