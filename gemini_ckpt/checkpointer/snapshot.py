"""The first phase of a save, on the training thread: plan, judge, stage into store memory.

The sources are captured (:mod:`gemini_ckpt.save.sources`); the first version, and a version
whose structure changed, plan with DCP first (:func:`plan_snapshot`, the only collective
saving runs, or the restored version's plan taken over); the tensors are copied into a free
segment of the memory tier (:func:`stage`, :mod:`gemini_ckpt.save.stager`) and the segment is
handed to the tier. :class:`Phases` times each step for ``StageInfo.phases``;
:func:`record_save` books the stall in the stats.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

from ..collective import everyones
from ..config import CheckpointConfig
from ..faults import fire
from ..health import Health, HealthCheck, MetricHistory
from ..results import CheckpointStats, SaveHandle, StageInfo
from ..save.checked import checked_items
from ..save.plan import adopt, adoptable, make_plan, signature
from ..save.sources import Sources
from ..state.dcp import flatten
from ..save.stager import Stager, check_saveable
from ..state.train_state import TrainState
from ..stores.base import MemoryTier

log = logging.getLogger("gemini_ckpt")

SLOW_SAVE_S = 1.0
"""A save() that stalls training longer than this (and 10x its average) is logged with its phases."""


class Phases:
    """Wall time of the phases of one save() (``StageInfo.phases``)."""

    def __init__(self, t0: float) -> None:
        self._last, self._marks = t0, []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._marks.append((name, now - self._last))
        self._last = now

    def done(self) -> tuple:
        return tuple(self._marks)


def plan_snapshot(state_dict: dict, restored, sources: Sources, state: TrainState, config: CheckpointConfig,
                  stats: CheckpointStats, *, rank: int, world_size: int, group, run_id: str, job: dict):
    """Plan the state with every rank (collective) and bind the sources to the new plan; the
    first save after a restore takes the restored version's plan over instead when every
    rank can (no planning collective, no new templates: seconds for a large state)."""
    if restored is not None:
        flat = flatten(state_dict)
        sig = signature(flat)
        ok = adoptable(restored, sig, rank=rank, world_size=world_size, job=job)
        ok = all(everyones(ok, world_size=world_size, group=group))
        if ok:
            log.info("rank %d: this save takes over the plan of the restored version", rank)
            return bind_plan(adopt(restored, sig, run_id=run_id, job=job), flat, sources, state, config.health_check)
    plan, flat = make_plan(state_dict, rank=rank, world_size=world_size, group=group, job=job)
    stats.plans += 1
    log.info("rank %d: planned the snapshot (%d tensor items, %d values, %.1f MB per version)", rank,
             len(plan.shard.tensors), len(plan.shard.values), plan.shard.region_bytes / 1e6)
    return bind_plan(plan, flat, sources, state, config.health_check)


def bind_plan(plan, flat: dict, sources: Sources, state: TrainState, check: Optional[HealthCheck]):
    """Bind the sources to ``plan`` (made from, or checked against, the live state ``flat``)."""
    for index in plan.tensor_index:
        value = flat[index.fqn]
        check_saveable(index.fqn, value._local_tensor if hasattr(value, "_local_tensor") else value)
    # The store checks the items the plan names: only here do we know parameters from buffers.
    plan.shard = dataclasses.replace(plan.shard, checked=checked_items(plan, flat, state, check))
    return sources.bind(plan, flat)


def judge(check: Optional[HealthCheck], step: int, state: TrainState, metrics: dict,
          history: Optional[MetricHistory]) -> Optional[Health]:
    """The trainer's part of the health check (metrics, validator): None when it is off."""
    if check is None:
        return None
    return check.judge(step, state, metrics, history)


def stage(store: MemoryTier, stager: Stager, sources: Sources, step: int, plan, segment, tensors: list,
          blobs: list, *, due: bool, verdict, handle: SaveHandle, phases: Phases, t0: float,
          rank: int) -> tuple:
    """Copy every tensor into ``segment`` and hand it to the memory tier: (its outcome, the stall)."""
    stager.stage(plan.shard, segment, tensors, generation=sources.generation, volatile=sources.volatile)
    phases.mark("copy")
    fire("replicate", step=step, rank=rank)
    # Handed off before save() returns: a training process that dies right after still
    # leaves a whole shard with its host store, which commits the version without it.
    outcome = store.hand_off(step, plan.shard, segment, blobs, persist=due, verdict=verdict)
    phases.mark("hand_off")
    stall = time.perf_counter() - t0
    handle.staged.set_result(StageInfo(step=step, stall_s=stall, staged_bytes=plan.shard.region_bytes,
                                       phases=phases.done()))
    return outcome, stall


def record_save(stats: CheckpointStats, store: MemoryTier, plan, phases: Phases, *, step: int, stall: float,
                rank: int) -> None:
    """Book a save's stall in the stats; log one that stalled training far longer than usual."""
    s = stats
    if s.saves >= 2 and stall > max(SLOW_SAVE_S, 10 * s.total_stall_s / s.saves):
        log.warning("rank %d: save(%d) stalled training %.2fs (%.3fs per save so far): %s", rank, step,
                    stall, s.total_stall_s / s.saves, ", ".join(f"{n} {t:.3f}s" for n, t in phases.done()))
    s.saves += 1
    s.last_stall_s = stall
    s.last_phases = phases.done()
    s.total_stall_s += stall
    s.staging_bytes = plan.shard.region_bytes
    s.staging_allocations = store.allocations
