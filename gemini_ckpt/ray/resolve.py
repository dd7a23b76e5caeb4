"""Which steps the live host stores hold committed, and where each shard's copies are.

The reader's rule (see ``docs/commit.md``): a store marks a version committed only after the
coordinator decided COMMIT, so *committed at any live store* means committed. Such a version is
readable when every rank's shard has a complete copy on some live store that holds the same
version (same epoch) and has not aborted it: a holder that voted and is still waiting for the
decision (``prepared``), and a store with no ranks this epoch (whose copies stay ``pending``),
serve their copies too. When a step was saved in several epochs, the newest committed one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Resolved:
    """What the live stores hold of one step."""

    step: int
    epoch: int
    world_size: int
    committed: bool  # some live store committed this epoch's version and every shard has a copy
    copies: dict[int, tuple[int, ...]]  # rank -> slots with a complete copy, in read order
    lost: bool = False  # committed somewhere, but some rank's shard has no copy left


def resolve(index: dict[int, dict], *, local_slot: Optional[int] = None) -> dict[int, Resolved]:
    """``index``: slot -> that live store's ``index()``. Returns step -> :class:`Resolved`."""
    out: dict[int, Resolved] = {}
    steps = sorted({step for ix in index.values() for step in ix})
    for step in steps:
        entries = {slot: ix[step] for slot, ix in index.items() if step in ix}
        committed_epochs = sorted({e["epoch"] for e in entries.values() if e["state"] == "committed"})
        epoch = committed_epochs[-1] if committed_epochs else max(e["epoch"] for e in entries.values())
        same = {slot: e for slot, e in entries.items() if e["epoch"] == epoch and e["state"] != "aborted"}
        world = max((e["world_size"] for e in same.values()), default=0)
        copies: dict[int, list[tuple[tuple, int]]] = {}
        for slot, e in same.items():
            for rank, shard in e["shards"].items():
                if shard["complete"]:
                    order = (slot != local_slot, slot != shard["owner"], slot)
                    copies.setdefault(int(rank), []).append((order, slot))
        ordered = {rank: tuple(s for _, s in sorted(c)) for rank, c in copies.items()}
        whole = world > 0 and all(r in ordered for r in range(world))
        out[step] = Resolved(step, epoch, world, bool(committed_epochs) and whole, ordered,
                             lost=bool(committed_epochs) and not whole)
    return out
