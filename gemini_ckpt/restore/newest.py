"""The newest healthy version: survey the tiers (rank 0's survey, walked by every rank), then
try each candidate newest first (memory before durable at equal steps) through
:func:`~gemini_ckpt.restore.version.load_version` until one loads.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import replace
from typing import Any, Optional

from ..collective import everyones
from ..settings import RestoreSettings
from ..errors import (
    CheckpointError,
    ChecksumError,
    ConfigError,
    UnhealthyCandidate,
    UnhealthyVersionError,
    UnreadableCandidate,
    VersionNotFoundError,
)
from ..faults import fire
from ..results import RestoreResult
from ..state.train_state import TrainState
from .version import Restored, load_version, short

log = logging.getLogger("gemini_ckpt")


class UnhealthyRestoreWarning(UserWarning):
    """``restore(step=...)`` loaded a version whose state failed its health checks, as asked."""


def survey(tiers: list, *, prefetch: bool = False) -> tuple[list[tuple[int, tuple[int, ...]]], dict[str, str]]:
    """What every tier holds: ``([(step, tier indices holding it, in tier order)] newest first,
    {tier name: why it could not be listed})``. A tier that cannot be listed (storage
    unreachable) is left out and named, never taken for an empty one. ``prefetch``: each tier's
    :meth:`~gemini_ckpt.stores.base.Tier.survey_state` follows (the tier may fetch for it now)."""
    held: dict[int, list[int]] = {}
    unreachable: dict[str, str] = {}
    for i, tier in enumerate(tiers):
        try:
            steps = tier.survey_steps() if prefetch else tier.committed_steps()
        except OSError as exc:
            unreachable[tier.name] = f"{type(exc).__name__}: {exc}"
            log.warning("the %s tier cannot be listed: %s", tier.name, unreachable[tier.name])
            continue
        for step in steps:
            held.setdefault(step, []).append(i)
    return [(step, tuple(held[step])) for step in sorted(held, reverse=True)], unreachable


def restore_newest(
    state: TrainState,
    tiers: list,
    *,
    rank: int,
    world_size: int,
    group,
    settings: RestoreSettings,
    marks: Optional[list] = None,
    step: Optional[int] = None,
    surveyed: Optional[tuple] = None,
) -> Restored:
    """Try versions newest first (memory before durable at equal steps) until a healthy one loads.

    Every rank walks rank 0's survey of the tiers (one collective), and DCP's load raises on
    every rank when any rank's read fails, so all ranks move to the next candidate together.
    A tier that cannot be listed is skipped; if nothing can be restored while one could not be
    listed, this raises :class:`CheckpointError` rather than report "no checkpoint" (which
    would start the job from scratch over versions it cannot see).

    ``marks``: the restore's timeline so far (``(stage, unix time)``), continued here and
    returned in :attr:`RestoreResult.timeline`. ``step``: only that version, healthy or not
    (every rank must ask for the same one); ``VersionNotFoundError`` when no tier holds it.
    ``surveyed``: rank 0's survey (:func:`take_survey`) already on every rank, every rank having
    asked for the same ``step`` (the start's collective carried it): no survey round here.
    Returns a :class:`~.version.Restored`: the result (None: nothing to restore), the steps the
    tiers held and the plan the first save may take over."""
    t0 = time.perf_counter()
    marks = list(marks) if marks else [("called", time.time())]
    if surveyed is None:
        named, order, unreachable = surveyed_by_rank0(tiers, step, rank=rank, world_size=world_size, group=group)
    else:
        named, (order, unreachable, _) = step, adopt_survey(tiers, surveyed, rank=rank)
    marks.append(("surveyed", time.time()))
    held = tuple(sorted(s for s, _ in order))  # every rank walks the same survey
    fire("restore", step=order[0][0] if order else None, rank=rank)
    if named is not None:
        order = [(s, holding) for s, holding in order if s == named]
        if not order:
            blind = "".join(f"; the {n} tier could not be listed ({why})" for n, why in unreachable.items())
            raise VersionNotFoundError(
                f"restore(step={named}): no tier holds a committed version of step {named} "
                f"(they hold {sorted(held)}){blind}"
            )
    skipped: list[int] = []
    reasons: list[str] = []
    why_skipped: dict[int, str] = {}
    unhealthy: list[int] = []
    for step, holding in order:
        name = tiers[holding[0]].name
        try:
            loaded = load_version(
                state,
                [tiers[i] for i in holding],
                step,
                rank=rank,
                world_size=world_size,
                group=group,
                settings=settings,
                t0=t0,
                marks=marks,
                allow_unhealthy=named is not None,
            )
        except UnhealthyCandidate as exc:
            if rank == 0:
                log.warning("skipping step %d from %s: it is unhealthy: %s", step, name, exc)
            skipped.append(step)
            unhealthy.append(step)
            why_skipped[step] = f"unhealthy: {short(str(exc))}"
            reasons.append(f"step {step} ({name}): unhealthy: {short(str(exc))}")
            continue
        except UnreadableCandidate as exc:
            warnings.warn(
                f"step {step} ({name}) could not be restored and was skipped: {exc}; "
                f"falling back to the next newest complete version",
                stacklevel=3,
            )
            log.warning("rank %d: skipping step %d from %s: %s", rank, step, name, exc)
            skipped.append(step)
            why_skipped[step] = short(str(exc))
            reasons.append(f"step {step} ({name}): {short(str(exc))}")
            continue
        if unreachable and rank == 0:
            log.warning(
                "restored step %d although the %s tier could not be listed (%s)",
                step,
                " and ".join(unreachable),
                "; ".join(unreachable.values()),
            )
        result = loaded.result
        if result.health is not None and result.health.unhealthy:
            warnings.warn(
                f"restored step {step}, whose state is UNHEALTHY ({result.health.reason}), because "
                f"restore(step={step}) asked for it; training on from it trains on that state",
                UnhealthyRestoreWarning,
                stacklevel=3,
            )
        return Restored(_with_skipped(result, skipped, why_skipped), held=held, plan=loaded.plan)
    blind = "".join(f"; the {n} tier could not be listed ({why})" for n, why in unreachable.items())
    if skipped and len(unhealthy) == len(skipped) and not unreachable:
        raise UnhealthyVersionError(
            f"no healthy version to restore: step(s) {skipped} are unhealthy: "
            + "; ".join(reasons)
            + f". restore(step={skipped[0]}) loads one anyway (for debugging); CheckpointConfig(overwrite=True) "
            f"starts afresh over them",
            step=skipped[0],
        )
    if skipped:
        raise ChecksumError(
            f"no committed version could be restored; tried steps {skipped}{blind}: " + "; ".join(reasons)
        )
    if unreachable:
        raise CheckpointError(
            f"nothing to restore from the readable tiers{blind}. Refusing to report 'no checkpoint' "
            f"(which would start training from scratch): make the storage reachable and restore "
            f"again, or remove CheckpointConfig.durable_uri to start without it"
        )
    return Restored(None, held=held)


def surveyed_by_rank0(tiers: list, step: Optional[int], *, rank: int, world_size: int, group):
    """Rank 0's survey of the tiers, on every rank (one collective): ``(the step every rank named,
    [(step, tier indices)] newest first, {tier: why it could not be listed})``."""
    surveyed = take_survey(tiers, world_size=world_size) if rank == 0 or world_size == 1 else None
    named, surveyed = _agree(step, surveyed, rank, world_size, group)
    order, unreachable, _ = adopt_survey(tiers, surveyed, rank=rank)
    return named, order, unreachable


def take_survey(tiers: list, *, world_size: int) -> tuple:
    """Rank 0's survey, as every rank walks it: ``([(step, tier indices)] newest first, {tier:
    why it could not be listed}, each tier's state for the other ranks' reads)``."""
    order, unreachable = survey(tiers, prefetch=world_size > 1)
    states = [t.survey_state() if t.name not in unreachable else None for t in tiers] if world_size > 1 else []
    return order, unreachable, states


def adopt_survey(tiers: list, surveyed: tuple, *, rank: int) -> tuple:
    """Rank 0's survey taken over by this rank's tiers (its reads then need no calls of their own); returns it."""
    if rank != 0:
        for tier, shared in zip(tiers, surveyed[2]):
            tier.use_survey_state(shared)
    return surveyed


def _agree(step: Optional[int], surveyed, rank: int, world_size: int, group) -> tuple[Optional[int], Any]:
    """One collective: every rank must name the same ``restore(step=...)`` (all raise together
    when they do not), and all walk rank 0's survey (``surveyed``, None on the other ranks)."""
    everyone = everyones((step, surveyed if rank == 0 else None), world_size=world_size, group=group)
    steps = [named for named, _ in everyone]
    if len(set(steps)) > 1:
        raise ConfigError(
            f"restore(step=...) was called with different steps on different ranks "
            f"({dict(enumerate(steps))}); every rank must name the same version"
        )
    return step, everyone[0][1]


def _with_skipped(result: RestoreResult, skipped: list[int], reasons: dict[int, str]) -> RestoreResult:
    if not skipped:
        return result
    return replace(result, skipped_steps=tuple(skipped), skipped_reasons=dict(reasons))
