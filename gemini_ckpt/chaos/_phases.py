"""When a chaos fault strikes: the phases (:data:`PHASES`), the moment (:class:`At`) and the
rules a rank process follows at a phase (:class:`HookRule`); with :class:`ScenarioError` and the
field checks every scenario class uses, since this is the bottom of the scenario's
specification (faults and conditions in :mod:`._faults`, the scenario and the job in
:mod:`._spec`). Plain frozen dataclasses; nothing here starts a process or touches Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from placement import LAYOUTS

from ..faults import PHASES as LIBRARY_PHASES

STEP = "step"
STORE_PHASES = ("commit",)
"""Phases of a host store: ``"commit"``, the host store of rank 0's host holds its yes vote
(every copy of its ranks' shards acknowledged) before the coordinator decides."""
PHASES = (STEP,) + LIBRARY_PHASES[:1] + STORE_PHASES + LIBRARY_PHASES[1:]
"""Where a fault can strike: ``"step"`` (at the step boundary, after the step's version was
committed, and persisted when due), one of the training process's phases
(:mod:`gemini_ckpt.faults`) or a host store's (:data:`STORE_PHASES`)."""
COORDINATOR_PHASES = ("commit", "persist", "persist_commit")
"""Phases held on rank 0 (its host store, or its persister)."""
PERSIST_PHASES = ("persist", "persist_commit")
PLACEMENTS = LAYOUTS


class ScenarioError(ValueError):
    """A scenario that cannot be run as written; the message names the field and the fix."""


def host_indices(name: str, value) -> tuple[int, ...]:
    """``value`` as distinct host (or rank) indices >= 0, at least one; else a
    :class:`ScenarioError` naming the field ``name``."""
    try:
        hosts = tuple(value)
    except TypeError:
        raise ScenarioError(f"{name} must be a sequence of host indices, got {value!r}") from None
    if not hosts or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hosts):
        raise ScenarioError(f"{name} must name at least one host index >= 0, got {value!r}")
    if len(set(hosts)) != len(hosts):
        raise ScenarioError(f"{name} names a host twice: {value!r}")
    return hosts


def nonneg_int(name: str, value) -> int:
    """``value`` if it is an int >= 0; else a :class:`ScenarioError` naming the field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScenarioError(f"{name} must be an int >= 0, got {value!r}")
    return value


# --- when -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class At:
    """The moment a fault strikes: ``phase`` of version ``step`` on rank ``rank``.

    ``phase="step"``: after the version of ``step`` is committed (and persisted when due), before
    the next step trains. ``phase="commit"``: the host store of rank ``rank``'s host holds its
    vote for ``step`` while the faults are injected, then lets it go if it is still alive. Any
    other phase: rank ``rank`` is held at that phase of saving ``step`` (inside its background
    thread) while the faults are injected, then let go if it is still alive. ``commit``,
    ``persist`` and ``persist_commit`` happen only on rank 0.
    """

    step: int
    phase: str = STEP
    rank: int = 0

    def __post_init__(self) -> None:
        nonneg_int("At.step", self.step)
        nonneg_int("At.rank", self.rank)
        if self.phase not in PHASES:
            raise ScenarioError(f"At.phase={self.phase!r} is not a phase; use one of {', '.join(PHASES)}")
        if self.phase in COORDINATOR_PHASES and self.rank != 0:
            raise ScenarioError(f"At.phase={self.phase!r} happens only on the coordinator: use rank=0")

    def label(self) -> str:
        if self.phase == STEP:
            return f"after step {self.step}"
        return f"in {self.phase} of step {self.step} on rank {self.rank}"


@dataclass(frozen=True)
class HookRule:
    """Inside a rank process: at ``phase`` of ``step`` (any step when None), ``pause`` (report
    and wait to be released), ``hold`` (wait to be released, silently) or ``delay`` (sleep)."""

    phase: str
    step: Optional[int]
    action: str
    seconds: float = 0.0
    steps: tuple[int, ...] = field(default=())

    def matches(self, phase: str, step: int) -> bool:
        if phase != self.phase:
            return False
        if self.steps:
            return step in self.steps
        return self.step is None or step == self.step
