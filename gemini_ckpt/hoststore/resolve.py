"""Which steps the live host stores hold committed, and where each shard's copies are.

The reader's rule (see ``docs/commit.md``): a store marks a version committed only after the
coordinator decided COMMIT, so *committed at any live store* means committed. Such a version is
readable when every rank's shard has a complete copy on some live store that holds the same
version (same epoch) and has not aborted it: a holder that voted and is still waiting for the
decision (``prepared``), and a store with no ranks this epoch (whose copies stay ``pending``),
serve their copies too. When a step was saved in several epochs, the newest committed one wins.

A version's health (:mod:`gemini_ckpt.health`) is what the stores say: ``unhealthy`` when the
decision or any shard's record says so, ``healthy`` when every rank's record says so, else
``unchecked``. Restore trusts only the signed records; this is for status and re-replication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..health import Health


@dataclass(frozen=True)
class Resolved:
    """What the live stores hold of one step."""

    step: int
    epoch: int
    world_size: int
    committed: bool  # some live store committed this epoch's version and every shard has a copy
    copies: dict[int, tuple[int, ...]]  # rank -> slots with a complete copy, in read order
    lost: bool = False  # committed somewhere, but some rank's shard has no copy left
    health: str = "unchecked"  # healthy | unhealthy | unchecked
    reason: str = ""  # why it is unhealthy


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
        health, reason = _health(same, world)
        out[step] = Resolved(
            step,
            epoch,
            world,
            bool(committed_epochs) and whole,
            ordered,
            lost=bool(committed_epochs) and not whole,
            health=health,
            reason=reason,
        )
    return out


def _health(entries: dict[int, dict], world: int) -> tuple[str, str]:
    said = {}  # rank -> (status, reason), from the records of complete copies
    for e in entries.values():
        if e.get("unhealthy"):
            try:
                return "unhealthy", Health.from_text(e["unhealthy"]).reason
            except ValueError:
                return "unhealthy", "a store says so, in a form this reader does not know"
        for rank, shard in e["shards"].items():
            health = shard.get("health") or {}
            if shard["complete"] and health.get("status"):
                said.setdefault(int(rank), (health["status"], health.get("reason", "")))
    bad = next((said[r] for r in sorted(said) if said[r][0] == "unhealthy"), None)
    if bad is not None:
        return bad
    if world > 0 and all(said.get(r, ("",))[0] == "healthy" for r in range(world)):
        return "healthy", ""
    return "unchecked", ""
