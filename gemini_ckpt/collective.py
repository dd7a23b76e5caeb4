"""The two small collectives every rank-agreement uses: rank 0's value everywhere, and every rank's
value everywhere (Python objects, over the group the caller names; a no-op at world size 1)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank0s(value: Any, *, world_size: int, group=None) -> Any:
    """Rank 0's ``value`` on every rank (``value`` on other ranks is ignored)."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def everyones(value: Any, *, world_size: int, group=None) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    if world_size == 1:
        return [value]
    out: list = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out
