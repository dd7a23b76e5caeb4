"""``Checkpointer.restore()``'s orchestration around :func:`gemini_ckpt.restore.restore_newest`.

The tiers are tried in order (memory, then durable); a fresh job with ``init_from`` seeds
from a stock checkpoint instead; the restored version becomes the lineage's newest (versions
newer than it are discarded before the next save) and its shard plan is offered to the first
save.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from ..settings import RestoreSettings
from ..lineage import Lineage
from ..restore import restore_newest
from ..results import RestoreResult
from ..state.train_state import RandomState, TrainState, capture_rng, restore_rng_state
from ..stores.base import MemoryTier

log = logging.getLogger("gemini_ckpt")


def restore_version(
    state: TrainState,
    tiers: list,
    settings: RestoreSettings,
    lineage: Lineage,
    *,
    rank: int,
    world_size: int,
    group,
    marks: list,
    step: Optional[int],
    rng: bool = True,
    surveyed: Optional[tuple] = None,
) -> tuple[Optional[RestoreResult], object]:
    """Load the newest healthy version (or ``step``) into ``state``: (the result or None, the
    restored version's shard plan, which the first save may take over). ``rng=False``: the
    process's random number generators are left as they were, the restored ones kept in the result.
    ``tiers``: the memory tier, then the durable one if any (the order ``surveyed`` indexes);
    ``surveyed``: rank 0's survey of these tiers, already on every rank (taken at the start)."""
    before = None if rng else capture_rng()
    store: MemoryTier = tiers[0]
    found = restore_newest(
        state,
        tiers,
        rank=rank,
        world_size=world_size,
        group=group,
        settings=settings,
        marks=marks,
        step=step,
        surveyed=surveyed,
    )
    result = found.result
    if result is None and settings.init_from and step is None:
        from ..init_from import init_from

        result = init_from(state, settings.init_from, rank=rank, world_size=world_size, group=group)
    if before is not None and result is not None:
        result = dataclasses.replace(result, rng_state=RandomState(capture_rng()))
        restore_rng_state(before)
    if result is not None and store.recovery:
        result = dataclasses.replace(result, recovery=store.recovery)
    if result is not None:
        log.info("rank %d: %s", rank, result.summary())
        # Continue from here: versions newer than this one (damaged, or abandoned) are
        # discarded before the next save is written, and never restored later.
        lineage.restored_to(result.step, found.held)  # what the tiers held (the survey every rank walked)
    return result, found.plan
