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
package but :mod:`gemini_ckpt.retention` (stdlib only too), whose rule decides what is released,
and :mod:`gemini_ckpt.errors` (:class:`~gemini_ckpt.errors.CommitProtocolError`).

Health (:mod:`gemini_ckpt.health`) rides along as opaque text: a store says a shard is unhealthy
in :class:`ShardStaged`, yes votes carry the first such reason up, and the decision carries it
down, so every participant releases the same versions: an unhealthy version commits but never
counts as one of the ``keep`` newest. :class:`gemini_ckpt.testing.commit_sim.Simulator` runs a whole cluster of them in-process
(tests, benchmarks).

Example (two hosts, two copies, one rank each)::

    sim = Simulator(hosts=2, replicas=2, holders=lambda slot, dead: (slot, 1 - slot))
    report = sim.run_version(step=0)
    assert report.outcome is True and sim.coordinator.newest_committed() == VersionId(0, 0)
"""

from __future__ import annotations

from .coordinator import Coordinator
from .host import HostCommit
from .messages import (
    COORDINATOR,
    DEFAULT_FANOUT,
    Aborted,
    Action,
    Committed,
    Decision,
    Message,
    Query,
    Release,
    ReplicaAck,
    Replicate,
    Send,
    ShardStaged,
    VersionId,
    VersionState,
    Vote,
)

__all__ = [
    "COORDINATOR",
    "DEFAULT_FANOUT",
    "Aborted",
    "Action",
    "Committed",
    "Coordinator",
    "Decision",
    "HostCommit",
    "Message",
    "Query",
    "Release",
    "Replicate",
    "ReplicaAck",
    "Send",
    "ShardStaged",
    "VersionId",
    "VersionState",
    "Vote",
]
