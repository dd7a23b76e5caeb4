"""The host store: one Ray actor per node, keeping its own ranks' shards and its peers' copies.

Its part of a version (see ``docs/dataplane.md``; roles and messages in ``docs/commit.md``):

1. **Take the shards of this host's ranks.** A rank stages into a segment the store lent it
   and says so over the attach channel (:mod:`gemini_ckpt.ray.attach`); the store computes
   the shard's record (a CRC32C of every item), and the version begins here
   (:meth:`~gemini_ckpt.ray.commit.HostCommit.start_version`, one ``ShardStaged`` per rank).
2. **Replicate.** Once all of its ranks' shards are staged, the commit protocol says
   ``Replicate``: the store sends each shard (plan once per peer, region, record) to the other
   holders over the data plane (:mod:`gemini_ckpt.ray.transport`), straight into their
   segments. A holder verifies every item's CRC32C against the record and acknowledges to the
   owner (``ReplicaAck``, a Ray call); a refused or broken transfer vetoes the version.
3. **Commit among the stores.** Votes go up a tree of stores to the registry's coordinator, the
   decision comes back down (fire-and-forget Ray calls, :meth:`commit_message`); the store
   tells its ranks the outcome over the attach channel, and releases what retention lets go.
4. **Serve.** Readers map a shard of this node (attach ``map``) or have it pushed to them
   (:meth:`push_range`); the persister has it written as a DCP data file (:meth:`persist_shard`).

A training process that dies after staging takes nothing with it: its shard is here. One that
dies before staging closes its attach socket, and the versions waiting for it fail at once.

Actors raise built-in exceptions (``MemoryError`` over budget, ``LookupError`` no such version,
``PermissionError`` fenced, ``ValueError`` refused), which the client maps onto the library's.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import crc32c
import ray
from ray.exceptions import RayActorError

from ...save.framing import write_tensors
from ...stores.shards import ShardFormatError, ShardPlan, ShardRecord, check_record, make_record
from ..attach import AttachServer, Connection
from ..commit import (
    COORDINATOR,
    Aborted,
    Committed,
    HostCommit,
    Release,
    Replicate,
    ReplicaAck,
    Send,
    ShardStaged,
    VersionId,
    Vote,
)
from ..slots import holders_for
from ..transport import Endpoint, Header, TcpConfig, TcpTransport, TransportError
from .versions import VersionTable

log = logging.getLogger("gemini_ckpt")

PROGRESS_TIMEOUT_S = 5.0
"""A data-plane peer that makes no progress this long fails the transfer. A peer that dies is
noticed at once (its connections reset); this catches one that hangs. Shorter gives false
alarms on busy hosts: 1 s failed 256 MiB transfers with 4 ranks and their stores on 2 cores."""
DEFAULT_BUDGET_FRACTION = 0.3
"""Default per-host budget: this fraction of the node's RAM (``host_memory_budget_bytes=None``)."""
TICK_S = 0.2
SWITCH_INTERVAL_S = 0.0005


def configure_logging() -> None:
    """Actors log to stderr (Ray keeps it in the worker's log file): warnings by default,
    ``GEMINI_CKPT_LOG_LEVEL=INFO`` (or ``DEBUG``) for more."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s gemini_ckpt: %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("GEMINI_CKPT_LOG_LEVEL", "WARNING").upper())


def default_budget_bytes() -> int:
    import psutil  # a Ray dependency

    return int(DEFAULT_BUDGET_FRACTION * psutil.virtual_memory().total)


@dataclass(frozen=True)
class EpochConfig:
    """What the ranks of one rendezvous tell their host store (see :meth:`HostStore.attach`)."""

    epoch: int
    slot: int
    nodes: tuple[str, ...]
    ranks_here: tuple[int, ...]
    world_size: int
    replicas: int
    strategy: str
    keep: int
    dead: frozenset
    idle: frozenset
    timeout_s: float

    @property
    def hosts(self) -> int:
        return len(self.nodes)


class HostStore:
    """Shards of recent versions of one namespace on one node (see the module docstring).

    Run as a Ray actor (:func:`gemini_ckpt._cluster.get_or_create_store`): detached,
    ``max_restarts=0``, pinned to its node, threaded."""

    def __init__(self, namespace: str, node_id: str, budget_bytes: Optional[int] = None) -> None:
        configure_logging()
        # Copies stream through several threads while another checksums a shard item by item
        # (the GIL released for each large item): hand the GIL over sooner than every 5 ms,
        # or a checksum of a few hundred items waits whole intervals between them.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.namespace, self.node_id = namespace, node_id
        self.started_unix = time.time()
        self._lock = threading.RLock()
        self._table = VersionTable(int(budget_bytes) if budget_bytes else default_budget_bytes(), node=node_id)
        self._epoch = 0
        self._cfg: Optional[EpochConfig] = None
        self._commit: Optional[HostCommit] = None
        self._secret = b""
        self._bandwidth: Optional[int] = None
        self._key: Optional[bytes] = None
        self._transport: Optional[TcpTransport] = None
        self._listener = None
        self._attach: Optional[AttachServer] = None
        self._registry = None
        self._peers: dict[int, Any] = {}  # slot -> actor handle
        self._channels: dict[int, Any] = {}  # slot -> data-plane Channel
        self._plans_sent: set[tuple[int, str, int]] = set()  # (slot, plan id, rank) sent on its channel
        self._waiters: dict[tuple[int, int], list[tuple[Connection, int]]] = {}  # version -> local ranks told
        self._sent_fds: dict[Connection, set[int]] = {}  # segments whose memfd a trainer has
        self._maps: dict[Connection, list] = {}  # shards a local reader mapped
        self._incoming: dict[tuple, Any] = {}  # transfer -> what it fills
        self._early_records: dict[tuple, tuple] = {}  # (epoch, step, rank) -> a record whose region is not here yet
        self._refs: list[tuple[Any, int]] = []  # fire-and-forget control calls (ref, to whom)
        self._readers: dict[tuple, Any] = {}  # (host, port) of a restoring reader -> channel
        self._vote_hold: Optional[int] = None  # fault injection: see hold_vote
        self._held_votes: list = []
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gemini-store")
        self._stopped = False
        threading.Thread(target=self._tick, name="gemini-store-tick", daemon=True).start()

    # --- liveness and configuration -----------------------------------------------------------
    def ping(self) -> str:
        return self.node_id

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self._table.pool.budget_bytes = int(budget_bytes)

    def attach(self, epoch: int, info: dict) -> dict:
        """A rank of rendezvous ``epoch`` on this node: the first one sets the epoch up
        (fencing older ones: their versions in flight abort, their writes are refused).
        Returns where the rank's attach socket and this store's data plane are."""
        with self._lock:
            if epoch < self._epoch:
                raise PermissionError(
                    f"host store on node {self.node_id[:12]} (namespace {self.namespace!r}) refused epoch {epoch}: "
                    f"a newer Checkpointer (epoch {self._epoch}) took over this namespace")
            if epoch > self._epoch:
                self._new_epoch(epoch, info)
            return {"attach": self._attach.address, "endpoint": self._listener.endpoint, "slot": self._cfg.slot}

    def _new_epoch(self, epoch: int, info: dict) -> None:
        cfg = EpochConfig(epoch=epoch, slot=int(info["slot"]), nodes=tuple(info["nodes"]),
                          ranks_here=tuple(sorted(info["ranks_here"])), world_size=int(info["world_size"]),
                          replicas=int(info["replicas"]), strategy=str(info["strategy"]), keep=int(info["keep"]),
                          dead=frozenset(info["dead"]), idle=frozenset(info["idle"]),
                          timeout_s=float(info["timeout_s"]))
        committed = {tuple(v) for v in info.get("committed", ())}
        for v in list(self._table.versions.values()):
            if v.state in ("pending", "prepared"):
                # The coordinator of the earlier epoch decided it (or never will).
                v.state = "committed" if v.key in committed else "aborted"
            if v.state == "aborted":
                self._table.release(v, force=True)
        for waiters in self._waiters.values():
            for conn, _ in waiters:
                conn.close()
        self._waiters = {}
        self._epoch, self._cfg = epoch, cfg
        self._key = bytes.fromhex(info["key"]) if info.get("key") else None
        secret = bytes.fromhex(info["secret"])
        bandwidth = info.get("bandwidth")
        if secret != self._secret or self._listener is None or bandwidth != self._bandwidth:
            self._start_data_plane(secret, bandwidth)
        if self._attach is None:
            self._attach = AttachServer(secret, lambda: self._epoch, self._on_attach, self._on_detach)
        else:
            self._attach.secret = secret
        self._channels, self._plans_sent, self._peers = {}, set(), {}
        held = sorted(VersionId(v.epoch, v.step) for v in self._table.versions.values() if v.state == "committed")
        self._commit = None if cfg.slot in cfg.idle else HostCommit(
            cfg.slot, hosts=cfg.hosts, replicas=cfg.replicas, keep=cfg.keep, dead=cfg.dead, idle=cfg.idle,
            committed=held)
        self._registry = None
        log.info("node %s: epoch %d, slot %d of %d, ranks %s", self.node_id[:12], epoch, cfg.slot, cfg.hosts,
                 list(cfg.ranks_here))

    def _start_data_plane(self, secret: bytes, bandwidth: Optional[int] = None) -> None:
        """The listener for copies, and the transport this store sends with: its bandwidth cap
        (``CheckpointConfig.replication_bandwidth``) is this host's, shared by all its sends."""
        old = self._listener
        self._secret, self._bandwidth = secret, bandwidth
        self._transport = TcpTransport(secret, self.namespace, host_name=self.node_id,
                                       config=TcpConfig(progress_timeout_s=PROGRESS_TIMEOUT_S,
                                                        max_send_bytes_per_s=bandwidth))
        self._listener = self._transport.listen(ray.util.get_node_ip_address(), _Sink(self))
        self._readers = {}
        if old is not None:
            old.close()

    def endpoint(self) -> Endpoint:
        with self._lock:
            if self._listener is None:
                raise LookupError(f"the data plane of node {self.node_id[:12]} is not started")
            return self._listener.endpoint

    # --- the attach channel: this node's ranks --------------------------------------------------
    def _on_attach(self, conn: Connection, rank: int, header: dict, payload: bytes, fds: list):
        for fd in fds:
            os.close(fd)
        kind = header.get("type")
        if kind == "plan":
            plan = ShardPlan.decode(payload)
            with self._lock:
                self._table.add_plan(plan, payload)
            return {}, b"", ()
        if kind == "segment":
            with self._lock:
                plan = self._table.plan(header["plan_id"], rank)
                lent = self._table.lend(rank, plan.region_bytes)
                sent = self._sent_fds.setdefault(conn, set())
                fds_out = () if lent.seg.id in sent else (lent.seg.fd,)
                sent.add(lent.seg.id)
                forget = self._table.forgotten.pop(rank, [])
            return {"seg": lent.seg.id, "nbytes": lent.seg.nbytes, "forget": forget}, b"", fds_out
        if kind == "give_back":
            with self._lock:
                self._table.give_back(int(header["seg"]))
            return None
        if kind == "staged":
            self._staged(conn, rank, header, payload)
            return None
        if kind == "map":
            with self._lock:
                shard = self._complete_shard(int(header["step"]), int(header["rank"]))
                self._table.use(shard)
                self._maps.setdefault(conn, []).append(shard)
            return {"nbytes": shard.seg.nbytes, "seg": shard.seg.id}, b"", (shard.seg.fd,)
        if kind == "unmap":
            with self._lock:
                mapped = self._maps.get(conn, [])
                shard = next((s for s in mapped if s.seg.id == int(header["seg"])), None)
                if shard is not None:
                    mapped.remove(shard)
                    self._table.done_with(shard)
            return {}, b"", ()
        raise ValueError(f"unknown attach message {kind!r}")

    def _on_detach(self, conn: Connection, rank: int) -> None:
        actions = []
        with self._lock:
            for shard in self._maps.pop(conn, []):
                self._table.done_with(shard)
            self._sent_fds.pop(conn, None)
            if self._commit is None or self._cfg is None:
                return
            for vid in self._commit.pending():
                v = self._table.versions.get(vid.step)
                if vid.epoch == self._epoch and (v is None or rank not in v.shards):
                    actions += self._commit.on_local_failure(vid, f"rank {rank}'s training process ended before "
                                                                  f"it staged its shard")
        self._apply(actions)

    def _staged(self, conn: Connection, rank: int, header: dict, payload: bytes) -> None:
        """A rank handed off its shard of a step: copies to the other holders start at once,
        while this thread checksums the shard into its record; the rank's part of the version
        is done (``ShardStaged``) once the record is made."""
        step, seg_id = int(header["step"]), int(header["seg"])
        received = time.time()
        blobs, at = [], 0
        for n in header.get("lengths", []):
            blobs.append(payload[at : at + n])
            at += n
        with self._lock:
            epoch, cfg = self._epoch, self._cfg
            self._waiters.setdefault((epoch, step), []).append((conn, rank))
            vid = VersionId(epoch, step)
            try:
                plan = self._table.plan(header["plan_id"], rank)
                v = self._table.version(epoch, step, world_size=cfg.world_size)
                if v is None:
                    raise ValueError(f"step {step} was saved again by a newer epoch")
                v.marks.setdefault("staged", received)
                v.persist |= bool(header.get("persist"))
                shard = self._table.stage(v, rank, seg_id, plan, owner=cfg.slot)
                self._table.use(shard)
                holders: tuple = ()
                if self._commit is not None:
                    holders = holders_for(cfg.slot, hosts=cfg.hosts, replicas=cfg.replicas, strategy=cfg.strategy,
                                          dead=self._commit.dead)
                    actions = self._commit.start_version(vid, holders=holders, shards=len(cfg.ranks_here))
                else:
                    actions = []
            except Exception as exc:  # noqa: BLE001 - e.g. too few live hosts for the replicas asked
                reason = f"{type(exc).__name__}: {exc}"
                self._tell(conn, step, False, reason)
                self._apply(self._commit.on_local_failure(vid, reason) if self._commit is not None else [])
                return
        self._apply(actions)
        for holder in holders[1:]:  # the protocol allows copies to start before it says Replicate
            self._pool.submit(self._copy, vid, holder, shard, len(cfg.ranks_here))
        try:
            record = make_record(plan, shard.seg.array, blobs, epoch=epoch, step=step)  # CRC32C: GIL released
            record_bytes = record.encode(self._key)
        except Exception as exc:  # noqa: BLE001 - the version cannot be committed without its record
            shard.recorded.set()
            with self._lock:
                self._table.done_with(shard)
                actions = self._commit.on_local_failure(vid, f"rank {rank}'s record: {exc}") \
                    if self._commit is not None else []
            self._tell(conn, step, False, f"{type(exc).__name__}: {exc}")
            self._apply(actions)
            return
        with self._lock:
            shard.record, shard.record_bytes = record, record_bytes
            shard.recorded.set()
            v.mark("recorded")
            self._table.done_with(shard)
            if epoch != self._epoch:
                self._tell(conn, step, False, f"a newer Checkpointer (epoch {self._epoch}) took over this namespace")
                return
            actions = self._commit.on_message(ShardStaged(vid, rank)) if self._commit is not None else []
        self._apply(actions)

    def _tell(self, conn: Connection, step: int, committed: bool, reason: str = "") -> None:
        try:
            conn.send({"type": "outcome", "id": 0, "step": step, "committed": committed, "reason": reason})
        except OSError:
            pass  # the rank is gone; its version's fate is in the store either way

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
                self._decided(a.version, True, "")
            elif isinstance(a, Aborted):
                self._decided(a.version, False, a.reason)
            elif isinstance(a, Release):
                with self._lock:
                    v = self._table.versions.get(a.version.step)
                    if v is not None and v.key == (a.version.epoch, a.version.step):
                        self._table.release(v)

    def _decided(self, vid: VersionId, committed: bool, reason: str) -> None:
        with self._lock:
            v = self._table.versions.get(vid.step)
            if v is not None and v.key == (vid.epoch, vid.step):
                v.mark("decided")
                v.state = "committed" if committed else "aborted"
                if not committed:
                    self._table.release(v, force=True)
            waiters = self._waiters.pop((vid.epoch, vid.step), [])
        for conn, _rank in waiters:
            self._tell(conn, vid.step, committed, reason)
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
            from ..._cluster import find_store

            handle = find_store(self.namespace, cfg.nodes[slot])
            with self._lock:
                self._peers[slot] = handle
        return handle

    def _registry_handle(self):
        if self._registry is None:
            from ..._cluster import find_registry

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
            buf = bytearray(header.length)
            self._incoming[key] = (kind, buf, meta)
            return memoryview(buf)

    def _incoming_done(self, header: Header, ok: bool) -> None:
        meta = json.loads(header.meta)
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

    # --- reading ------------------------------------------------------------------------------------
    def _complete_shard(self, step: int, rank: int):
        v = self._table.versions.get(step)
        shard = v.shards.get(rank) if v is not None else None
        if shard is None or not shard.complete or v.state == "aborted":
            raise LookupError(f"step {step} has no complete shard of rank {rank} on node {self.node_id[:12]}")
        return shard

    def index(self) -> dict[int, dict]:
        """Per step: epoch, state (``committed``, ``prepared``, ``pending``, ``aborted``; copies
        of a version this store takes no part in stay ``pending``), world size, and the shards
        held here (owner slot, complete, plan id, bytes)."""
        with self._lock:
            out = self._table.index()
            if self._commit is not None:
                for step, entry in out.items():
                    if entry["epoch"] == self._epoch and entry["state"] == "pending":
                        entry["state"] = {"prepared": "prepared"}.get(
                            self._commit.state(VersionId(self._epoch, step)), "pending")
            return out

    def shard_info(self, step: int, ranks: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """``rank -> (encoded plan, encoded record)`` of the complete shards of ``step`` held here."""
        with self._lock:
            out = {}
            for rank in ranks:
                try:
                    shard = self._complete_shard(step, rank)
                    _, plan = self._table.plans[(shard.plan_id, rank)]
                except (LookupError, KeyError):
                    continue
                out[rank] = (plan, shard.record_bytes)
            return out

    def push_range(self, step: int, rank: int, offset: int, length: int, reader: Endpoint, tag: str) -> int:
        """Send bytes ``[offset, offset + length)`` of a shard's region to a reader's
        data-plane listener; returns once the reader has them."""
        with self._lock:
            shard = self._complete_shard(step, rank)
            if offset < 0 or length <= 0 or offset + length > shard.seg.nbytes:
                raise ValueError(f"range [{offset}, {offset + length}) is outside rank {rank}'s shard "
                                 f"({shard.seg.nbytes} bytes)")
            self._table.use(shard)
            transport, key = self._transport, (reader.host, reader.port)
            channel = self._readers.get(key)
        try:
            if channel is None:
                channel = transport.connect(reader)
                with self._lock:
                    self._readers[key] = channel
            channel.send(Header(self.namespace, step, f"region/{rank}", offset, length, total=shard.seg.nbytes,
                                put_id=tag), shard.seg.array[offset : offset + length], timeout=600)
        except TransportError as exc:
            with self._lock:
                self._readers.pop(key, None)
            raise ConnectionError(f"node {self.node_id[:12]} could not send to the reader: {exc}") from None
        finally:
            with self._lock:
                self._table.done_with(shard)
        return length

    # --- the durable tier ----------------------------------------------------------------------------
    def persist_shard(self, step: int, rank: int, uri: str, directory: str, name: str, section: bytes) -> list:
        """Write rank ``rank``'s data file of ``step`` to ``uri``/``directory``/``name`` in DCP's
        ``FileSystemWriter`` layout: ``section`` (its non-tensor items, ``torch.save``-d by the
        persister), then every tensor item framed as ``torch.save`` frames it. The copy is
        checked against its record first. Returns ``[offset, length, crc32c]`` per tensor item."""
        import pyarrow.fs as pafs

        with self._lock:
            shard = self._complete_shard(step, rank)
            plan = self._table.plan(shard.plan_id, rank)
            self._table.use(shard)
        try:
            problem = self._verify_copies([shard])
            if problem:
                raise ValueError(f"node {self.node_id[:12]}: {problem}; not persisted from this copy")
            if "://" in uri:
                fs, root = pafs.FileSystem.from_uri(uri)
            else:
                fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
            target = posixpath.join(root, directory)
            fs.create_dir(target, recursive=True)
            with fs.open_output_stream(posixpath.join(target, name)) as out:
                out.write(section)
                placed = write_tensors(out, shard.seg.array,
                                       [(t.at, t.nbytes, plan.templates[t.template]) for t in plan.tensors],
                                       start=len(section))
            return [[p.offset, p.length, p.crc] for p in placed]
        finally:
            with self._lock:
                self._table.done_with(shard)

    def unpin(self, step: int) -> None:
        with self._lock:
            self._table.unpin(step)

    def discard(self, step: int, epoch: int) -> int:
        """Forget the version of ``step`` if it is of an epoch before ``epoch``; bytes freed."""
        with self._lock:
            v = self._table.versions.get(step)
            if v is None or v.epoch >= epoch:
                return 0
            return self._table.release(v, force=True)

    # --- housekeeping ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self._stopped:
            time.sleep(TICK_S)
            try:
                self._check_timeouts()
                self._check_refs()
                self._retain_copies()
            except Exception as exc:  # noqa: BLE001 - housekeeping must never stop
                log.warning("node %s: housekeeping failed: %s: %s", self.node_id[:12], type(exc).__name__, exc)

    def _check_timeouts(self) -> None:
        actions = []
        with self._lock:
            if self._commit is None or self._cfg is None:
                return
            now = time.time()
            for vid in self._commit.pending():
                v = self._table.versions.get(vid.step)
                started = v.started_unix if v is not None else now
                if now - started > self._cfg.timeout_s:
                    actions += self._commit.on_timeout(vid)
        self._apply(actions)

    def _check_refs(self) -> None:
        with self._lock:
            refs, self._refs = self._refs, []
        if not refs:
            return
        ready, _ = ray.wait([r for r, _ in refs], num_returns=len(refs), timeout=0)
        ready = set(ready)
        keep = []
        for ref, to in refs:
            if ref not in ready:
                keep.append((ref, to))
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                self._suspect(to, f"a control message was lost ({type(exc).__name__})")
            except Exception:  # noqa: BLE001 - a peer's own error is its business
                pass
        with self._lock:
            self._refs = keep + self._refs

    def _retain_copies(self) -> None:
        """Copies of versions this store takes no part in (it has no ranks this epoch) are
        never told a decision: keep those of the newest ``keep + 1`` steps."""
        with self._lock:
            if self._commit is not None or self._cfg is None:
                return
            steps = sorted(self._table.versions)
            for step in steps[: -(self._cfg.keep + 1)]:
                self._table.release(self._table.versions[step])

    # --- status and tests ----------------------------------------------------------------------------
    def describe(self) -> dict:
        """What ``gemini_ckpt status`` shows for this host (plain data, JSON-ready)."""
        index = self.index()
        with self._lock:
            pool = self._table.pool
            return {
                "namespace": self.namespace, "node_id": self.node_id, "budget_bytes": pool.budget_bytes,
                "held_bytes": self._table.held_bytes(), "reserved_bytes": pool.held + pool.pooled,
                "started_unix": self.started_unix, "epoch": self._epoch,
                "slot": self._cfg.slot if self._cfg else None,
                "versions": {step: {"epoch": e["epoch"], "committed": e["state"] == "committed", "state": e["state"],
                                    "shards": {r: {"owner": s["owner"], "complete": s["complete"],
                                                   "nbytes": s["nbytes"]} for r, s in sorted(e["shards"].items())}}
                             for step, e in sorted(index.items())},
            }

    def hold_vote(self, step: int) -> None:
        """Fault injection (the chaos harness): keep this store's yes vote for ``step`` until
        :meth:`release_vote`, so a fault lands after every copy is acknowledged and before the
        coordinator decides."""
        with self._lock:
            self._vote_hold, self._held_votes = step, []

    def held(self) -> Optional[int]:
        """The step whose vote is being held, once it is (else None)."""
        with self._lock:
            return self._vote_hold if self._held_votes else None

    def release_vote(self) -> None:
        with self._lock:
            held, self._held_votes, self._vote_hold = self._held_votes, [], None
        self._apply(held)

    def _hold(self, action: Send) -> bool:
        message = action.message
        with self._lock:
            if (self._vote_hold is None or not isinstance(message, Vote) or not message.ok
                    or message.version.step != self._vote_hold):
                return False
            self._held_votes.append(action)
            return True

    def timeline(self, step: int) -> dict[str, float]:
        """When each phase of ``step`` happened here (unix seconds): staged, recorded,
        replicating, sent, copies of slot N complete/checked, decided (for benchmarks and
        ``gemini_ckpt status``)."""
        with self._lock:
            v = self._table.versions.get(step)
            return dict(v.marks) if v is not None else {}

    def corrupt_for_test(self, step: int, rank: int, offset: int) -> int:
        """Flip one byte of a kept copy (in place): lets tests and the chaos harness prove that
        checksums bite and that a reader moves on to another holder."""
        with self._lock:
            shard = self._table.versions[step].shards[rank]
            shard.seg.array[offset] ^= 0xFF
        return offset


class _Sink:
    """The transport's view of a host store: copies land straight in its segments."""

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def buffer_for(self, header: Header) -> memoryview:
        return self.store._incoming_buffer(header)

    def received(self, header: Header) -> None:
        self.store._incoming_done(header, ok=True)

    def failed(self, header: Header, error: BaseException) -> None:
        self.store._incoming_done(header, ok=False)
        log.info("node %s: a copy of %s failed: %s", self.store.node_id[:12], header.describe(), error)
