"""The host store's part in a version's commit: the protocol's messages, sending each shard to
its holders (owner side) and taking, verifying and acknowledging peers' copies (holder side).

A mixin of :class:`~gemini_ckpt.ray.actors.host_store.HostStore`, whose ``__init__`` owns the
state; protocol roles and messages in ``docs/commit.md``, bytes in ``docs/dataplane.md``.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

import crc32c
import ray
from ray.exceptions import RayActorError

from ...errors import ShardFormatError
from ...stores.shards import ShardPlan, ShardRecord, check_record
from ..commit import (
    COORDINATOR,
    Aborted,
    Committed,
    Release,
    ReplicaAck,
    Replicate,
    Send,
    VersionId,
)
from ..names import find_registry, find_store
from ..transport import Endpoint, Header, TransportError

log = logging.getLogger("gemini_ckpt")

MAX_META_TRANSFER_BYTES = 64 << 20
"""The most one plan or record transfer may be (a region lands in a budgeted segment; these
land in buffers of their own). A plan is about 200 bytes per tensor, a record less: 64 MiB is
hundreds of thousands of tensors per shard."""
MAX_META_ARRIVING_BYTES = 256 << 20
"""The most the plans and records still arriving at a store may hold together (and never
more than the room left in its budget)."""


class Replication:
    """Commit protocol and replication (see the module docstring)."""

    # --- the commit protocol ---------------------------------------------------------------------
    def commit_message(self, message) -> None:
        """A control message from a peer store or the coordinator (fire-and-forget)."""
        with self._lock:
            if self._commit is None or message.version.epoch != self._epoch:
                return  # an earlier epoch's, or this store holds copies only
            actions = self._commit.on_message(message)
        self._apply(actions)

    def peer_dead(self, slot: int) -> None:
        """The registry saw the host store of ``slot`` die."""
        with self._lock:
            channel = self._channels.pop(slot, None)
            actions = self._commit.on_peer_dead(slot) if self._commit is not None else []
        if channel is not None:
            channel.close()
        self._apply(actions)

    def _apply(self, actions: list) -> None:
        if actions and log.isEnabledFor(logging.DEBUG):
            log.debug("node %s: %s", self.node_id[:12], "; ".join(type(a).__name__ + ("->" + str(a.to) + " "
                      + type(a.message).__name__ if isinstance(a, Send) else "") for a in actions))
        # Retention first: when a rank hears its version committed, the segments the commit
        # released are free for its next save.
        for a in sorted(actions, key=lambda a: not isinstance(a, Release)):
            if isinstance(a, Send) and self._hold(a):
                continue
            if isinstance(a, Send):
                self._send(a.to, a.message)
            elif isinstance(a, Replicate):
                pass  # the copies began when the shards were handed off (see _staged)
            elif isinstance(a, Committed):
                self._decided(a.version, True, "", a.unhealthy)
            elif isinstance(a, Aborted):
                self._decided(a.version, False, a.reason)
            elif isinstance(a, Release):
                with self._lock:
                    v = self._table.versions.get(a.version.step)
                    if v is not None and v.key == (a.version.epoch, a.version.step):
                        self._table.release(v)

    def _decided(self, vid: VersionId, committed: bool, reason: str, unhealthy: str = "") -> None:
        with self._lock:
            v = self._table.versions.get(vid.step)
            if v is not None and v.key == (vid.epoch, vid.step):
                v.mark("decided")
                v.state = "committed" if committed else "aborted"
                v.unhealthy = unhealthy if committed else ""
                if not committed:
                    self._table.release(v, force=True)
            waiters = self._waiters.pop((vid.epoch, vid.step), [])
        for conn, _rank in waiters:
            self._tell(conn, vid.step, committed, reason, unhealthy)
        if not committed:
            log.info("node %s: step %d was not committed: %s", self.node_id[:12], vid.step, reason)

    def _send(self, to: int, message) -> None:
        try:
            target = self._registry_handle() if to == COORDINATOR else self._peer(to)
            if target is None:
                raise LookupError(f"no host store for slot {to}")
            ref = target.commit_message.remote(message)
        except Exception as exc:  # noqa: BLE001 - a peer we cannot reach: the registry decides if it died
            self._suspect(to, f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._refs.append((ref, to))

    def _peer(self, slot: int):
        with self._lock:
            handle = self._peers.get(slot)
            cfg = self._cfg
        if handle is None and cfg is not None:
            handle = find_store(self.namespace, cfg.nodes[slot])
            with self._lock:
                self._peers[slot] = handle
        return handle

    def _registry_handle(self):
        if self._registry is None:
            self._registry = find_registry(self.namespace)
        return self._registry

    def _suspect(self, slot: int, why: str) -> None:
        if slot == COORDINATOR:
            log.error("node %s: cannot reach the registry: %s", self.node_id[:12], why)
            return
        registry = self._registry_handle()
        if registry is not None:
            registry.suspect.remote(slot, f"node {self.node_id[:12]}: {why}")

    # --- replication: owner side -------------------------------------------------------------------
    def _copy(self, vid: VersionId, holder: int, shard, count: int) -> None:
        """Send one shard to ``holder``: its plan once per peer (waited for: the holder checks
        the copy against it), the region at once, the record once it is made. A failure
        vetoes the version."""
        with self._lock:
            self._table.use(shard)
            v = self._table.versions.get(vid.step)
        try:
            channel = self._channel(holder)
            meta = json.dumps({"epoch": vid.epoch, "owner": self._cfg.slot, "rank": shard.rank, "shards": count,
                               "plan_id": shard.plan_id}).encode()
            key = (holder, shard.plan_id, shard.rank)
            if key not in self._plans_sent:
                _, encoded = self._table.plans[(shard.plan_id, shard.rank)]
                channel.send(self._header(vid, f"plan/{shard.rank}", encoded, meta), encoded,
                             timeout=self._cfg.timeout_s)
                self._plans_sent.add(key)
            if v is not None:
                v.mark("replicating")
            region = channel.send_async(self._header(vid, f"region/{shard.rank}", shard.seg.array, meta),
                                        shard.seg.array)
            if not shard.recorded.wait(self._cfg.timeout_s) or shard.record is None:
                region.cancel()
                return  # the record failed: the version is vetoed already
            record = channel.send_async(self._header(vid, f"record/{shard.rank}", shard.record_bytes, meta),
                                        shard.record_bytes)
            region.result(timeout=self._cfg.timeout_s)
            record.result(timeout=self._cfg.timeout_s)
            if v is not None:
                with self._lock:
                    v.mark("sent")
        except Exception as exc:  # noqa: BLE001 - any failed copy vetoes the version
            self._copy_failed(vid, holder, exc)
        finally:
            with self._lock:
                self._table.done_with(shard)

    def _header(self, vid: VersionId, name: str, data, meta: bytes) -> Header:
        n = memoryview(data).nbytes
        return Header(self.namespace, vid.step, name, 0, n, total=n, meta=meta)

    def _channel(self, slot: int):
        with self._lock:
            channel = self._channels.get(slot)
        if channel is not None:
            return channel
        peer = self._peer(slot)
        if peer is None:
            raise LookupError(f"the host store of slot {slot} is gone")
        endpoint = ray.get(peer.endpoint.remote(), timeout=self._cfg.timeout_s)
        channel = self._transport.connect(endpoint)
        with self._lock:
            self._channels[slot] = channel
            self._plans_sent = {k for k in self._plans_sent if k[0] != slot}
        return channel

    def _copy_failed(self, vid: VersionId, holder: int, exc: BaseException) -> None:
        reason = f"the copy to slot {holder} failed: {type(exc).__name__}: {exc}"
        with self._lock:
            channel = self._channels.pop(holder, None)
            actions = self._commit.on_local_failure(vid, reason) if self._commit is not None else []
        if channel is not None:
            channel.close()
        if isinstance(exc, (TransportError, RayActorError, LookupError)):
            self._suspect(holder, reason)
        self._apply(actions)

    # --- replication: holder side ------------------------------------------------------------------
    def _incoming_buffer(self, header: Header) -> memoryview:
        meta = json.loads(header.meta)
        kind, _, rank = header.name.partition("/")
        epoch, owner, rank = int(meta["epoch"]), int(meta["owner"]), int(rank)
        if meta.get("committed"):
            return self._incoming_copy(header, meta, kind, epoch, owner, rank)
        with self._lock:
            if epoch != self._epoch:
                raise PermissionError(f"node {self.node_id[:12]}: a copy from epoch {epoch}, this store is at "
                                      f"{self._epoch}")
            key = (header.step, header.name, meta["owner"])
            if self._commit is not None and self._commit.outcome(VersionId(epoch, header.step)) is False:
                raise ValueError(f"node {self.node_id[:12]}: step {header.step} was already aborted here")
            if kind == "region":
                v = self._table.version(epoch, header.step, world_size=self._cfg.world_size)
                if v is None:
                    raise ValueError(f"step {header.step} was saved again by a newer epoch")
                shard = self._table.receive(v, rank, owner, header.total)
                shard.plan_id = meta["plan_id"]
                early = self._early_records.pop((epoch, header.step, rank), None)
                if early is not None:  # the record's transfer overtook the region's
                    shard.record, shard.record_bytes = early
                self._table.use(shard)
                self._incoming[key] = ("region", shard, meta)
                return memoryview(shard.seg.array)[header.offset : header.offset + header.length]
            buf = self._meta_buffer(header, kind)
            self._incoming[key] = (kind, buf, meta)
            return memoryview(buf)

    def _meta_buffer(self, header: Header, kind: str) -> bytearray:
        """A buffer for a plan or record arriving from a peer (the lock is held): refused past
        :data:`MAX_META_TRANSFER_BYTES`, or when those still arriving would pass
        :data:`MAX_META_ARRIVING_BYTES` or the budget's room."""
        if kind not in ("plan", "record"):
            raise ValueError(f"node {self.node_id[:12]}: unknown transfer {header.name!r}")
        n = header.length
        if header.offset != 0 or (header.total is not None and header.total != n):
            raise ValueError(f"node {self.node_id[:12]}: a {kind} comes in one piece, not {header.describe()}")
        if n > MAX_META_TRANSFER_BYTES:
            raise ValueError(f"node {self.node_id[:12]}: a {kind} of {n:,} bytes is refused (at most "
                             f"{MAX_META_TRANSFER_BYTES:,})")
        arriving = sum(len(x[1]) for x in self._incoming.values() if x[0] != "region")
        arriving += sum(len(b) for b in self._copies_in.values() if isinstance(b, bytearray))
        if arriving + n > MAX_META_ARRIVING_BYTES or not self._table.pool.fits(arriving + n):
            raise MemoryError(f"node {self.node_id[:12]}: a {kind} of {n:,} bytes with {arriving:,} bytes of plans "
                              f"and records still arriving would pass this store's room")
        return bytearray(n)

    def _incoming_done(self, header: Header, ok: bool) -> None:
        meta = json.loads(header.meta)
        if meta.get("committed"):
            self._copy_done(header, meta, ok)
            return
        key = (header.step, header.name, meta["owner"])
        with self._lock:
            kind, target, meta = self._incoming.pop(key, (None, None, None))
        if kind is None:
            return
        vid = VersionId(int(meta["epoch"]), header.step)
        rank, owner = int(meta["rank"]), int(meta["owner"])
        if kind == "region":
            with self._lock:
                target.received = ok
                self._table.done_with(target)
        elif ok and kind == "plan":
            plan = ShardPlan.decode(bytes(target), self._key)
            with self._lock:
                self._table.add_plan(plan, bytes(target))
            return
        elif ok and kind == "record":
            record = ShardRecord.decode(bytes(target), self._key)
            with self._lock:
                v = self._table.versions.get(vid.step)
                shard = v.shards.get(rank) if v is not None and v.key == (vid.epoch, vid.step) else None
                if shard is None or shard.lent:
                    self._early_records[(vid.epoch, vid.step, rank)] = (record, bytes(target))
                    del_old = [k for k in self._early_records if k[0] < self._epoch]
                    for k in del_old:
                        del self._early_records[k]
                    return
                shard.record, shard.record_bytes = record, bytes(target)
        if ok:
            self._maybe_acknowledge(vid, owner, int(meta["shards"]))

    def _maybe_acknowledge(self, vid: VersionId, owner: int, count: int) -> None:
        with self._lock:
            v = self._table.versions.get(vid.step)
            if v is None or v.key != (vid.epoch, vid.step) or owner in v.acked:
                return
            theirs = [s for s in v.shards.values() if s.owner == owner]
            if len(theirs) < count or not all(s.complete for s in theirs):
                return
            v.acked.add(owner)
            v.mark(f"copies of slot {owner} complete")
            for s in theirs:
                self._table.use(s)
        try:
            problem = self._verify_copies(theirs)
        finally:
            with self._lock:
                for s in theirs:
                    self._table.done_with(s)
        if problem:
            log.warning("node %s: %s", self.node_id[:12], problem)
        log.debug("node %s: acknowledging slot %d's copies of %s (ok=%s)", self.node_id[:12], owner, vid,
                  problem is None)
        with self._lock:
            v.mark(f"copies of slot {owner} checked")
        ack = ReplicaAck(vid, self._cfg.slot, ok=problem is None, reason=problem or "")
        with self._lock:
            actions = self._commit.replica_stored(vid, owner, ok=ack.ok, reason=ack.reason) \
                if self._commit is not None else [Send(owner, ack)]
        self._apply(actions)

    def _verify_copies(self, shards: list) -> Optional[str]:
        """Check a peer's copies against their records before acknowledging them."""
        for s in shards:
            try:
                with self._lock:
                    plan = self._table.plan(s.plan_id, s.rank)
                check_record(s.record, plan)
            except (LookupError, ShardFormatError) as exc:
                return f"the copy of rank {s.rank}'s shard cannot be checked: {exc}"
            if s.seg.nbytes < plan.region_bytes:
                return f"the copy of rank {s.rank}'s shard is {s.seg.nbytes} bytes, its plan {plan.region_bytes}"
            array = s.seg.array
            for t, crc in zip(plan.tensors, s.record.crcs):
                if crc32c.crc32c(array[t.at : t.at + t.nbytes]) != crc:
                    return f"the copy of rank {s.rank}'s shard arrived damaged ({t.fqn} fails its checksum)"
        return None


    # --- re-replication: copies of committed versions ----------------------------------------------
    def send_copy(self, step: int, rank: int, target: Endpoint) -> int:
        """Send this store's copy of rank ``rank``'s shard of the committed version of ``step``
        to the store listening at ``target`` (the registry brings versions back to ``replicas``
        copies after a host is lost, and seeds a replacement host). Returns once the target
        checked the copy against its record and holds it; raises ``LookupError`` when this store
        has no such copy, ``ConnectionError`` when the target refused or could not be reached."""
        with self._lock:
            v = self._table.versions.get(step)
            shard = v.shards.get(rank) if v is not None else None
            if shard is None or not shard.complete or v.state != "committed":
                raise LookupError(f"node {self.node_id[:12]} holds no committed copy of rank {rank}'s shard of "
                                  f"step {step}")
            _, plan_bytes = self._table.plans[(shard.plan_id, rank)]
            self._table.use(shard)
            vid = VersionId(v.epoch, step)
            meta = json.dumps({"epoch": v.epoch, "owner": shard.owner, "rank": rank, "plan_id": shard.plan_id,
                               "world_size": v.world_size, "committed": True}).encode()
            timeout = self._cfg.timeout_s if self._cfg is not None else 300.0
        try:
            channel = self._copy_channel(target)
            for name, data in ((f"plan/{rank}", plan_bytes), (f"record/{rank}", shard.record_bytes),
                               (f"region/{rank}", shard.seg.array)):
                channel.send(self._header(vid, name, data, meta), data, timeout=timeout)
        except (TransportError, TimeoutError, OSError) as exc:
            with self._lock:
                channel = self._copy_channels.pop((target.host, target.port), None)
            if channel is not None:
                channel.close()
            raise ConnectionError(f"node {self.node_id[:12]}: the copy of rank {rank}'s shard of step {step} to "
                                  f"{target.host}:{target.port} failed: {type(exc).__name__}: {exc}") from None
        finally:
            with self._lock:
                self._table.done_with(shard)
        return shard.seg.nbytes

    def _copy_channel(self, target: Endpoint):
        key = (target.host, target.port)
        with self._lock:
            channel = self._copy_channels.get(key)
            transport = self._transport
        if channel is None:
            if transport is None:
                raise LookupError(f"the data plane of node {self.node_id[:12]} is not started")
            channel = transport.connect(target)
            with self._lock:
                self._copy_channels[key] = channel
        return channel

    def _incoming_copy(self, header: Header, meta: dict, kind: str, epoch: int, owner: int, rank: int) -> memoryview:
        """Where a re-replicated copy lands: its plan and record first (small, kept aside), then
        its region, straight into a segment, visible only once checked (:meth:`_copy_done`)."""
        key = (epoch, header.step, rank)
        with self._lock:
            if epoch > self._epoch:
                raise PermissionError(f"node {self.node_id[:12]}: a copy of epoch {epoch}, this store is at "
                                      f"{self._epoch}")
            if kind != "region":
                buf = self._meta_buffer(header, kind)
                self._copies_in[(key, kind)] = buf
                return memoryview(buf)
            record = self._copies_in.pop((key, "record"), None)
            if record is None:
                raise ValueError(f"node {self.node_id[:12]}: the region of a copy came before its record")
            v = self._table.version(epoch, header.step, world_size=int(meta["world_size"]))
            if v is None:
                raise ValueError(f"step {header.step} was saved again by a newer epoch")
            shard = self._table.receive(v, rank, owner, header.total)
            shard.plan_id = meta["plan_id"]
            shard.record, shard.record_bytes = record
            self._table.use(shard)
            self._copies_in[(key, "region")] = (v, shard)
            return memoryview(shard.seg.array)[header.offset : header.offset + header.length]

    def _copy_done(self, header: Header, meta: dict, ok: bool) -> None:
        kind, _, rank = header.name.partition("/")
        key = (int(meta["epoch"]), header.step, int(rank))
        with self._lock:
            got = self._copies_in.pop((key, kind), None)
        if got is None:
            return
        if kind == "plan":
            if ok:
                plan = ShardPlan.decode(bytes(got), self._key)
                with self._lock:
                    self._table.add_plan(plan, bytes(got))
            return
        if kind == "record":
            if ok:
                record = ShardRecord.decode(bytes(got), self._key)
                with self._lock:
                    self._copies_in[(key, "record")] = (record, bytes(got))
            return
        v, shard = got
        with self._lock:
            shard.received = ok
            self._table.done_with(shard)
        problem = self._verify_copies([shard]) if ok else "it arrived incomplete"
        with self._lock:
            if problem is None and self._table.versions.get(v.step) is v:
                v.state = "committed"
                v.mark(f"copy of rank {shard.rank} re-replicated")
                return
            shard.received = False
            self._table.drop_shard(v, shard)
        if ok:  # refused: the sender hears it (its transfer is rejected) and the registry tries another
            raise ValueError(f"node {self.node_id[:12]}: the copy of rank {shard.rank}'s shard of step "
                             f"{header.step} was refused: {problem}")


class ReplicaSink:
    """The transport's view of a host store: copies land straight in its segments."""

    def __init__(self, store: "Replication") -> None:
        self.store = store

    def buffer_for(self, header: Header) -> memoryview:
        return self.store._incoming_buffer(header)

    def received(self, header: Header) -> None:
        self.store._incoming_done(header, ok=True)

    def failed(self, header: Header, error: BaseException) -> None:
        self.store._incoming_done(header, ok=False)
        log.info("node %s: a copy of %s failed: %s", self.store.node_id[:12], header.describe(), error)
