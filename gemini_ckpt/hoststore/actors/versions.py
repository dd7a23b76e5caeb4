"""What a host store holds: versions of shards in segments, within a byte budget. No Ray, no I/O.

Two kinds of segment, one pool (:class:`~gemini_ckpt.format.segments.SegmentPool`):

- **lent** segments belong to one rank of this host: the store lends a free one for each
  version the rank stages (the trainer maps it once, through the attach channel) and keeps it
  while the version lives; released, it is free for the same rank again;
- **replica** segments receive a peer's shard over the data plane and go back to the pool.

A segment is never reused while anything still uses it: a transfer writing into it or
sending from it, a reader that mapped it, or a persist (``writers``/``pins``); a release
then only marks it, and the last user frees it.

The owner (:class:`~gemini_ckpt.hoststore.actors.host_store.HostStore`) holds its lock around
every call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ...format.segments import Segment, SegmentPool
from ...format.shards import ShardPlan, ShardRecord
from ...commit import VersionState


@dataclass
class Lent:
    seg: Segment
    rank: int
    state: str = "free"  # free | staging (the trainer is filling it) | held (a version lives in it)


@dataclass
class Shard:
    """One copy of rank ``rank``'s shard of a version (``owner``: the slot that saved it)."""

    rank: int
    owner: int
    seg: Segment
    lent: bool
    plan_id: str = ""
    record: Optional[ShardRecord] = None
    record_bytes: bytes = b""
    received: bool = False  # every byte of the region is here
    users: int = 0  # transfers and readers using seg right now
    dropped: bool = False  # released while in use: freed by the last user
    recorded: threading.Event = field(default_factory=threading.Event)  # the record is set (or failed)

    @property
    def complete(self) -> bool:
        return self.received and self.record is not None


@dataclass
class Version:
    epoch: int
    step: int
    shards: dict[int, Shard] = field(default_factory=dict)  # rank -> the copy kept here
    state: VersionState = VersionState.PENDING
    unhealthy: str = ""  # committed, but its state failed its health checks: why (the decision's)
    persist: bool = False  # kept until the persister unpins it
    released: bool = False  # retention let it go while pinned
    world_size: int = 0
    started_unix: float = field(default_factory=time.time)  # for people and timelines
    started_mono: float = field(default_factory=time.monotonic)  # for deadlines: a clock step can't move them
    acked: set = field(default_factory=set)  # owners whose copies this store acknowledged
    marks: dict = field(default_factory=dict)  # what happened when (time.time()), for timelines

    def mark(self, what: str) -> None:
        self.marks.setdefault(what, time.time())

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.step)


class VersionTable:
    """Versions and segments of one host store (see the module docstring)."""

    def __init__(self, budget_bytes: int, *, node: str = "") -> None:
        self.pool = SegmentPool(budget_bytes, shared=True)
        self.node = node
        self.versions: dict[int, Version] = {}
        self.lent: dict[int, Lent] = {}
        self.active_ranks: Optional[frozenset] = None  # ranks on this node this epoch (None: not known yet)
        self.plans: dict[tuple[str, int], tuple[ShardPlan, bytes]] = {}
        self.forgotten: dict[int, list[int]] = {}  # rank -> lent segments its trainer should unmap

    # --- plans -----------------------------------------------------------------------------
    def add_plan(self, plan: ShardPlan, encoded: bytes, *, prune: bool = True) -> None:
        """Keep ``plan``; ``prune``: a rank of this node sent it, so its older plans no held
        version uses go. A peer's plan (a copy's) prunes nothing: the same rank number may be a
        local rank's of a newer epoch (an elastic run renumbers its ranks); unused ones go at the
        next epoch."""
        self.plans[(plan.plan_id, plan.rank)] = (plan, encoded)
        if not prune:
            return
        keep = self._used_plans() | {(plan.plan_id, plan.rank)}
        for key in [k for k in self.plans if k not in keep and k[1] == plan.rank]:
            del self.plans[key]

    def _used_plans(self) -> set:
        return {(s.plan_id, r) for v in self.versions.values() for r, s in v.shards.items()}

    def plan(self, plan_id: str, rank: int) -> ShardPlan:
        found = self.plans.get((plan_id, rank))
        if found is None:
            raise LookupError(f"node {self.node[:12]}: no plan {plan_id[:8]} of rank {rank}")
        return found[0]

    # --- lending segments to this host's ranks ----------------------------------------------
    def lend(self, rank: int, nbytes: int) -> Lent:
        """A free segment of rank ``rank`` of exactly ``nbytes``; new ones count against the
        budget (MemoryError past it, after letting go of this rank's free ones of other sizes)."""
        for lent in self.lent.values():
            if lent.rank == rank and lent.state == "free" and lent.seg.nbytes == nbytes:
                lent.state = "staging"
                return lent
        # none fits: the rank's plan changed (a restore, a new structure), so its free ones of
        # other sizes would only sit on the budget until room runs out
        for seg_id in [i for i, x in self.lent.items() if x.rank == rank and x.state == "free"]:
            self._forget_lent(seg_id)
        self.make_room(nbytes)
        seg = self.pool.reserve(nbytes)
        lent = self.lent[seg.id] = Lent(seg, rank, "staging")
        return lent

    def make_room(self, nbytes: int) -> None:
        """Before reserving ``nbytes``: if they do not fit, let go of every free lent segment
        (staging memory of any rank, holding nothing): they count against the budget too."""
        if not self.pool.fits(nbytes):
            for seg_id in [i for i, x in self.lent.items() if x.state == "free"]:
                self._forget_lent(seg_id)

    def new_epoch(self, ranks_here) -> None:
        """A new rendezvous: the previous epoch's processes are gone (fenced), so segments lent
        to them and not holding a kept shard are let go; those holding one go when it does,
        unless a rank of this epoch on this node has the same number (it reuses them)."""
        self.active_ranks = frozenset(ranks_here)
        for seg_id in [i for i, x in self.lent.items() if x.state in ("free", "staging")]:
            self._forget_lent(seg_id)
        used = self._used_plans()
        self.plans = {k: p for k, p in self.plans.items() if k in used}
        self.forgotten = {r: ids for r, ids in self.forgotten.items() if r in self.active_ranks}

    def give_back(self, seg_id: int) -> None:
        lent = self.lent.get(seg_id)
        if lent is not None and lent.state == "staging":
            lent.state = "free"

    def _forget_lent(self, seg_id: int) -> None:
        lent = self.lent.pop(seg_id)
        self.pool.held -= lent.seg.nbytes
        lent.seg.close()
        self.forgotten.setdefault(lent.rank, []).append(seg_id)

    # --- versions ---------------------------------------------------------------------------
    def version(self, epoch: int, step: int, *, world_size: int = 0, create: bool = True) -> Optional[Version]:
        """The version of ``step`` in ``epoch``; one of an older epoch is replaced (a step
        saved again after restoring an older version), one of a newer epoch wins (None)."""
        v = self.versions.get(step)
        if v is not None and v.epoch == epoch:
            return v
        if v is not None and v.epoch > epoch:
            return None
        if not create:
            return None
        if v is not None:
            self.release(v, force=True)
        v = self.versions[step] = Version(epoch, step, world_size=world_size)
        return v

    def stage(self, v: Version, rank: int, seg_id: int, plan: ShardPlan, *, owner: int) -> Shard:
        """The segment lent to ``rank`` now holds its shard of ``v`` (the record follows)."""
        lent = self.lent.get(seg_id)
        if lent is None or lent.rank != rank or lent.state != "staging":
            raise ValueError(f"node {self.node[:12]}: segment {seg_id} is not lent to rank {rank} for staging")
        old = v.shards.get(rank)
        if v.state is not VersionState.PENDING or (old is not None and old.received):
            # a version is staged once: a second writer of the same rank (a zombie) replaces nothing
            raise ValueError(f"node {self.node[:12]}: step {v.step} ({v.state}) already holds rank {rank}'s shard")
        if old is not None:
            self._free_shard(old)
        lent.state = "held"
        shard = v.shards[rank] = Shard(rank, owner, lent.seg, True, plan.plan_id, received=True)
        return shard

    def receive(self, v: Version, rank: int, owner: int, nbytes: int) -> Shard:
        """A replica segment for a peer's shard (MemoryError over budget)."""
        old = v.shards.get(rank)
        if old is not None and old.received:
            raise ValueError(f"node {self.node[:12]}: step {v.step} already holds rank {rank}'s shard")
        if old is not None:
            self._free_shard(old)
        self.make_room(nbytes)
        seg = self.pool.reserve(nbytes)
        shard = v.shards[rank] = Shard(rank, owner, seg, False)
        return shard

    def drop_shard(self, v: Version, shard: Shard) -> None:
        """Forget one copy of ``v`` (a re-replicated copy that failed its check)."""
        if v.shards.get(shard.rank) is shard:
            del v.shards[shard.rank]
            self._free_shard(shard)

    def release(self, v: Version, *, force: bool = False) -> int:
        """Let ``v`` go (retention, abort, discard). A pinned version (persist) waits for
        :meth:`unpin` unless ``force``. Returns the bytes freed or left to free."""
        if v.persist and not force:
            v.released = True
            return 0
        if self.versions.get(v.step) is v:
            del self.versions[v.step]
        freed = 0
        for shard in v.shards.values():
            freed += shard.seg.nbytes
            self._free_shard(shard)
        v.shards = {}
        return freed

    def unpin(self, step: int) -> None:
        v = self.versions.get(step)
        if v is None:
            return
        v.persist = False
        if v.released:
            self.release(v)

    def _free_shard(self, shard: Shard) -> None:
        if shard.users:
            shard.dropped = True
            return
        if shard.lent:
            lent = self.lent.get(shard.seg.id)
            if lent is not None:
                lent.state = "free"
                if self.active_ranks is not None and lent.rank not in self.active_ranks:
                    self._forget_lent(shard.seg.id)  # its rank is elsewhere now: nobody reuses it
        else:
            self.pool.release(shard.seg)

    def use(self, shard: Shard) -> None:
        shard.users += 1

    def done_with(self, shard: Shard) -> None:
        shard.users -= 1
        if shard.dropped and not shard.users:
            shard.dropped = False
            self._free_shard(shard)

    # --- views -----------------------------------------------------------------------------
    def index(self) -> dict[int, dict]:
        return {
            step: {
                "epoch": v.epoch,
                "state": v.state,
                "world_size": v.world_size,
                "unhealthy": v.unhealthy,
                "shards": {
                    r: {
                        "owner": s.owner,
                        "complete": s.complete,
                        "plan_id": s.plan_id,
                        "nbytes": s.seg.nbytes,
                        "health": _health(s),
                    }
                    for r, s in v.shards.items()
                },
            }
            for step, v in self.versions.items()
        }

    def unhealthy_steps(self) -> list[int]:
        """Steps whose decision, or a record of a shard held here, says the state is unhealthy."""
        return [
            step
            for step, v in self.versions.items()
            if v.unhealthy or any(_health(s)["status"] == "unhealthy" for s in v.shards.values())
        ]

    def held_bytes(self) -> int:
        return sum(s.seg.nbytes for v in self.versions.values() for s in v.shards.values())

    def memory(self) -> dict:
        """Where the budget goes, in bytes (``gemini_ckpt status --json``): the shards of kept
        versions (``own``: staged here by this node's ranks; ``replicas``: peers' copies),
        staging segments lent to this node's ranks (``staging``: being filled; ``lent_free``:
        kept for the rank's next save), buffers kept for reuse (``pooled``), and ``other``: held
        for none of these (shards a reader still maps after their version went). ``reserved`` is
        their sum, what counts against ``budget``."""
        own = replicas = 0
        for v in self.versions.values():
            for shard in v.shards.values():
                if shard.lent:
                    own += shard.seg.nbytes
                else:
                    replicas += shard.seg.nbytes
        by_state = {"staging": 0, "free": 0}
        for lent in self.lent.values():
            if lent.state in by_state:
                by_state[lent.state] += lent.seg.nbytes
        pool = self.pool
        return {
            "own": own,
            "replicas": replicas,
            "staging": by_state["staging"],
            "lent_free": by_state["free"],
            "pooled": pool.pooled,
            "other": pool.held - own - replicas - by_state["staging"] - by_state["free"],
            "reserved": pool.held + pool.pooled,
            "budget": pool.budget_bytes,
            "segments_made": pool.created,
        }


def _health(shard: Shard) -> dict:
    """What the shard's record says of its health (``unchecked`` before the record is here)."""
    health = shard.record.health if shard.record is not None else None
    return (
        {"status": "unchecked", "reason": ""} if health is None else {"status": health.status, "reason": health.reason}
    )
