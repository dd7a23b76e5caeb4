"""Retention: which versions a tier lets go of. Small policy objects, handed to the tier that
applies them (the memory tier at every commit, the durable tier after every persist).

- :class:`KeepNewest` keeps the newest ``count`` versions (``keep_in_memory``, ``keep_durable``);
- :class:`LeftToRayTrain` deletes nothing: the versions were reported to Ray Train, whose
  ``CheckpointConfig.num_to_keep`` decides (two owners deleting one directory would race).

Versions a caller protects (pinned by a running persist, named by ``latest``) are never chosen.

**Unhealthy versions never count** (:mod:`gemini_ckpt.health`): a tier names them, and
:class:`KeepNewest` keeps the newest ``count`` *healthy* versions plus, for inspection, the first
unhealthy version of the latest run of them (where the state went bad), while it is newer than
the oldest healthy version kept; every other unhealthy version goes at once. So a run that keeps
saving poisoned versions can never push its last good ones out, and holds at most one bad version
more than ``count``. The same rule decides in the host stores' commit protocol
(:mod:`gemini_ckpt.commit`), on version ids instead of steps. The durable tier never holds
an unhealthy version (they are not persisted), so its retention is told of none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, TypeVar

__all__ = ["KeepNewest", "LeftToRayTrain", "Retention"]  # the extension points; the rest is internal


S = TypeVar("S")  # a step, or anything ordered like one (the commit protocol's version ids)


class Retention(Protocol):
    def doomed(self, steps: Sequence[S], protected: Iterable[S] = (), unhealthy: Iterable[S] = ()) -> list[S]:
        """Of ``steps`` (any order), the ones to let go of, oldest first; ``unhealthy``: those of
        ``steps`` whose state failed its health checks (they must not count as kept versions)."""
        ...


@dataclass(frozen=True)
class KeepNewest:
    """Keep the newest ``count`` healthy versions, the first unhealthy version of the latest run
    of them (see the module docstring), and the protected ones."""

    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"KeepNewest.count: expected an int >= 1, got {self.count!r}")

    def doomed(self, steps: Sequence[S], protected: Iterable[S] = (), unhealthy: Iterable[S] = ()) -> list[S]:
        ordered = sorted(steps)
        bad = set(unhealthy)
        kept = set([s for s in ordered if s not in bad][-self.count :])
        # Only the first unhealthy version after the healthy ones kept is worth inspecting: where
        # the state went bad. Older ones are history; newer ones would only crowd memory.
        floor = min(kept) if len(kept) >= self.count else None
        # Worth inspecting: the version where the state last went bad. The rest of that run would
        # only crowd memory; an older run is history once it is older than every version kept.
        start, previous_bad = None, False
        for s in ordered:
            if s in bad and not previous_bad:
                start = s
            previous_bad = s in bad
        if start is not None and (floor is None or start > floor):
            kept.add(start)
        kept.update(protected)
        return [s for s in ordered if s not in kept]


@dataclass(frozen=True)
class LeftToRayTrain:
    """Delete nothing: Ray Train's ``num_to_keep`` owns the reported directories."""

    def doomed(self, steps: Sequence[S], protected: Iterable[S] = (), unhealthy: Iterable[S] = ()) -> list[S]:
        return []


def as_retention(keep) -> Retention:
    """A policy from a policy or a count (``keep=3`` is ``KeepNewest(3)``)."""
    if isinstance(keep, int) and not isinstance(keep, bool):
        return KeepNewest(keep)
    if not callable(getattr(keep, "doomed", None)):
        raise TypeError(f"retention: expected a count or a policy with doomed(steps, protected), got {keep!r}")
    return keep
