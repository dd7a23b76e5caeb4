"""The host store's side of the attach channel: this node's ranks (see :mod:`.host_store`).

A rank attaches (its segments' memfds come over the socket), says a shard is staged, and hears
each version's outcome; a rank that detaches or dies fails the versions waiting for it.
One of the host store's collaborators (:mod:`.host_store`); the state they share is :class:`.state.StoreState`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any


from ...health import Health
from ...format.shards import ShardPlan, make_record
from ..attach import Connection
from ..attach_messages import (
    AskComm,
    AskSegment,
    CommPage,
    Done,
    GiveBack,
    MapShard,
    VersionOutcome,
    SegmentLent,
    SendPlan,
    ShardMapped,
    Staged,
    Unmap,
    request_from_wire,
)
from ...commit import (
    ShardStaged,
    VersionId,
)
from ..slots import holders_for
from .state import StoreState

log = logging.getLogger("gemini_ckpt")


class RankPort:
    """This node's ranks on the attach channel (see the module docstring): ``on_attach`` and
    ``on_detach`` are the channel's handlers."""

    def __init__(self, state: StoreState, driver, replicator) -> None:
        self.s, self.driver, self.replicator = state, driver, replicator
        # The port's own, under the store's lock:
        self.sent_fds: dict[Any, set[int]] = {}  # Connection -> segments whose memfd a trainer has
        self.maps: dict[Any, list] = {}  # Connection -> shards a local reader mapped
        self._handlers = {
            SendPlan: self._plan,
            AskSegment: self._segment,
            GiveBack: self._give_back,
            Staged: self.staged,
            AskComm: self._comm,
            MapShard: self._map,
            Unmap: self._unmap,
        }

    def on_attach(self, conn: Connection, rank: int, header: dict, payload: bytes, fds: list):
        """Answer one message of a rank: ``(reply header, payload, fds)``, or None for none."""
        for fd in fds:
            os.close(fd)
        message = request_from_wire(header)
        return self._handlers[type(message)](conn, rank, message, payload)

    def _plan(self, conn: Connection, rank: int, message: SendPlan, payload: bytes):
        plan = ShardPlan.decode(payload)
        with self.s.lock:
            self.s.table.add_plan(plan, payload)
        return _reply(Done())

    def _segment(self, conn: Connection, rank: int, message: AskSegment, payload: bytes):
        with self.s.lock:
            plan = self.s.table.plan(message.plan_id, rank)
            lent = self.s.table.lend(rank, plan.region_bytes)
            sent = self.sent_fds.setdefault(conn, set())
            fds_out = () if lent.seg.id in sent else (lent.seg.fd,)
            sent.add(lent.seg.id)
            forget = self.s.table.forgotten.pop(rank, [])
        return _reply(SegmentLent(lent.seg.id, lent.seg.nbytes, tuple(forget)), fds_out)

    def _give_back(self, conn: Connection, rank: int, message: GiveBack, payload: bytes):
        with self.s.lock:
            self.s.table.give_back(message.seg)
        return None

    def _comm(self, conn: Connection, rank: int, message: AskComm, payload: bytes):
        """The page this rank marks its collectives in (docs/interleave.md)."""
        with self.s.lock:
            comm = self.s.comm
        if comm is None:
            raise LookupError("this host store has no comm state yet (its data plane is not started)")
        return _reply(CommPage(comm.slot_for(rank), comm.nbytes), (comm.fd,))

    def _map(self, conn: Connection, rank: int, message: MapShard, payload: bytes):
        with self.s.lock:
            shard = self.s.complete_shard(message.step, message.rank)
            self.s.table.use(shard)
            self.maps.setdefault(conn, []).append(shard)
        # the reader checks every item it copies out of it against the record
        return _reply(ShardMapped(shard.seg.id, shard.seg.nbytes), (shard.seg.fd,))

    def _unmap(self, conn: Connection, rank: int, message: Unmap, payload: bytes):
        with self.s.lock:
            mapped = self.maps.get(conn, [])
            shard = next((s for s in mapped if s.seg.id == message.seg), None)
            if shard is not None:
                mapped.remove(shard)
                self.s.table.done_with(shard)
        return _reply(Done())

    def on_detach(self, conn: Connection, rank: int) -> None:
        actions = []
        with self.s.lock:
            for shard in self.maps.pop(conn, []):
                self.s.table.done_with(shard)
            self.sent_fds.pop(conn, None)
            if self.s.comm is not None:  # it may have died inside a collective: never wait for it
                self.s.comm.clear(rank)
            if self.s.commit is None or self.s.cfg is None:
                return
            for vid in self.s.commit.pending():
                v = self.s.table.versions.get(vid.step)
                if vid.epoch == self.s.epoch and (v is None or rank not in v.shards):
                    actions += self.s.commit.on_local_failure(
                        vid, f"rank {rank}'s training process ended before it staged its shard"
                    )
        self.driver.apply(actions)

    def staged(self, conn: Connection, rank: int, message: Staged, payload: bytes) -> None:
        """A rank handed off its shard of a step: copies to the other holders start at once,
        while this thread checksums the shard into its record and checks its health in the same
        pass (the trainer's ``verdict`` on metrics and validator comes with the hand-off); the
        rank's part of the version is done (``ShardStaged``, with the verdict) once the record is
        made."""
        step, seg_id = message.step, message.seg
        received = time.time()
        blobs, at = [], 0
        for n in message.lengths:
            blobs.append(payload[at : at + n])
            at += n
        with self.s.lock:
            epoch, cfg = self.s.epoch, self.s.cfg
            self.s.waiters.setdefault((epoch, step), []).append((conn, rank))
            vid = VersionId(epoch, step)
            try:
                plan = self.s.table.plan(message.plan_id, rank)
                v = self.s.table.version(epoch, step, world_size=cfg.world_size)
                if v is None:
                    raise ValueError(f"step {step} was saved again by a newer epoch")
                v.marks.setdefault("staged", received)
                v.persist |= message.persist
                shard = self.s.table.stage(v, rank, seg_id, plan, owner=cfg.slot)
                self.s.table.use(shard)
                holders: tuple = ()
                if self.s.commit is not None:
                    holders = holders_for(
                        cfg.slot,
                        hosts=cfg.hosts,
                        replicas=cfg.replicas,
                        strategy=cfg.strategy,
                        dead=self.s.commit.dead,
                        domains=cfg.domains,
                        retired=cfg.dead,
                    )
                    actions = self.s.commit.start_version(vid, holders=holders, shards=len(cfg.ranks_here))
                else:
                    actions = []
            except Exception as exc:  # noqa: BLE001 - e.g. too few live hosts for the replicas asked
                reason = f"{type(exc).__name__}: {exc}"
                tell(conn, step, False, reason)
                self.driver.apply(self.s.commit.on_local_failure(vid, reason) if self.s.commit is not None else [])
                return
        self.driver.apply(actions)
        for holder in holders[1:]:  # the protocol allows copies to start before it says Replicate
            self.s.pool.submit(self.replicator.copy, vid, holder, shard, len(cfg.ranks_here))
        try:
            verdict = Health.from_json(message.verdict) if message.verdict is not None else None
            # With copies to make, the tensor check is fused with the CRC32C (the region read once,
            # the least CPU): the copies take longer than both. Without (replicas=1), the record is
            # the version's time-to-safe: the check runs beside the CRC32C, on a pool thread.
            beside = self.s.pool if plan.checked and not holders[1:] else None
            record = make_record(plan, shard.seg.array, blobs, epoch=epoch, step=step, verdict=verdict, beside=beside)
            record_bytes = record.encode(self.s.key)
        except Exception as exc:  # noqa: BLE001 - the version cannot be committed without its record
            shard.recorded.set()
            with self.s.lock:
                self.s.table.done_with(shard)
                actions = (
                    self.s.commit.on_local_failure(vid, f"rank {rank}'s record: {exc}")
                    if self.s.commit is not None
                    else []
                )
            tell(conn, step, False, f"{type(exc).__name__}: {exc}")
            self.driver.apply(actions)
            return
        with self.s.lock:
            shard.record, shard.record_bytes = record, record_bytes
            shard.recorded.set()
            v.mark("recorded")
            self.s.table.done_with(shard)
            if epoch != self.s.epoch:
                tell(conn, step, False, f"a newer Checkpointer (epoch {self.s.epoch}) took over this namespace")
                return
            bad = record.health is not None and record.health.unhealthy
            if bad:  # the trainer says it loudly, once; here it is one line per shard
                log.info("node %s: step %d is unhealthy: %s", self.s.node_id[:12], step, record.health.reason)
            staged = ShardStaged(vid, rank, record.health.to_text() if bad else "", checked=record.health is not None)
            actions = self.s.commit.on_message(staged) if self.s.commit is not None else []
        self.driver.apply(actions)


def tell(
    conn: Connection, step: int, committed: bool, reason: str = "", unhealthy: str = "", checked: bool = False
) -> None:
    """A rank's outcome: ``unhealthy`` (why; empty: not), and ``checked``, every shard of the
    version carries a verdict (the trainer counts a version without as unchecked, never healthy)."""
    try:
        conn.send({**VersionOutcome(step, committed, reason, unhealthy, checked).to_wire(), "id": 0})
    except OSError:
        pass  # the rank is gone; its version's fate is in the store either way


def _reply(message, fds: tuple = ()) -> tuple:
    return message.to_wire(), b"", fds
