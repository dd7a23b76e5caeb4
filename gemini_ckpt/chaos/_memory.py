"""Faults in kept memory: a byte of a kept copy flipped, or a value overwritten (a NaN), in place,
after the version committed, as a bad DIMM or a stray write would leave it. The stores expose
the bytes they hold (``kept_bytes``); only this harness writes into them."""

from __future__ import annotations

from typing import Optional


def damage_copy(
    where, step: int, rank: int, offset: int, data: Optional[bytes] = None, *, slot: Optional[int] = None
) -> int:
    """Flip the byte at ``offset`` of a kept copy of rank ``rank``'s shard of ``step`` (or write
    ``data`` there, e.g. :data:`gemini_ckpt.format.finite.NAN_BITS` of a dtype); returns ``offset``.

    ``where``: a process-local store or tier (``store="local"``), a Ray tier (the copy of the
    store of ``slot``, else this node's, else the first holder's), or a host store's actor handle.

    Example::

        damage_copy(ckpt.store, step=2, rank=0, offset=item.at)   # the next restore must catch it
    """
    import ray

    def write(store, step, rank, offset, data):  # by value into a host store's process: no imports
        held = store.kept_bytes(step, rank)
        if data is None:
            held[offset] ^= 0xFF
        else:
            held[offset : offset + len(data)] = memoryview(data).cast("B")
        return offset

    if isinstance(where, ray.actor.ActorHandle):
        return ray.get(where.__ray_call__.remote(write, step, rank, offset, data), timeout=60)
    if hasattr(where, "holder"):  # a Ray tier
        return damage_copy(where.holder(step, rank, slot=slot), step, rank, offset, data)
    return write(getattr(where, "store", where), step, rank, offset, data)  # a local tier, or its store
