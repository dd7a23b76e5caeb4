"""Retention: which versions a tier lets go of. Small policy objects, handed to the tier that
applies them (the memory tier at every commit, the durable tier after every persist).

- :class:`KeepNewest` keeps the newest ``count`` versions (``keep_in_memory``, ``keep_durable``);
- :class:`LeftToRayTrain` deletes nothing: the versions were reported to Ray Train, whose
  ``CheckpointConfig.num_to_keep`` decides (two owners deleting one directory would race).

Versions a caller protects (pinned by a running persist, named by ``latest``) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence


class Retention(Protocol):
    def doomed(self, steps: Sequence[int], protected: Iterable[int] = ()) -> list[int]:
        """Of ``steps`` (any order), the ones to let go of, oldest first."""
        ...


@dataclass(frozen=True)
class KeepNewest:
    """Keep the newest ``count`` versions (and the protected ones)."""

    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"KeepNewest.count: expected an int >= 1, got {self.count!r}")

    def doomed(self, steps: Sequence[int], protected: Iterable[int] = ()) -> list[int]:
        keep = set(protected)
        return [s for s in sorted(steps)[: -self.count] if s not in keep]


@dataclass(frozen=True)
class LeftToRayTrain:
    """Delete nothing: Ray Train's ``num_to_keep`` owns the reported directories."""

    def doomed(self, steps: Sequence[int], protected: Iterable[int] = ()) -> list[int]:
        return []


def as_retention(keep) -> Retention:
    """A policy from a policy or a count (``keep=3`` is ``KeepNewest(3)``)."""
    if isinstance(keep, int) and not isinstance(keep, bool):
        return KeepNewest(keep)
    if not callable(getattr(keep, "doomed", None)):
        raise TypeError(f"retention: expected a count or a policy with doomed(steps, protected), got {keep!r}")
    return keep
