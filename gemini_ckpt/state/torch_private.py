"""The private names of torch we use, one adapter each, so that a torch upgrade that moves one
breaks this module only. Each says why the public API does not do, and what happens without it.

(DCP's ``_StorageInfo`` is part of DCP's file format: the persister writes it into ``.metadata``
and the metadata allow-list names it; those are its users, not adapters. The data loader's
``_get_iterator`` hook has its own module, :mod:`.loader`.)
"""

from __future__ import annotations

from typing import Any, Optional


def narrow_to_chunk(tensor, offsets, lengths):
    """The chunk ``[offsets, offsets + lengths)`` of ``tensor`` as a view: what DCP's own reader
    does for a read request into a bigger saved item (torch has no public name for it)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, lengths)


def set_in_state_dict(root: dict, path: Any, value: Any) -> None:
    """Put ``value`` at DCP's flattening ``path`` of a nested state dict: the inverse of DCP's
    flattening, which the load planner's ``mappings`` refer to (DCP keeps it private)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def default_store() -> Optional[Any]:
    """The key-value store every rank of the default process group shares, or None. torch gives
    no public handle on it; without it, ranks that need one fall back to their timeout."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a private API: its absence is not an error
        return None
