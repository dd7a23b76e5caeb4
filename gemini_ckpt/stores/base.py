"""What a tier of versions offers, declared rather than probed.

Two kinds of tier hold versions:

- a **memory tier** (:class:`MemoryTier`: this process's memory, ``store="local"``; or the host
  stores, ``store="ray"``) takes each version's shards as they are staged and decides when a
  version is committed;
- the **durable tier** (:class:`gemini_ckpt.durable.fs.FsStore` under
  :class:`gemini_ckpt.durable.tier.DurableTier`) holds persisted versions as DCP directories.

Both answer the reader's questions the same way (:class:`Tier`): which steps are committed,
and a verified, item-by-item view of one (:mod:`gemini_ckpt.stores.views`). What a memory tier
can do beyond the protocol is in its :class:`Capabilities`, which callers read instead of
probing for methods.

Call order of a memory tier, per version (the Checkpointer is the only writer)::

    plan  = ...                              # the rank's ShardPlan (new structure: again)
    seg   = tier.segment(plan)               # a free segment of plan.region_bytes, mapped here
    ...                                      # the trainer copies the version into seg
    fut   = tier.hand_off(step, plan, seg, blobs, persist=..., verdict=...)  # seg now the tier's
    fut.result()                             # Outcome: committed, or why not; and its health
    tier.unpin(step)                         # a version handed off with persist=True is kept
                                             # until its persist is done (or failed)

Readers: ``committed_steps()``, ``open(step, key=...)``. Retention is the tier's own
(``keep_in_memory``); ``discard(step)`` removes a version an earlier run left behind.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from ..health import Health
from ..format.commstate import Marker
from ..format.segments import Segment
from ..format.shards import ShardPlan


__all__ = ["Capabilities", "MemoryTier", "Outcome", "Tier"]  # the extension points; the rest is internal


@dataclass(frozen=True)
class Capabilities:
    """What a memory tier does beyond the protocol.

    ``persists_itself``: its stores write their own ranks' files to the durable tier
    (:meth:`MemoryTier.persist_files`) instead of handing the bytes to the persister.
    """

    persists_itself: bool = False


@dataclass(frozen=True)
class Outcome:
    """How a version ended in its memory tier: committed, or not and why. ``health``: the
    committed version's verdict (None: none was given. With ``health_check=None`` that is
    ``unchecked``; with health checks on, a missing verdict is never a healthy one: the
    Checkpointer counts the version unhealthy, check ``verdict``)."""

    step: int
    committed: bool
    reason: str = ""
    error: Optional[BaseException] = None
    health: Optional[Health] = None


class Tier(abc.ABC):
    """Anything restore reads versions from."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def committed_steps(self) -> list[int]:
        """Steps whose every shard is readable here, oldest first (``OSError``: unreachable)."""

    @abc.abstractmethod
    def open(self, step: int, *, key: Optional[bytes] = None):
        """A verified view of ``step`` (:class:`gemini_ckpt.stores.views.MemoryVersion` or
        ``DurableVersion``), signatures checked with ``key``; ``VersionNotFoundError`` when it
        is not committed here, a ``VerificationError`` when what describes it is damaged."""

    def close(self) -> None:
        """Release this client's connections (versions stay where they are); idempotent."""

    def survey_steps(self) -> list[int]:
        """:meth:`committed_steps`, on the rank that surveys for a restore of several ranks, right
        before :meth:`survey_state`: a tier may fetch what that needs in the same calls."""
        return self.committed_steps()

    def survey_state(self) -> Any:
        """After :meth:`committed_steps` on the rank that surveys (rank 0): what the other ranks'
        views of this tier need to open versions without asking again (plain data, sent to them
        with the survey; None: nothing). The host stores' tier sends where every copy is and the
        newest version's shard records, so one rank makes the Ray calls instead of every rank."""
        return None

    def use_survey_state(self, state: Any) -> None:
        """On the other ranks: take what :meth:`survey_state` gave on the surveying rank."""


class MemoryTier(Tier):
    """A tier that takes versions shard by shard (see the module docstring for the order)."""

    name = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities()

    @abc.abstractmethod
    def segment(self, plan: ShardPlan) -> Segment:
        """A free segment for one version of ``plan``'s shard, mapped into this process.
        ``MemoryBudgetError`` when the tier cannot hold another one."""

    @abc.abstractmethod
    def give_back(self, segment: Segment) -> None:
        """A segment from :meth:`segment` that will not be handed off (the save failed)."""

    @abc.abstractmethod
    def hand_off(
        self,
        step: int,
        plan: ShardPlan,
        segment: Segment,
        blobs: list[bytes],
        *,
        persist: bool = False,
        verdict: Optional[Health] = None,
    ) -> "Future[Outcome]":
        """The staged shard of ``step`` now belongs to the tier; the future resolves once the
        version is committed or failed. ``persist``: keep it until :meth:`unpin`. ``verdict``:
        the trainer's health verdict (None: checks off); the tier records it with the shard's,
        from the tensor check of ``plan.checked``, and retains an unhealthy version as
        :mod:`gemini_ckpt.retention` says. The outcome carries the version's verdict
        (``Outcome.health``, the records' as :func:`gemini_ckpt.format.shards.make_record` makes
        them): with health checks on, an outcome without one counts as unhealthy (check
        ``verdict``), never as healthy."""

    @abc.abstractmethod
    def unpin(self, step: int) -> None:
        """The persist of ``step`` is over: retention may release it."""

    def listeners(self) -> list:
        """Checkpoint listeners this tier brings along (:mod:`gemini_ckpt.events`; the host stores'
        metrics), added by the Checkpointer when it starts."""
        return []

    def comm_marker(self) -> Optional[Marker]:
        """Where this rank marks its collectives so that replication yields to them
        (:mod:`gemini_ckpt.format.commstate`; docs/interleave.md), or None: this tier moves no
        bytes between hosts behind training's back (the default)."""
        return None

    @abc.abstractmethod
    def discard(self, step: int) -> None:
        """Remove the versions of ``step`` written before this tier was opened (an earlier
        run's, abandoned by this one); a version this run wrote is never touched."""

    @property
    def allocations(self) -> int:
        """Segments created for this process's shards (reused ones are not counted)."""
        return 0

    def footprint(self, sizes: dict[int, int], versions: int) -> dict[str, int]:
        """The memory ``versions`` versions of every rank's shard (``sizes``: rank -> bytes) will
        take, per host (``{host: bytes}``), checked against the tier's budget before the first
        save stages anything: ``MemoryBudgetError`` naming the host, the bytes and the fix when
        it cannot fit. A tier that cannot tell returns ``{}``."""
        return {}

    @property
    def recovery(self) -> tuple[dict, ...]:
        """What the tier did about host losses since the job last started (host stores: when the
        loss was noticed, when Ray declared the node dead, when the copies were made again and a
        replacement seeded; see :meth:`gemini_ckpt.hoststore.actors.registry.Registry.recovery`)."""
        return ()

    def persist_files(self, step: int, uri: str, directory: str, sections: dict[int, bytes], opener=None) -> dict:
        """With ``capabilities.persists_itself``: write each rank's data file of ``step`` under
        ``uri``/``directory`` from the stores' memory, ``sections[rank]`` (the non-tensor items,
        already ``torch.save``-d) first; ``opener``: the URI's backend, when it is not pyarrow's
        own (:mod:`gemini_ckpt.durable.backends`). Returns rank -> list of (offset, length, crc32c)
        of its tensor items."""
        raise NotImplementedError(f"{type(self).__name__} does not persist by itself")
