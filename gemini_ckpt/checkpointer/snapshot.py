"""The first phase of a save, on the training thread: plan, judge, stage into store memory.

One :class:`Snapshot` per Checkpointer owns what that phase needs between saves: the sources
(:mod:`gemini_ckpt.save.sources`), the stager (the one copy, :mod:`gemini_ckpt.save.stager`), the
overlap copier (``staging="overlap"``, :mod:`.overlapped`), the metric history of the health
check, and the restored version's plan until the first save decides on it. :meth:`Snapshot.take`
captures the sources; the first version, and a version whose structure changed, plan with DCP
first (the only collective saving runs, or the restored version's plan taken over); the tensors
are copied into a free segment of the memory tier and the segment is handed to the tier.
:meth:`Snapshot.record` books the stall in the stats.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..collective import everyones
from ..settings import SaveSettings
from ..faults import fire
from ..health import Health, MetricHistory
from ..results import CheckpointStats, Phases, SaveHandle, StageInfo
from ..save.checked import checked_items
from ..save.plan import adopt, adoptable, make_plan, signature
from ..save.sources import Sources
from ..save.stager import Stager, check_saveable
from ..state.dcp import flatten
from ..state.train_state import TrainState
from ..stores.base import MemoryTier
from .overlapped import OverlapCopier
from .tiers import job_description

log = logging.getLogger("gemini_ckpt")

SLOW_SAVE_S = 1.0
"""A save() that stalls training longer than this (and 10x its average) is logged with its phases."""


@dataclass
class Taken:
    """One version's snapshot, handed to the store: the tier's outcome (a future), the stall
    so far, the plan it was staged by and its phases."""

    outcome: Any
    stall: float
    plan: Any
    phases: Phases


class Snapshot:
    """The snapshot phase of :meth:`~gemini_ckpt.Checkpointer.save` (see the module docstring)."""

    def __init__(
        self, state: TrainState, settings: SaveSettings, stats: CheckpointStats, *, rank: int, world_size: int
    ) -> None:
        self.state, self.settings, self.stats = state, settings, stats
        self.rank, self.world_size = rank, world_size
        self.sources = Sources(state, rank)
        self.stager = Stager()
        self.overlap = OverlapCopier(state, self.sources, self.stager, stats, rank=rank, timeout_s=settings.timeout_s)
        check = settings.health_check
        self.history = MetricHistory(check.metrics) if check is not None else None
        self.restored_plan = None  # the restored version's shard plan, until the first save decides on it
        self.store: Optional[MemoryTier] = None
        self.group, self.run_id = None, ""

    def start(self, store: MemoryTier, *, group, run_id: str) -> None:
        """The memory tier to stage into, the background group and the job's run id (at start)."""
        self.store, self.group, self.run_id = store, group, run_id

    def wait_copy(self) -> None:
        """The previous version's overlapped copy (done by now, unless no optimizer step ran)."""
        self.overlap.wait_copy()

    def stop(self) -> None:
        self.overlap.stop()

    def take(self, step: int, *, due: bool, metrics: dict, handle: SaveHandle, t0: float) -> Taken:
        """Capture, plan if needed, judge, and stage version ``step`` into a segment the tier
        lent; the segment is the tier's (or the copying thread's) once this returns, and given
        back when anything fails before."""
        phases = Phases(t0)
        captured = self.sources.capture()
        if captured is None:
            captured = self._plan()
            phases.mark("plan")
        self.stats.state_dicts = self.sources.rebuilt
        tensors, blobs = captured
        plan = self.sources.plan
        check = self.settings.health_check
        verdict = check.judge(step, self.state, metrics, self.history) if check is not None else None
        phases.mark("check")
        segment = self.store.segment(plan.shard)
        try:
            phases.mark("segment")
            behind = self.overlap.behind(tensors) if self.settings.overlap else []
            if behind:
                outcome = self.overlap.stage(
                    self.store, step, plan, segment, tensors, blobs, behind, due, verdict, handle, phases, t0
                )
                return Taken(outcome, time.perf_counter() - t0, plan, phases)
            return self._stage(step, plan, segment, tensors, blobs, due, verdict, handle, phases, t0)
        except BaseException:
            self.store.give_back(segment)
            raise

    def _stage(self, step, plan, segment, tensors, blobs, due: bool, verdict: Optional[Health], handle, phases, t0):
        """Copy every tensor into ``segment`` and hand it to the memory tier."""
        sources = self.sources
        self.stager.stage(plan.shard, segment, tensors, generation=sources.generation, volatile=sources.volatile)
        phases.mark("copy")
        fire("replicate", step=step, rank=self.rank)
        # Handed off before save() returns: a training process that dies right after still
        # leaves a whole shard with its host store, which commits the version without it.
        outcome = self.store.hand_off(step, plan.shard, segment, blobs, persist=due, verdict=verdict)
        phases.mark("hand_off")
        stall = time.perf_counter() - t0
        handle.staged.set_result(
            StageInfo(step=step, stall_s=stall, staged_bytes=plan.shard.region_bytes, phases=phases.done())
        )
        return Taken(outcome, stall, plan, phases)

    def _plan(self):
        """Plan the state with every rank (a collective) and bind the sources to the new plan;
        the first save after a restore takes the restored version's plan over instead when every
        rank can (no planning collective, no new templates: seconds for a large state)."""
        state_dict = self.sources.live_state()
        restored, self.restored_plan = self.restored_plan, None
        rank, world_size, group = self.rank, self.world_size, self.group
        job = job_description(self.settings, world_size=world_size)
        plan = None
        if restored is not None:
            flat = flatten(state_dict)
            sig = signature(flat)
            ok = adoptable(restored, sig, rank=rank, world_size=world_size, job=job)
            if all(everyones(ok, world_size=world_size, group=group)):
                log.info("rank %d: this save takes over the plan of the restored version", rank)
                plan = adopt(restored, sig, run_id=self.run_id, job=job)
        if plan is None:
            plan, flat = make_plan(state_dict, rank=rank, world_size=world_size, group=group, job=job)
            self.stats.plans += 1
            log.info(
                "rank %d: planned the snapshot (%d tensor items, %d values, %.1f MB per version)",
                rank,
                len(plan.shard.tensors),
                len(plan.shard.values),
                plan.shard.region_bytes / 1e6,
            )
        captured = self._bind(plan, flat)
        # DESIGN's invariant: the footprint is known (and over budget refused) before anything is staged
        sizes = everyones(self.sources.plan.shard.region_bytes, world_size=world_size, group=group)
        self.stats.footprint = self.store.footprint(
            dict(enumerate(sizes)), self.settings.keep + self.settings.max_inflight
        )
        return captured

    def _bind(self, plan, flat: dict):
        """Bind the sources to ``plan`` (made from, or checked against, the live state ``flat``)."""
        for index in plan.tensor_index:
            value = flat[index.fqn]
            check_saveable(index.fqn, value._local_tensor if hasattr(value, "_local_tensor") else value)
        # The store checks the items the plan names: only here do we know parameters from buffers.
        checked = checked_items(plan, flat, self.state, self.settings.health_check)
        plan.shard = dataclasses.replace(plan.shard, checked=checked)
        return self.sources.bind(plan, flat)

    def record(self, step: int, taken: Taken) -> None:
        """Book a save's stall in the stats; log one that stalled training far longer than usual."""
        s, stall, phases = self.stats, taken.stall, taken.phases
        if s.saves >= 2 and stall > max(SLOW_SAVE_S, 10 * s.total_stall_s / s.saves):
            log.warning(
                "rank %d: save(%d) stalled training %.2fs (%.3fs per save so far): %s",
                self.rank,
                step,
                stall,
                s.total_stall_s / s.saves,
                ", ".join(f"{n} {t:.3f}s" for n, t in phases.done()),
            )
        s.saves += 1
        s.last_stall_s = stall
        s.last_phases = phases.done()
        s.total_stall_s += stall
        s.staging_bytes = taken.plan.shard.region_bytes
        s.staging_allocations = self.store.allocations
