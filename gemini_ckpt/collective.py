"""The two small collectives every rank-agreement uses: rank 0's value everywhere, and every rank's
value everywhere (Python objects, over the group the caller names; a no-op at world size 1)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

INLINE_BYTES = 4096
"""A value whose pickle fits in this many bytes travels in :func:`everyones`' one round (the
agreements' verdicts do); a longer one takes a second round: a broadcast from its rank when it
is the only one (rank 0's survey), else an ``all_gather`` of the longest's size."""
_HEAD = 8  # the pickle's length, ahead of the inline bytes


def rank0s(value: Any, *, world_size: int, group=None) -> Any:
    """Rank 0's ``value`` on every rank (``value`` on other ranks is ignored)."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def everyones(value: Any, *, world_size: int, group=None) -> list:
    """Every rank's ``value``, in rank order, on every rank.

    Over gloo, one ``all_gather`` of fixed-size buffers carries each rank's pickle when it fits
    :data:`INLINE_BYTES` (``all_gather_object`` always takes two rounds: the sizes, then the
    bytes; a rank-agreement is on every restore's and first save's critical path). The pickles
    come from the ranks of this job's process group, as ``all_gather_object``'s do."""
    if world_size == 1:
        return [value]
    if dist.get_backend(group) != "gloo":  # NCCL and others gather through the device
        out: list = [None] * world_size
        dist.all_gather_object(out, value, group=group)
        return out
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    mine = torch.zeros(_HEAD + INLINE_BYTES, dtype=torch.uint8)
    view = mine.numpy()
    view[:_HEAD] = np.frombuffer(len(data).to_bytes(_HEAD, "little"), dtype=np.uint8)
    if len(data) <= INLINE_BYTES:
        view[_HEAD : _HEAD + len(data)] = np.frombuffer(data, dtype=np.uint8)
    heads = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(heads, mine, group=group)
    sizes = [int.from_bytes(h.numpy()[:_HEAD].tobytes(), "little") for h in heads]
    longest = max(sizes)
    if longest <= INLINE_BYTES:
        return [pickle.loads(h.numpy()[_HEAD : _HEAD + n].tobytes()) for h, n in zip(heads, sizes)]
    long = [r for r, n in enumerate(sizes) if n > INLINE_BYTES]
    if len(long) == 1:  # one long value (rank 0's survey): sent once, not gathered padded from every rank
        (src,) = long
        whole = torch.empty(sizes[src], dtype=torch.uint8)
        if dist.get_rank(group) == src:
            whole.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        dist.broadcast(whole, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
        wholes = [whole if r == src else heads[r][_HEAD:] for r in range(world_size)]
    else:
        whole = torch.zeros(longest, dtype=torch.uint8)
        whole.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        wholes = [torch.empty_like(whole) for _ in range(world_size)]
        dist.all_gather(wholes, whole, group=group)
    return [pickle.loads(w.numpy()[:n].tobytes()) for w, n in zip(wholes, sizes)]
