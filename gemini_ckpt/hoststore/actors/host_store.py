"""The host store: one Ray actor per node, keeping its own ranks' shards and its peers' copies.

Its part of a version (see ``docs/dataplane.md``; roles and messages in ``docs/commit.md``):

1. **Take the shards of this host's ranks**, staged into segments it lent them (the attach
   channel, :mod:`gemini_ckpt.hoststore.attach`); record each (a CRC32C of every item).
2. **Replicate** each shard to its other holders over the data plane (:mod:`gemini_ckpt.dataplane`),
   straight into their segments; a holder verifies and acknowledges (``ReplicaAck``).
3. **Commit among the stores** (votes up a tree to the registry's coordinator, the decision down:
   :meth:`commit_message`); tell the ranks the outcome; release what retention lets go.
4. **Serve**: readers map a shard or have it pushed (:meth:`push_range`), the persister a DCP data file.

The actor is a thin facade (this module: configuration per epoch, the data plane, status) over
named parts that share one small :class:`.state.StoreState` and own the rest of their state:
:class:`.ranks.RankPort` (step 1, this node's ranks on the attach channel),
:class:`.replication.Replicator` (step 2, copies between stores),
:class:`.commit_driver.CommitDriver` (step 3, the protocol's messages and deadlines) and
:class:`.serving.ShardServer` (step 4).

A training process that dies after staging takes nothing with it: its shard is here; one that dies
before staging closes its attach socket, and the versions waiting for it fail at once.

Actors raise built-in exceptions (``MemoryError`` over budget, ``LookupError`` no such version,
``PermissionError`` fenced, ``ValueError`` refused), which the client maps onto the library's.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Optional

import ray

from ...retention import KeepNewest
from ..attach_server import AttachServer
from ..fence import fence_when_node_lost
from ...commit import HostCommit, VersionId, VersionState
from ...format.commstate import CommState
from ...config import Interleave
from ...dataplane import LOWER_EFFORT_DSCP, Endpoint, IdleGate, TcpConfig, TcpTransport
from .commit_driver import CommitDriver
from .ranks import RankPort
from .replication import Replicator
from .sink import ReplicaSink
from .serving import ShardServer
from ...timeouts import TIMEOUTS
from .state import EpochConfig, StoreState
from . import budget as budget_rules
from .versions import VersionTable

log = logging.getLogger("gemini_ckpt")

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


def _ram_bytes() -> int:
    import psutil  # a Ray dependency

    return int(psutil.virtual_memory().total)


class HostStore:
    """Shards of recent versions of one namespace on one node (see the module docstring): the Ray
    actor's methods, each handed to the collaborator whose job it is.

    Run as a Ray actor (:func:`~.store_handle.get_or_create_store`): detached,
    ``max_restarts=0``, pinned to its node, threaded."""

    def __init__(
        self, namespace: str, node_id: str, budget_bytes: Optional[int] = None, others: Optional[dict] = None
    ) -> None:
        configure_logging()
        # Copies stream through several threads while another checksums a shard item by item
        # (the GIL released for each large item): hand the GIL over sooner than every 5 ms,
        # or a checksum of a few hundred items waits whole intervals between them.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.namespace, self.node_id = namespace, node_id
        # an explicit budget is judged by set_budget, which get_or_create_store calls next
        budget, note = budget_rules.choose(None, dict(others or {}), _ram_bytes(), namespace=namespace)
        if note and not budget_bytes:
            log.warning("gemini_ckpt: %s", note)
        self.s = StoreState(namespace, node_id, VersionTable(budget, node=node_id))
        # The facade's own (under the store's lock): the data plane's settings and listener.
        self.started_unix = time.time()
        self.footprint_bytes = 0  # what the job's plan will take here (expect)
        self.bandwidth: Optional[int] = None
        self.interleave = Interleave.OFF  # the data plane's mode (gate: its sends go through the gate)
        self.gate = None  # the transport's IdleGate reading the comm state, when interleaving
        self.listener = self.attach_server = None  # where peers' copies come in; this node's ranks' AttachServer
        self.secret, self.stopped = b"", False  # the namespace's, this epoch (the data plane's and attach's)
        self.driver = CommitDriver(self.s)
        self.replicator = Replicator(self.s, self.driver)
        self.ranks = RankPort(self.s, self.driver, self.replicator)
        self.server = ShardServer(self.s)
        self._metrics = None  # StoreMetrics, made at the first tick after a job asked for them (False: failed)
        threading.Thread(target=self._tick, name="gemini-store-tick", daemon=True).start()
        fence_when_node_lost(f"host store of namespace {namespace!r}")

    # --- liveness and configuration -----------------------------------------------------------
    def ping(self) -> str:
        return self.node_id

    def set_budget(self, budget_bytes: int, others: Optional[dict] = None) -> None:
        """Set an explicit budget; MemoryBudgetError when it is more than ``others`` (the other
        namespaces' stores on this node: namespace -> budget) leave it (:mod:`.budget`)."""
        budget, _ = budget_rules.choose(int(budget_bytes), dict(others or {}), _ram_bytes(), namespace=self.namespace)
        with self.s.lock:
            self.s.table.pool.budget_bytes = budget

    def budget(self) -> int:
        with self.s.lock:
            return self.s.table.pool.budget_bytes

    def expect(self, footprint_bytes: int) -> None:
        """The memory the job's plan will take here (computed by the trainer before its first save)."""
        with self.s.lock:
            self.footprint_bytes = int(footprint_bytes)

    def attach(self, epoch: int, cfg: EpochConfig) -> dict:
        """A rank of rendezvous ``epoch`` on this node: the first one sets the epoch up
        (fencing older ones: their versions in flight abort, their writes are refused).
        Returns where the rank's attach socket and this store's data plane are."""
        with self.s.lock:
            if epoch < self.s.epoch:
                raise PermissionError(
                    f"host store on node {self.node_id[:12]} (namespace {self.namespace!r}) refused epoch {epoch}: "
                    f"a newer Checkpointer (epoch {self.s.epoch}) took over this namespace"
                )
            if epoch > self.s.epoch:
                if not isinstance(cfg, EpochConfig) or cfg.epoch != epoch:
                    raise TypeError(f"attach(epoch={epoch}) needs that epoch's EpochConfig, got {cfg!r}")
                self._new_epoch(epoch, cfg)
            return {"attach": self.attach_server.address, "endpoint": self.listener.endpoint, "slot": self.s.cfg.slot}

    def _new_epoch(self, epoch: int, cfg: EpochConfig) -> None:
        committed = {tuple(v) for v in cfg.committed}
        for v in list(self.s.table.versions.values()):
            if v.state in (VersionState.PENDING, VersionState.PREPARED):
                # The coordinator of the earlier epoch decided it (or never will).
                v.state = VersionState.COMMITTED if v.key in committed else VersionState.ABORTED
            if v.state == VersionState.ABORTED:
                self.s.table.release(v, force=True)
        for waiters in self.s.waiters.values():
            for conn, _ in waiters:
                conn.close()
        self.s.waiters = {}
        self.s.table.new_epoch(cfg.ranks_here)
        self.s.epoch, self.s.cfg = epoch, cfg
        self.s.key = bytes.fromhex(cfg.key) if cfg.key else None
        secret = bytes.fromhex(cfg.secret)
        bandwidth, interleave = cfg.bandwidth, cfg.interleave  # store_config normalized it
        if (
            secret != self.secret
            or self.listener is None
            or bandwidth != self.bandwidth
            or interleave != self.interleave
        ):
            self._start_data_plane(secret, bandwidth, interleave)
        if self.attach_server is None:
            self.attach_server = AttachServer(secret, lambda: self.s.epoch, self.ranks.on_attach, self.ranks.on_detach)
        else:
            self.attach_server.new_epoch(secret)
        self.driver.new_epoch()
        self.replicator.new_epoch()
        held = [v for v in self.s.table.versions.values() if v.state == VersionState.COMMITTED]
        unhealthy = set(self.s.table.unhealthy_steps())
        self.s.commit = (
            None
            if cfg.slot in cfg.idle
            else HostCommit(
                cfg.slot,
                hosts=cfg.hosts,
                replicas=cfg.replicas,
                keep=cfg.keep,
                dead=cfg.dead,
                idle=cfg.idle,
                committed=sorted(VersionId(v.epoch, v.step) for v in held if v.step not in unhealthy),
                unhealthy=sorted(VersionId(v.epoch, v.step) for v in held if v.step in unhealthy),
            )
        )
        log.info(
            "node %s: epoch %d, slot %d of %d, ranks %s",
            self.node_id[:12],
            epoch,
            cfg.slot,
            cfg.hosts,
            list(cfg.ranks_here),
        )

    def _start_data_plane(
        self, secret: bytes, bandwidth: Optional[int] = None, interleave: Interleave = Interleave.OFF
    ) -> None:
        """The listener for copies, and the transport this store sends with: its bandwidth cap
        (``CheckpointConfig.replication_bandwidth``) is this host's, shared by all its sends, and
        so is its gate (``CheckpointConfig.interleave`` ``"gate"``): sends wait while this node's
        ranks are inside a collective (docs/interleave.md). Under ``"network"`` its sockets are
        marked lower-effort (DSCP CS1) instead."""
        old = self.listener
        self.secret, self.bandwidth, self.interleave = secret, bandwidth, interleave
        if self.s.comm is None:
            self.s.comm = CommState.create()
        self.gate = IdleGate(self.s.comm) if interleave == Interleave.GATE else None
        self.s.transport = TcpTransport(
            secret,
            self.namespace,
            host_name=self.node_id,
            config=TcpConfig(
                progress_timeout_s=TIMEOUTS.progress_s,
                max_send_bytes_per_s=bandwidth,
                dscp=LOWER_EFFORT_DSCP if interleave == Interleave.NETWORK else None,
            ),
            gate=self.gate,
        )
        self.listener = self.s.transport.listen(ray.util.get_node_ip_address(), ReplicaSink(self.replicator))
        self.server.forget_readers()
        if old is not None:
            old.close()

    def endpoint(self) -> Endpoint:
        with self.s.lock:
            if self.listener is None:
                raise LookupError(f"the data plane of node {self.node_id[:12]} is not started")
            return self.listener.endpoint

    # --- the collaborators' Ray methods ------------------------------------------------------------
    def commit_message(self, message) -> None:
        """A control message from a peer store or the coordinator (fire-and-forget)."""
        self.driver.commit_message(message)

    def peer_dead(self, slot: int) -> None:
        """The registry saw the host store of ``slot`` die."""
        self.replicator.drop_channel(slot)
        self.driver.peer_dead(slot)

    def send_copy(self, step: int, rank: int, target: Endpoint) -> int:  # see .replication.Replicator.send_copy
        return self.replicator.send_copy(step, rank, target)

    def index(self) -> dict[int, dict]:  # see .serving.ShardServer.index
        return self.server.index()

    def shard_info(self, step: int, ranks: list[int]) -> dict[int, tuple[bytes, bytes]]:
        return self.server.shard_info(step, ranks)

    def survey(self) -> dict:  # see .serving.ShardServer.survey
        return self.server.survey()

    def push_range(self, step: int, rank: int, offset: int, length: int, reader: Endpoint, tag: str) -> int:
        return self.server.push_range(step, rank, offset, length, reader, tag)

    def push_ranges(self, step: int, rank: int, ranges: list, reader: Endpoint) -> int:
        return self.server.push_ranges(step, rank, ranges, reader)

    def persist_shard(
        self, step: int, rank: int, uri: str, directory: str, name: str, section: bytes, opener=None
    ) -> list:
        return self.server.persist_shard(step, rank, uri, directory, name, section, opener)

    def unpin(self, step: int) -> None:
        self.server.unpin(step)

    def discard(self, step: int, epoch: int) -> int:
        return self.server.discard(step, epoch)

    def hold_vote(self, step: int) -> None:  # fault injection (the chaos harness): .commit_driver.CommitDriver
        self.driver.hold_vote(step)

    def held(self) -> Optional[int]:
        return self.driver.held()

    def release_vote(self) -> None:
        self.driver.release_vote()

    # --- housekeeping ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self.stopped:
            time.sleep(TICK_S)
            try:
                self.driver.check_timeouts()
                self.driver.check_refs()
                self._retain_copies()
                self.server.close_idle_readers(TIMEOUTS.reader_idle_s)
                self._publish_metrics()
            except Exception as exc:  # noqa: BLE001 - housekeeping must never stop
                log.warning("node %s: housekeeping failed: %s: %s", self.node_id[:12], type(exc).__name__, exc)

    def _publish_metrics(self) -> None:
        """The store's gauges (``CheckpointConfig.metrics``), about once a second."""
        if self.s.cfg is None or not self.s.cfg.metrics or self._metrics is False:
            return
        from ..metrics import StoreMetrics, store_figures

        if self._metrics is None:
            try:
                self._metrics = StoreMetrics(self.namespace, self.node_id)
            except Exception as exc:  # noqa: BLE001 - metrics never stop a store; said once, not every tick
                self._metrics = False
                log.warning("node %s: metrics are off: %s: %s", self.node_id[:12], type(exc).__name__, exc)
                return
        if not self._metrics.due():
            return
        with self.s.lock:
            figures = store_figures(self.s.table, self.replicator.replicated_bytes)
        self._metrics.update(**figures)

    def _retain_copies(self) -> None:
        """Copies of versions this store takes no part in (it has no ranks this epoch) are
        never told a decision: keep those of the newest ``keep + 1`` steps, not counting those
        whose records held here say they are unhealthy (see :mod:`gemini_ckpt.retention`)."""
        with self.s.lock:
            if self.s.commit is not None or self.s.cfg is None:
                return
            doomed = KeepNewest(self.s.cfg.keep + 1).doomed(
                list(self.s.table.versions), unhealthy=self.s.table.unhealthy_steps()
            )
            for step in doomed:
                self.s.table.release(self.s.table.versions[step])

    # --- status and tests ----------------------------------------------------------------------------
    def describe(self) -> dict:
        """What ``gemini_ckpt status`` shows for this host (plain data, JSON-ready)."""
        index = self.server.index()
        with self.s.lock:
            pool = self.s.table.pool
            return {
                "namespace": self.namespace,
                "node_id": self.node_id,
                "budget_bytes": pool.budget_bytes,
                "footprint_bytes": self.footprint_bytes,
                "held_bytes": self.s.table.held_bytes(),
                "reserved_bytes": pool.held + pool.pooled,
                "pool": {
                    "held_bytes": pool.held,
                    "pooled_bytes": pool.pooled,
                    "lent": sorted([x.rank, x.state, x.seg.nbytes] for x in self.s.table.lent.values()),
                },
                "memory": self.s.table.memory(),
                "started_unix": self.started_unix,
                "epoch": self.s.epoch,
                "readers": len(self.server.readers),  # open channels to restoring readers
                "interleave": self._interleave_stats(),
                "slot": self.s.cfg.slot if self.s.cfg else None,
                "versions": {
                    step: {
                        "epoch": e["epoch"],
                        "committed": e["state"] == "committed",
                        "state": e["state"],
                        "unhealthy": e["unhealthy"],
                        "shards": {
                            r: {"owner": s["owner"], "complete": s["complete"], "nbytes": s["nbytes"]}
                            for r, s in sorted(e["shards"].items())
                        },
                    }
                    for step, e in sorted(index.items())
                },
            }

    def _interleave_stats(self) -> dict:
        """For benchmarks: whether sends yield to training (``enabled``), and then the gate's
        counters (seconds waited for idle, pieces, pieces forced after patience, the piece size
        it would choose now, the measured link rate) and the ranks' collectives (count, busy
        seconds, the running mean duration the piece size comes from)."""
        out = {
            "enabled": self.gate is not None,
            "mode": self.interleave,
            "dscp": self.s.transport.config.dscp if self.s.transport is not None else None,
        }
        if self.gate is not None:
            out.update(self.gate.stats())
        if self.s.comm is not None:
            out.update(self.s.comm.stats())
        return out

    def timeline(self, step: int) -> dict[str, float]:
        """When each phase of ``step`` happened here (unix seconds): staged, recorded, replicating,
        sent, copies of slot N complete/checked, decided (benchmarks, ``gemini_ckpt status``)."""
        with self.s.lock:
            v = self.s.table.versions.get(step)
            return dict(v.marks) if v is not None else {}

    def kept_bytes(self, step: int, rank: int):
        """The bytes of this store's copy of rank ``rank``'s shard of ``step`` as they are held (in
        this process, a uint8 view of the segment; through a Ray call, a copy): for inspection, and
        for the chaos harness's faults (:func:`gemini_ckpt.chaos.damage_copy`)."""
        with self.s.lock:
            return self.s.table.versions[step].shards[rank].seg.array
