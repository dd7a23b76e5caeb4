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

The class is written in four files, one per job: this one (state, configuration per epoch,
housekeeping, status), :mod:`.ranks` (step 1), :mod:`.replication` (steps 2-3) and
:mod:`.serving` (step 4).

A training process that dies after staging takes nothing with it: its shard is here. One that
dies before staging closes its attach socket, and the versions waiting for it fail at once.

Actors raise built-in exceptions (``MemoryError`` over budget, ``LookupError`` no such version,
``PermissionError`` fenced, ``ValueError`` refused), which the client maps onto the library's.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...retention import KeepNewest
from ..attach import AttachServer, Connection
from ..names import ACTOR_ENV, RAY_NAMESPACE, store_name
from ..commit import (
    HostCommit,
    Send,
    VersionId,
    Vote,
)
from ..transport import Endpoint, TcpConfig, TcpTransport
from .ranks import LocalRanks
from .replication import Replication, ReplicaSink
from .serving import Serving
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


class HostStore(LocalRanks, Replication, Serving):
    """Shards of recent versions of one namespace on one node (see the module docstring).

    Run as a Ray actor (:func:`get_or_create_store`): detached,
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
        self._copy_channels: dict[tuple, Any] = {}  # (host, port) of a store re-replicated to -> channel
        self._copies_in: dict[tuple, Any] = {}  # ((epoch, step, rank), kind) -> a re-replicated copy arriving
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
        self._table.new_epoch(cfg.ranks_here)
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
        held = [v for v in self._table.versions.values() if v.state == "committed"]
        unhealthy = set(self._table.unhealthy_steps())
        self._commit = None if cfg.slot in cfg.idle else HostCommit(
            cfg.slot, hosts=cfg.hosts, replicas=cfg.replicas, keep=cfg.keep, dead=cfg.dead, idle=cfg.idle,
            committed=sorted(VersionId(v.epoch, v.step) for v in held if v.step not in unhealthy),
            unhealthy=sorted(VersionId(v.epoch, v.step) for v in held if v.step in unhealthy))
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
        self._listener = self._transport.listen(ray.util.get_node_ip_address(), ReplicaSink(self))
        self._readers = {}
        if old is not None:
            old.close()

    def endpoint(self) -> Endpoint:
        with self._lock:
            if self._listener is None:
                raise LookupError(f"the data plane of node {self.node_id[:12]} is not started")
            return self._listener.endpoint


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
        never told a decision: keep those of the newest ``keep + 1`` steps, not counting those
        whose records held here say they are unhealthy (see :mod:`gemini_ckpt.retention`)."""
        with self._lock:
            if self._commit is not None or self._cfg is None:
                return
            doomed = KeepNewest(self._cfg.keep + 1).doomed(list(self._table.versions),
                                                            unhealthy=self._table.unhealthy_steps())
            for step in doomed:
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
                "pool": {"held_bytes": pool.held, "pooled_bytes": pool.pooled,
                         "lent": sorted([x.rank, x.state, x.seg.nbytes] for x in self._table.lent.values())},
                "memory": self._table.memory(),
                "started_unix": self.started_unix, "epoch": self._epoch,
                "slot": self._cfg.slot if self._cfg else None,
                "versions": {step: {"epoch": e["epoch"], "committed": e["state"] == "committed", "state": e["state"],
                                    "unhealthy": e["unhealthy"],
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

    def kept_bytes(self, step: int, rank: int):
        """The bytes of this store's copy of rank ``rank``'s shard of ``step`` as they are held (in
        this process, a uint8 view of the segment; through a Ray call, a copy): for inspection, and
        for the chaos harness's faults (:func:`gemini_ckpt.chaos.damage_copy`)."""
        with self._lock:
            return self._table.versions[step].shards[rank].seg.array


def get_or_create_store(namespace: str, node_id: str, budget_bytes: Optional[int] = None):
    """The host store of ``node_id`` in ``namespace``, created there (hard node affinity) if
    missing. An existing store keeps its budget unless ``budget_bytes`` is given."""
    handle = (ray.remote(HostStore)
              .options(name=store_name(namespace, node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
                       lifetime="detached", max_restarts=0, num_cpus=0, max_concurrency=64,
                       runtime_env={"env_vars": ACTOR_ENV},
                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
              .remote(namespace, node_id, budget_bytes))
    if budget_bytes is not None:
        handle.set_budget.remote(budget_bytes)
    return handle
