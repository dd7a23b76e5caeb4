"""A look at the version ``restore()`` would load, before the state to load it into exists: its
step and this rank's ``extra`` values, read and verified like any item, nothing else loaded.

A framework that creates its optimizer inside its own ``train()`` (Hugging Face's ``Trainer``)
needs its counters first; it peeks, builds the rest, then restores that step by name. Rank 0's
survey is walked by every rank, newest first, skipping what restore would skip (unhealthy,
unreadable); every rank agrees on each candidate (one collective per candidate).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..collective import everyones
from ..settings import RestoreSettings
from ..state.train_state import EXTRA, RANK_LOCAL, extra_from
from .newest import surveyed_by_rank0
from .opening import open_views
from .version import source_rank_of, short

log = logging.getLogger("gemini_ckpt")


@dataclass(frozen=True)
class Peeked:
    """What :meth:`~gemini_ckpt.Checkpointer.peek` found: the newest restorable version's
    ``step``, the tier it is in (``memory`` or ``durable``) and this rank's ``extra`` values."""

    step: int
    source: str
    extra: dict


def peek_newest(tiers: list, *, rank: int, world_size: int, group, settings: RestoreSettings) -> Optional[Peeked]:
    _, order, _ = surveyed_by_rank0(tiers, None, rank=rank, world_size=world_size, group=group)
    for step, holding in order:
        found, why = _peek_one([tiers[i] for i in holding], step, rank=rank, world_size=world_size, settings=settings)
        everyone = everyones(why, world_size=world_size, group=group)
        if not any(everyone):
            return found
        if rank == 0:
            log.info(
                "peek: step %d passed over: %s", step, "; ".join(f"rank {r}: {w}" for r, w in enumerate(everyone) if w)
            )
    return None


def _peek_one(
    tiers: list, step: int, *, rank: int, world_size: int, settings: RestoreSettings
) -> tuple[Optional[Peeked], Optional[str]]:
    views, problems = open_views(tiers, step, settings.key, settings.namespace)
    try:
        if not views:
            return None, "; ".join(problems) or "no tier opens it"
        primary = views[0]
        if primary.health.unhealthy:
            return None, f"unhealthy: {short(primary.health.reason)}"
        try:
            source_rank = source_rank_of(rank, primary.world_size, world_size, settings)
            key = f"{RANK_LOCAL}.{source_rank}.{EXTRA}"
            extra: Any = None
            errors = []
            for view in views:
                try:
                    extra = extra_from(view.read(MetadataIndex(key)))
                    break
                except Exception as exc:  # noqa: BLE001 - a damaged or missing item: the next view, then skip
                    errors.append(f"{view.tier}: {type(exc).__name__}: {exc}")
            else:
                return None, f"{key}: " + "; ".join(errors)
        except Exception as exc:  # noqa: BLE001 - whatever fails reading it means "skip it", as restore does
            return None, f"{type(exc).__name__}: {exc}"
        if not isinstance(extra, dict):
            return None, f"{key} holds a {type(extra).__name__}, not a dict"
        return Peeked(step=step, source=primary.tier, extra=extra), None
    finally:
        for view in views:
            view.close()
