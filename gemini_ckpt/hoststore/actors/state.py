"""What the host store's collaborators share: the version table, the lock around it, this epoch's
configuration, the commit state and the data plane (see :mod:`.host_store`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from ...config import Interleave, interleave_mode
from ...commit import HostCommit, VersionState
from .versions import VersionTable


@dataclass(frozen=True)
class EpochConfig:
    """What the ranks of one rendezvous tell their host store (see :meth:`HostStore.attach`),
    sent as this type over Ray (the control plane, trusted), or by the registry to a store it
    adopts outside a rendezvous (``ranks_here`` empty, its slot idle)."""

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
    committed: tuple = ()  # (epoch, step) of the versions committed before this epoch
    secret: str = field(default="", repr=False)  # the data plane's shared secret (hex)
    key: Optional[str] = field(default=None, repr=False)  # the signing key (hex), if any
    bandwidth: Optional[int] = None  # CheckpointConfig.replication_bandwidth
    domains: Optional[tuple] = None  # slot -> failure domain (CheckpointConfig.failure_domain), fixed per epoch
    interleave: Interleave = Interleave.GATE  # CheckpointConfig.interleave_mode
    metrics: bool = True  # CheckpointConfig.metrics: this store publishes its gauges (gemini_ckpt.hoststore.metrics)

    @property
    def hosts(self) -> int:
        return len(self.nodes)


def store_config(
    job: dict,
    *,
    epoch: int,
    slot: int,
    nodes: tuple,
    ranks_here: tuple,
    world_size: int,
    keep: int,
    timeout_s: float,
    dead: frozenset,
    idle: frozenset,
    committed: tuple,
    secret: str,
    domains: Optional[tuple],
) -> EpochConfig:
    """What a host store is told for an epoch: the one builder, used by ranks at their rendezvous
    and by the registry for a store without ranks. ``job``: what the job told its registry
    (:meth:`gemini_ckpt.settings.StoreSettings.job`)."""
    return EpochConfig(
        epoch=epoch,
        slot=slot,
        nodes=tuple(nodes),
        ranks_here=tuple(ranks_here),
        world_size=world_size,
        replicas=int(job.get("replicas", 2)),
        strategy=job.get("strategy", "auto"),
        keep=keep,
        dead=frozenset(dead),
        idle=frozenset(idle),
        timeout_s=float(timeout_s),
        committed=tuple(committed),
        secret=secret,
        key=job.get("key"),
        bandwidth=job.get("bandwidth"),
        domains=domains,
        interleave=interleave_mode(job.get("interleave", Interleave.GATE)),
        metrics=bool(job.get("metrics", True)),
    )


class StoreState:
    """What a host store's parts share, and only that: the version table, the epoch and what
    it was told (``cfg``), its commit participant, the comm page, the signing key, the data
    plane's transport, the ranks waiting for outcomes and a thread pool. Every field is read
    and written under ``lock``; each part keeps the rest of its state itself (under the same
    lock): the facade its data plane's settings and listener, the ranks port what each
    connection holds, the replicator its channels and the copies arriving, the driver the
    peers' handles, the server its channels to readers."""

    def __init__(self, namespace: str, node_id: str, table: VersionTable) -> None:
        self.namespace, self.node_id = namespace, node_id
        self.lock = threading.RLock()
        self.table = table
        self.epoch = 0
        self.cfg: Optional[EpochConfig] = None
        self.commit: Optional[HostCommit] = None  # None: this store holds copies only this epoch
        self.comm = None  # the CommState this node's ranks mark their collectives in (format.commstate)
        self.key: Optional[bytes] = None  # the signing key, when the job has one
        self.transport = None  # this store's TcpTransport (its sends share its bandwidth cap)
        self.waiters: dict[tuple[int, int], list] = {}  # version -> local ranks told: [(Connection, rank)]
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gemini-store")

    def complete_shard(self, step: int, rank: int):
        """The complete shard of ``rank`` of ``step`` held here (the lock is held), else LookupError."""
        v = self.table.versions.get(step)
        shard = v.shards.get(rank) if v is not None else None
        if shard is None or not shard.complete or v.state == VersionState.ABORTED:
            raise LookupError(f"step {step} has no complete shard of rank {rank} on node {self.node_id[:12]}")
        return shard
