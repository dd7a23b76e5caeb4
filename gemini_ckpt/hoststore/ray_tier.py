"""``store="ray"``: one rank's view of its namespace's host stores (a memory tier).

Per version (the :class:`~gemini_ckpt.stores.base.MemoryTier` call order), everything goes
through the attach channel to this node's store (:mod:`gemini_ckpt.hoststore.attach`): the plan once,
a lent segment (mapped here once), then one ``staged`` message with the value blobs; the
outcome comes back on the same channel. The training process sends no bytes to peers and
makes no Ray call per version.

Reading (restore, persist): every live store's ``index`` says which steps are committed and
where each shard's copies are (:mod:`gemini_ckpt.hoststore.resolve`); a shard held on this node is
mapped (no transfer), one held only by peers is pushed by a peer over the data plane into a
buffer here, 16 MiB blocks at a time, a few ahead of the reader (:mod:`.readahead`).

:class:`RayTier` is a facade: it does the writes itself and hands the rest to its collaborators,
the host stores and their liveness (:class:`~gemini_ckpt.hoststore.hosts.HostStores`), the read side
(:class:`~gemini_ckpt.hoststore.reads.TierReads`) and persist with failover
(:func:`~gemini_ckpt.hoststore.persist.persist_files`).

A rank gets its tier from :func:`gemini_ckpt.hoststore.client.connect`, the rendezvous.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Optional


from ..config import Interleave
from ..errors import (
    AttachError,
    MemoryBudgetError,
    ReplicationError,
    VersionNotFoundError,
)
from ..health import HEALTHY_VERDICT, Health
from ..settings import StoreSettings
from ..stores.views import MemoryVersion
from ..stores.base import Capabilities, MemoryTier, Outcome
from ..format.commstate import CommState, Marker
from ..format.kept import KEPT
from ..format.segments import Segment
from ..format.shards import ShardPlan
from .attach import close_all
from .attach_client import AttachClient
from .attach_messages import AskComm, AskSegment, CommPage, GiveBack, SegmentLent, SendPlan, Staged, VersionOutcome
from .hosts import HostStores
from .persist import persist_files
from .reads import TierReads
from .slots import SlotTable, holders_for

log = logging.getLogger("gemini_ckpt")


class RayTier(MemoryTier):
    """One rank's view of the host stores of its namespace (see the module docstring)."""

    capabilities = Capabilities(persists_itself=True)

    def __init__(
        self,
        settings: StoreSettings,
        *,
        rank: int,
        world_size: int,
        node_id: str,
        table: SlotTable,
        registry,
        secret: bytes,
        attach: AttachClient,
        dead: set[int],
    ) -> None:
        self.settings, self.rank, self.world_size, self.node_id = settings, rank, world_size, node_id
        self.table, self.epoch, self.slot = table, table.epoch, table.slot_of(node_id)
        self._secret, self._attach = secret, attach
        self._lock = threading.Lock()
        self.hosts = HostStores(settings, rank=rank, table=table, registry=registry, dead=dead)
        self.reads = TierReads(
            settings, rank=rank, slot=self.slot, node_id=node_id, secret=secret, attach=attach, hosts=self.hosts
        )
        self.peer_reads = self.reads.peer_reads
        self._segments: dict[int, Segment] = {}
        self._plans: set[str] = set()
        self._ahead: dict[str, concurrent.futures.Future] = {}  # plan id -> a segment asked for ahead
        self.recovery_events: tuple[dict, ...] = ()  # the registry's, at the rendezvous
        self._comm: Optional[CommState] = None
        self._marker: Optional[Marker] = None
        self._no_marker = False  # asking for the comm state failed: never again

    def footprint(self, sizes: dict[int, int], versions: int) -> dict[str, int]:
        """Per host: ``versions`` versions of the shards it will hold (its own ranks' and the
        copies placement sends it, :func:`~gemini_ckpt.hoststore.slots.holders_for`), checked against
        its store's budget and told to the store (``gemini_ckpt status`` shows it)."""
        dead = self.hosts.dead()
        retired = self.hosts.dead_at_rendezvous()
        shards: dict[int, int] = {}
        for rank, node in self.table.ranks.items():
            slot = self.table.slot_of(node)
            shards[slot] = shards.get(slot, 0) + int(sizes.get(int(rank), 0))
        need = {s: 0 for s in range(self.table.hosts) if s not in dead}
        for slot, nbytes in shards.items():
            for holder in holders_for(
                slot,
                hosts=self.table.hosts,
                replicas=self.settings.replicas,
                strategy=self.settings.placement,
                dead=dead,
                domains=self.table.domains,
                retired=retired,
            ):
                if holder in need:
                    need[holder] += versions * nbytes
        budgets = self.hosts.gather("budget")
        over = [
            f"{self.hosts.describe(s)}: {need[s]:,} bytes, budget {budgets[s]:,}"
            for s in sorted(need)
            if s in budgets and need[s] > budgets[s]
        ]
        if over:
            raise MemoryBudgetError(
                f"rank {self.rank}: {versions} versions (keep_in_memory + max_inflight) of the shards each host "
                "will hold do not fit its host store's budget: " + "; ".join(over) + ". Raise "
                "CheckpointConfig.host_memory_budget_bytes, lower keep_in_memory, max_inflight or replicas, "
                "or spread the job over more hosts"
            )
        if self.rank == 0:
            for slot, handle in self.hosts.live().items():
                handle.expect.remote(need.get(slot, 0))  # for status; nothing waits on it
        return {f"slot {s}": n for s, n in sorted(need.items())}

    # --- write: this node's store does the work ----------------------------------------------
    def segment(self, plan: ShardPlan) -> Segment:
        try:
            if plan.plan_id not in self._plans:
                self._attach.request(SendPlan().to_wire(), plan.encode())
                self._plans.add(plan.plan_id)
            with self._lock:
                ahead = self._ahead.pop(plan.plan_id, None)
            if ahead is not None:
                reply, fds = self._attach.reply(ahead)
            else:
                reply, fds = self._attach.request(AskSegment(plan.plan_id).to_wire())
        except MemoryError as exc:
            raise MemoryBudgetError(f"rank {self.rank}: {exc}") from None
        except (AttachError, OSError) as exc:
            raise ReplicationError(f"rank {self.rank}: the host store of this node is unreachable: {exc}") from None
        try:
            lent = SegmentLent.from_wire(reply)
        except ValueError as exc:
            close_all(fds)
            raise ReplicationError(f"rank {self.rank}: the host store's answer is malformed: {exc}") from None
        for seg_id in lent.forget:
            old = self._segments.pop(seg_id, None)
            if old is not None:
                KEPT.drop(old)
        seg = self._segments.get(lent.seg)
        if seg is None:
            if not fds:
                raise ReplicationError(f"rank {self.rank}: the host store lent segment {lent.seg} without its memory")
            close_all(fds[1:])
            seg = self._segments[lent.seg] = KEPT.map(fds[0], lent.nbytes, lent.seg)
        return seg

    def give_back(self, segment: Segment) -> None:
        try:
            self._attach.send(GiveBack(segment.id).to_wire())
        except (AttachError, OSError):
            pass

    def hand_off(
        self,
        step: int,
        plan: ShardPlan,
        segment: Segment,
        blobs: list[bytes],
        *,
        persist: bool = False,
        verdict: Optional[Health] = None,
    ) -> "concurrent.futures.Future[Outcome]":
        outcome = self._attach.outcome(step)
        staged = Staged(
            step,
            plan.plan_id,
            segment.id,
            persist=bool(persist),
            lengths=tuple(len(b) for b in blobs),
            verdict=None if verdict is None else verdict.to_json(),
        )
        self._attach.send(staged.to_wire(), b"".join(blobs))
        done: concurrent.futures.Future = concurrent.futures.Future()

        def finish(fut) -> None:
            self._attach.forget_outcome(step)
            exc = fut.exception()
            if exc is not None:
                done.set_result(Outcome(step, False, str(exc), ReplicationError(f"rank {self.rank}: {exc}")))
                return
            try:
                reply = VersionOutcome.from_wire(fut.result())
            except ValueError as exc:
                done.set_result(
                    Outcome(
                        step,
                        False,
                        f"the host store's outcome is malformed: {exc}",
                        ReplicationError(f"rank {self.rank}: the host store's outcome is malformed: {exc}"),
                    )
                )
                return
            if reply.committed:
                # The segment for the next save, asked for now (the version just released one):
                # save() then takes it without a round trip.
                with self._lock:
                    if plan.plan_id not in self._ahead:
                        try:
                            self._ahead[plan.plan_id] = self._attach.request_async(AskSegment(plan.plan_id).to_wire())
                        except AttachError:
                            pass
            try:  # no verdict unless the stores say every shard has one: a missing verdict is never healthy
                health = (
                    Health.from_text(reply.unhealthy)
                    if reply.unhealthy
                    else (HEALTHY_VERDICT if reply.checked else None)
                )
            except ValueError as exc:  # our own store's words: a version mismatch, not an attack
                health = Health("unhealthy", "finite", "", f"the host store says so, unreadably ({exc})")
            done.set_result(Outcome(step, reply.committed, reply.reason, health=health))

        outcome.add_done_callback(finish)
        return done

    @property
    def allocations(self) -> int:
        return len(self._segments)

    @property
    def recovery(self) -> tuple[dict, ...]:
        return self.recovery_events

    @property
    def secret(self) -> bytes:
        """The namespace's data-plane and attach secret this rank was handed: what makes a peer one of the job's."""
        return self._secret

    # --- read: the read side does it ------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        return self.reads.committed_steps()

    def survey_steps(self) -> list[int]:
        return self.reads.committed_steps(prefetch=True)

    def survey_state(self) -> dict:
        return self.reads.survey_state()

    def use_survey_state(self, state: dict) -> None:
        self.reads.use_survey_state(state)

    def open(self, step: int, *, key: Optional[bytes] = None) -> MemoryVersion:
        return self.reads.open(step, key=key)

    # --- persist, retention, discards ------------------------------------------------------------
    def persist_files(self, step: int, uri: str, directory: str, sections: dict[int, bytes], opener=None) -> dict:
        """Have the host stores write ``step``'s data files from their memory, in parallel: each
        rank's file by a store holding an intact copy, the owner's host first (so each host
        writes its own ranks' shards)."""
        where = self.reads.where(step)
        if where is None:
            self.committed_steps()
            where = self.reads.where(step)
        if where is None or not where.committed:
            raise VersionNotFoundError(f"step {step} is not committed on the live host stores")
        return persist_files(self.hosts, step, where, uri, directory, sections, opener)

    def unpin(self, step: int) -> None:
        self.hosts.gather("unpin", step)

    def discard(self, step: int) -> None:
        self.hosts.gather("discard", step, self.epoch)

    def holder(self, step: int, rank: int, *, slot: Optional[int] = None):
        """The actor handle of a host store holding a copy of rank ``rank``'s shard of ``step``:
        the store of ``slot``, else this node's, else the first holder."""
        self.committed_steps()
        where = self.reads.where(step)
        if where is None:
            raise KeyError(step)
        slot = slot if slot is not None else where.copies[rank][0]
        return self.hosts.live()[slot]

    def listeners(self) -> list:
        """This rank's metrics (``CheckpointConfig.metrics``; :mod:`gemini_ckpt.hoststore.metrics`)."""
        if not self.settings.metrics:
            return []
        from .metrics import trainer_metrics

        found = trainer_metrics(self.settings.namespace, self.rank)
        return [found] if found is not None else []

    def comm_marker(self) -> Optional[Marker]:
        """This rank's slot in its host store's comm state (asked for once; None unless
        ``interleave`` is ``True``/``"gate"``): marks in it hold the store's sends back
        (docs/interleave.md)."""
        if self.settings.interleave != Interleave.GATE:
            return None
        with self._lock:
            if self._marker is None and not self._no_marker:
                try:
                    reply, fds = self._attach.request(AskComm().to_wire())
                    for fd in fds[1:]:
                        os.close(fd)
                    if not fds:
                        raise AttachError("the host store sent no comm-state segment")
                    page = CommPage.from_wire(reply)
                    self._comm = CommState.open(fds[0], page.nbytes)
                    self._marker = self._comm.marker(page.slot)
                except (AttachError, LookupError, ValueError, OSError) as exc:
                    # an optimization, never a reason to stop training: say so once, mark nothing
                    self._no_marker = True
                    log.warning(
                        "rank %d: replication will not yield to training's collectives (no comm state "
                        "from the host store: %s: %s)",
                        self.rank,
                        type(exc).__name__,
                        exc,
                    )
            return self._marker

    def close(self) -> None:
        """Close this client's channels (the host stores keep every version)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            comm, self._comm = self._comm, None
        self.reads.close()
        self._attach.close()
        for seg in segments:
            KEPT.keep(seg)  # the next Checkpointer in this process (a survivor's) maps them again for free
        if comm is not None:
            comm.close()
