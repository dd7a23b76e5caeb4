"""Replication: sending each shard to its holders (owner side), taking, verifying and
acknowledging peers' copies (holder side), and copies of committed versions sent again after a
host is lost (re-replication). Bytes in ``docs/dataplane.md``.

One of the host store's collaborators (:mod:`.host_store`); the state they share is :class:`.state.StoreState`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError

from ...format.shards import ShardPlan, ShardRecord
from ...timeouts import TIMEOUTS
from ...commit import ReplicaAck, Send, VersionId, VersionState
from ...dataplane import Endpoint, Header, TransportError
from .sink import verify_copies
from .state import StoreState

log = logging.getLogger("gemini_ckpt")

MAX_META_TRANSFER_BYTES = 64 << 20
"""The most one plan or record transfer may be (a region lands in a budgeted segment; these
land in buffers of their own). A plan is about 200 bytes per tensor, a record less: 64 MiB is
hundreds of thousands of tensors per shard."""
MAX_META_ARRIVING_BYTES = 256 << 20
"""The most the plans and records still arriving at a store may hold together (and never
more than the room left in its budget)."""


class Replicator:
    """Copies of shards between host stores (see the module docstring)."""

    def __init__(self, state: StoreState, driver) -> None:
        self.s, self.driver = state, driver
        # Replication's own, read and written under the store's lock like what it shares:
        self.channels: dict[int, Any] = {}  # slot -> data-plane Channel
        self.plans_sent: set[tuple[int, str, int]] = set()  # (slot, plan id, rank) sent on its channel
        self.replicated_bytes = 0  # sent to peers as copies (the metrics' counter)
        self.incoming: dict[tuple, Any] = {}  # transfer -> what it fills
        self.early_records: dict[tuple, tuple] = {}  # (epoch, step, rank) -> a record whose region is not here yet
        self.copy_channels: dict[tuple, Any] = {}  # (host, port) of a store re-replicated to -> channel
        self.copies_in: dict[tuple, Any] = {}  # ((epoch, step, rank), kind) -> a re-replicated copy arriving

    def new_epoch(self) -> None:
        """A new epoch's slots: the channels by slot (the older ones closed) and the plans sent on
        them start afresh."""
        with self.s.lock:
            old, self.channels, self.plans_sent = self.channels, {}, set()
        for channel in old.values():  # each holds a connection and its threads
            channel.close()

    def drop_channel(self, slot: int) -> None:
        """Forget (and close) the channel to ``slot`` (its store died)."""
        with self.s.lock:
            channel = self.channels.pop(slot, None)
        if channel is not None:
            channel.close()

    # --- replication: owner side -------------------------------------------------------------------
    def copy(self, vid: VersionId, holder: int, shard, count: int) -> None:
        """Send one shard to ``holder``: its plan once per peer (waited for: the holder checks
        the copy against it), the region at once, the record once it is made. A failure
        vetoes the version."""
        with self.s.lock:
            self.s.table.use(shard)
            v = self.s.table.versions.get(vid.step)
        try:
            channel = self.channel(holder)
            meta = json.dumps(
                {
                    "epoch": vid.epoch,
                    "owner": self.s.cfg.slot,
                    "rank": shard.rank,
                    "shards": count,
                    "plan_id": shard.plan_id,
                }
            ).encode()
            key = (holder, shard.plan_id, shard.rank)
            if key not in self.plans_sent:
                _, encoded = self.s.table.plans[(shard.plan_id, shard.rank)]
                channel.send(
                    self.header(vid, f"plan/{shard.rank}", encoded, meta), encoded, timeout=self.s.cfg.timeout_s
                )
                self.plans_sent.add(key)
            if v is not None:
                v.mark("replicating")
            region = channel.send_async(
                self.header(vid, f"region/{shard.rank}", shard.seg.array, meta), shard.seg.array
            )
            if not shard.recorded.wait(self.s.cfg.timeout_s) or shard.record is None:
                region.cancel()
                return  # the record failed: the version is vetoed already
            record = channel.send_async(
                self.header(vid, f"record/{shard.rank}", shard.record_bytes, meta), shard.record_bytes
            )
            region.result(timeout=self.s.cfg.timeout_s)
            record.result(timeout=self.s.cfg.timeout_s)
            with self.s.lock:
                self.replicated_bytes += shard.seg.nbytes
                if v is not None:
                    v.mark("sent")
        except Exception as exc:  # noqa: BLE001 - any failed copy vetoes the version
            self.copy_failed(vid, holder, exc)
        finally:
            with self.s.lock:
                self.s.table.done_with(shard)

    def header(self, vid: VersionId, name: str, data, meta: bytes) -> Header:
        n = memoryview(data).nbytes
        return Header(self.s.namespace, vid.step, name, 0, n, total=n, meta=meta)

    def channel(self, slot: int):
        with self.s.lock:
            channel = self.channels.get(slot)
        if channel is not None:
            return channel
        peer = self.driver.peer(slot)
        if peer is None:
            raise LookupError(f"the host store of slot {slot} is gone")
        endpoint = ray.get(peer.endpoint.remote(), timeout=self.s.cfg.timeout_s)
        channel = self.s.transport.connect(endpoint)
        with self.s.lock:
            self.channels[slot] = channel
            self.plans_sent = {k for k in self.plans_sent if k[0] != slot}
        return channel

    def copy_failed(self, vid: VersionId, holder: int, exc: BaseException) -> None:
        reason = f"the copy to slot {holder} failed: {type(exc).__name__}: {exc}"
        with self.s.lock:
            channel = self.channels.pop(holder, None)
            actions = self.s.commit.on_local_failure(vid, reason) if self.s.commit is not None else []
        if channel is not None:
            channel.close()
        if isinstance(exc, (TransportError, RayActorError, LookupError)):
            self.driver.suspect(holder, reason)
        self.driver.apply(actions)

    # --- replication: holder side ------------------------------------------------------------------
    def incoming_buffer(self, header: Header) -> memoryview:
        meta = json.loads(header.meta)
        kind, _, rank = header.name.partition("/")
        epoch, owner, rank = int(meta["epoch"]), int(meta["owner"]), int(rank)
        if meta.get("committed"):
            return self.incoming_copy(header, meta, kind, epoch, owner, rank)
        with self.s.lock:
            if epoch != self.s.epoch:
                raise PermissionError(
                    f"node {self.s.node_id[:12]}: a copy from epoch {epoch}, this store is at {self.s.epoch}"
                )
            key = (header.step, header.name, meta["owner"])
            if self.s.commit is not None and self.s.commit.outcome(VersionId(epoch, header.step)) is False:
                raise ValueError(f"node {self.s.node_id[:12]}: step {header.step} was already aborted here")
            if kind == "region":
                v = self.s.table.version(epoch, header.step, world_size=self.s.cfg.world_size)
                if v is None:
                    raise ValueError(f"step {header.step} was saved again by a newer epoch")
                shard = self.s.table.receive(v, rank, owner, header.total)
                shard.plan_id = meta["plan_id"]
                early = self.early_records.pop((epoch, header.step, rank), None)
                if early is not None:  # the record's transfer overtook the region's
                    shard.record, shard.record_bytes = early
                self.s.table.use(shard)
                self.incoming[key] = ("region", shard, meta)
                return memoryview(shard.seg.array)[header.offset : header.offset + header.length]
            buf = self.meta_buffer(header, kind)
            self.incoming[key] = (kind, buf, meta)
            return memoryview(buf)

    def meta_buffer(self, header: Header, kind: str) -> bytearray:
        """A buffer for a plan or record arriving from a peer (the lock is held): refused past
        :data:`MAX_META_TRANSFER_BYTES`, or when those still arriving would pass
        :data:`MAX_META_ARRIVING_BYTES` or the budget's room."""
        if kind not in ("plan", "record"):
            raise ValueError(f"node {self.s.node_id[:12]}: unknown transfer {header.name!r}")
        n = header.length
        if header.offset != 0 or (header.total is not None and header.total != n):
            raise ValueError(f"node {self.s.node_id[:12]}: a {kind} comes in one piece, not {header.describe()}")
        if n > MAX_META_TRANSFER_BYTES:
            raise ValueError(
                f"node {self.s.node_id[:12]}: a {kind} of {n:,} bytes is refused (at most {MAX_META_TRANSFER_BYTES:,})"
            )
        arriving = sum(len(x[1]) for x in self.incoming.values() if x[0] != "region")
        arriving += sum(len(b) for b in self.copies_in.values() if isinstance(b, bytearray))
        if arriving + n > MAX_META_ARRIVING_BYTES or not self.s.table.pool.fits(arriving + n):
            raise MemoryError(
                f"node {self.s.node_id[:12]}: a {kind} of {n:,} bytes with {arriving:,} bytes of plans "
                f"and records still arriving would pass this store's room"
            )
        return bytearray(n)

    def incoming_done(self, header: Header, ok: bool) -> None:
        meta = json.loads(header.meta)
        if meta.get("committed"):
            self.copy_done(header, meta, ok)
            return
        key = (header.step, header.name, meta["owner"])
        with self.s.lock:
            kind, target, meta = self.incoming.pop(key, (None, None, None))
        if kind is None:
            return
        vid = VersionId(int(meta["epoch"]), header.step)
        rank, owner = int(meta["rank"]), int(meta["owner"])
        if kind == "region":
            with self.s.lock:
                target.received = ok
                self.s.table.done_with(target)
        elif ok and kind == "plan":
            plan = ShardPlan.decode(bytes(target), self.s.key)
            with self.s.lock:
                self.s.table.add_plan(plan, bytes(target), prune=False)
            return
        elif ok and kind == "record":
            record = ShardRecord.decode(bytes(target), self.s.key)
            with self.s.lock:
                v = self.s.table.versions.get(vid.step)
                shard = v.shards.get(rank) if v is not None and v.key == (vid.epoch, vid.step) else None
                if shard is None or shard.lent:
                    self.early_records[(vid.epoch, vid.step, rank)] = (record, bytes(target))
                    del_old = [k for k in self.early_records if k[0] < self.s.epoch]
                    for k in del_old:
                        del self.early_records[k]
                    return
                shard.record, shard.record_bytes = record, bytes(target)
        if ok:
            self.maybe_acknowledge(vid, owner, int(meta["shards"]))

    def maybe_acknowledge(self, vid: VersionId, owner: int, count: int) -> None:
        with self.s.lock:
            v = self.s.table.versions.get(vid.step)
            if v is None or v.key != (vid.epoch, vid.step) or owner in v.acked:
                return
            theirs = [s for s in v.shards.values() if s.owner == owner]
            if len(theirs) < count or not all(s.complete for s in theirs):
                return
            v.acked.add(owner)
            v.mark(f"copies of slot {owner} complete")
            for s in theirs:
                self.s.table.use(s)
        try:
            problem = verify_copies(self.s, theirs)
        finally:
            with self.s.lock:
                for s in theirs:
                    self.s.table.done_with(s)
        if problem:
            log.warning("node %s: %s", self.s.node_id[:12], problem)
        log.debug(
            "node %s: acknowledging slot %d's copies of %s (ok=%s)", self.s.node_id[:12], owner, vid, problem is None
        )
        with self.s.lock:
            v.mark(f"copies of slot {owner} checked")
        ack = ReplicaAck(vid, self.s.cfg.slot, ok=problem is None, reason=problem or "")
        with self.s.lock:
            actions = (
                self.s.commit.replica_stored(vid, owner, ok=ack.ok, reason=ack.reason)
                if self.s.commit is not None
                else [Send(owner, ack)]
            )
        self.driver.apply(actions)

    # --- re-replication: copies of committed versions ----------------------------------------------
    def send_copy(self, step: int, rank: int, target: Endpoint) -> int:
        """Send this store's copy of rank ``rank``'s shard of the committed version of ``step``
        to the store listening at ``target`` (the registry brings versions back to ``replicas``
        copies after a host is lost, and seeds a replacement host). Returns once the target
        checked the copy against its record and holds it; raises ``LookupError`` when this store
        has no such copy, ``ConnectionError`` when the target refused or could not be reached."""
        with self.s.lock:
            v = self.s.table.versions.get(step)
            shard = v.shards.get(rank) if v is not None else None
            if shard is None or not shard.complete or v.state != VersionState.COMMITTED:
                raise LookupError(
                    f"node {self.s.node_id[:12]} holds no committed copy of rank {rank}'s shard of step {step}"
                )
            _, plan_bytes = self.s.table.plans[(shard.plan_id, rank)]
            self.s.table.use(shard)
            vid = VersionId(v.epoch, step)
            meta = json.dumps(
                {
                    "epoch": v.epoch,
                    "owner": shard.owner,
                    "rank": rank,
                    "plan_id": shard.plan_id,
                    "world_size": v.world_size,
                    "committed": True,
                }
            ).encode()
            timeout = self.s.cfg.timeout_s if self.s.cfg is not None else TIMEOUTS.version_s
        try:
            channel = self.copy_channel(target)
            for name, data in (
                (f"plan/{rank}", plan_bytes),
                (f"record/{rank}", shard.record_bytes),
                (f"region/{rank}", shard.seg.array),
            ):
                channel.send(self.header(vid, name, data, meta), data, timeout=timeout)
        except (TransportError, TimeoutError, OSError) as exc:
            with self.s.lock:
                channel = self.copy_channels.pop((target.host, target.port), None)
            if channel is not None:
                channel.close()
            raise ConnectionError(
                f"node {self.s.node_id[:12]}: the copy of rank {rank}'s shard of step {step} to "
                f"{target.host}:{target.port} failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            with self.s.lock:
                self.s.table.done_with(shard)
        return shard.seg.nbytes

    def copy_channel(self, target: Endpoint):
        key = (target.host, target.port)
        with self.s.lock:
            channel = self.copy_channels.get(key)
            transport = self.s.transport
        if channel is None:
            if transport is None:
                raise LookupError(f"the data plane of node {self.s.node_id[:12]} is not started")
            channel = transport.connect(target, marked=False)  # recovery: never yields to other traffic
            with self.s.lock:
                self.copy_channels[key] = channel
        return channel

    def incoming_copy(self, header: Header, meta: dict, kind: str, epoch: int, owner: int, rank: int) -> memoryview:
        """Where a re-replicated copy lands: its plan and record first (small, kept aside), then
        its region, straight into a segment, visible only once checked (:meth:`_copy_done`)."""
        key = (epoch, header.step, rank)
        with self.s.lock:
            if epoch > self.s.epoch:
                raise PermissionError(
                    f"node {self.s.node_id[:12]}: a copy of epoch {epoch}, this store is at {self.s.epoch}"
                )
            if kind != "region":
                buf = self.meta_buffer(header, kind)
                self.copies_in[(key, kind)] = buf
                return memoryview(buf)
            record = self.copies_in.pop((key, "record"), None)
            if record is None:
                raise ValueError(f"node {self.s.node_id[:12]}: the region of a copy came before its record")
            v = self.s.table.version(epoch, header.step, world_size=int(meta["world_size"]))
            if v is None:
                raise ValueError(f"step {header.step} was saved again by a newer epoch")
            shard = self.s.table.receive(v, rank, owner, header.total)
            shard.plan_id = meta["plan_id"]
            shard.record, shard.record_bytes = record
            self.s.table.use(shard)
            self.copies_in[(key, "region")] = (v, shard)
            return memoryview(shard.seg.array)[header.offset : header.offset + header.length]

    def copy_done(self, header: Header, meta: dict, ok: bool) -> None:
        kind, _, rank = header.name.partition("/")
        key = (int(meta["epoch"]), header.step, int(rank))
        with self.s.lock:
            got = self.copies_in.pop((key, kind), None)
        if got is None:
            return
        if kind == "plan":
            if ok:
                plan = ShardPlan.decode(bytes(got), self.s.key)
                with self.s.lock:
                    self.s.table.add_plan(plan, bytes(got), prune=False)
            return
        if kind == "record":
            if ok:
                record = ShardRecord.decode(bytes(got), self.s.key)
                with self.s.lock:
                    self.copies_in[(key, "record")] = (record, bytes(got))
            return
        v, shard = got
        with self.s.lock:
            shard.received = ok
            self.s.table.done_with(shard)
        problem = verify_copies(self.s, [shard]) if ok else "it arrived incomplete"
        with self.s.lock:
            if problem is None and self.s.table.versions.get(v.step) is v:
                v.state = VersionState.COMMITTED
                v.mark(f"copy of rank {shard.rank} re-replicated")
                return
            shard.received = False
            self.s.table.drop_shard(v, shard)
        if ok:  # refused: the sender hears it (its transfer is rejected) and the registry tries another
            raise ValueError(
                f"node {self.s.node_id[:12]}: the copy of rank {shard.rank}'s shard of step "
                f"{header.step} was refused: {problem}"
            )
