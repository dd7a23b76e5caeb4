"""What a chaos scenario is: when the fault strikes (:class:`At`), what it does (faults), the
conditions around it, and the job it strikes (:class:`ChaosConfig`). Plain frozen
dataclasses, validated at construction; nothing here starts a process or touches Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

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
PLACEMENTS = ("group", "ring", "mixed")


class ScenarioError(ValueError):
    """A scenario that cannot be run as written; the message names the field and the fix."""


def _hosts(name: str, value) -> tuple[int, ...]:
    try:
        hosts = tuple(value)
    except TypeError:
        raise ScenarioError(f"{name} must be a sequence of host indices, got {value!r}") from None
    if not hosts or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hosts):
        raise ScenarioError(f"{name} must name at least one host index >= 0, got {value!r}")
    if len(set(hosts)) != len(hosts):
        raise ScenarioError(f"{name} names a host twice: {value!r}")
    return hosts


def _nonneg_int(name: str, value) -> int:
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
        _nonneg_int("At.step", self.step)
        _nonneg_int("At.rank", self.rank)
        if self.phase not in PHASES:
            raise ScenarioError(f"At.phase={self.phase!r} is not a phase; use one of {', '.join(PHASES)}")
        if self.phase in COORDINATOR_PHASES and self.rank != 0:
            raise ScenarioError(f"At.phase={self.phase!r} happens only on the coordinator: use rank=0")

    def label(self) -> str:
        if self.phase == STEP:
            return f"after step {self.step}"
        return f"in {self.phase} of step {self.step} on rank {self.rank}"


# --- faults: what happens at the trigger ------------------------------------------------------------
@dataclass(frozen=True)
class KillWorker:
    """SIGKILL the training process of each of ``ranks`` (its host and host store survive)."""

    ranks: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", _hosts("KillWorker.ranks", self.ranks))

    def label(self) -> str:
        return f"kill worker {','.join(map(str, self.ranks))}"


@dataclass(frozen=True)
class KillStore:
    """``ray.kill`` the host store of each of ``hosts`` (every copy it held is gone)."""

    hosts: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", _hosts("KillStore.hosts", self.hosts))

    def label(self) -> str:
        return f"kill store {','.join(map(str, self.hosts))}"


@dataclass(frozen=True)
class RemoveHosts:
    """Remove whole hosts at once (``cluster.remove_node(..., allow_graceful=False)``): their
    training processes and host stores die with them. ``replace``: add a new node with the same
    ``host{i}`` resource, so the job restarts at the same world size."""

    hosts: tuple[int, ...] = (1,)
    replace: bool = True
    during_rereplication: bool = False
    """Remove these hosts only once the host stores noticed the scenario's other losses, while
    the copies those losses cost are being made again (the registry holds that work until this
    removal is done): a second failure inside the window that re-replication closes."""
    during_restore: bool = False
    """Remove these hosts (replacements of the scenario's other losses) again while their ranks
    restore, after the job restarted: the job restarts once more, on a new replacement."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", _hosts("RemoveHosts.hosts", self.hosts))
        for name in ("replace", "during_rereplication", "during_restore"):
            if not isinstance(getattr(self, name), bool):
                raise ScenarioError(f"RemoveHosts.{name} must be True or False, got {getattr(self, name)!r}")
        if self.during_restore and not self.replace:
            raise ScenarioError("RemoveHosts(during_restore=True) needs replace=True: the job restarts on the "
                                "same hosts once more")

    @property
    def at_fault(self) -> bool:
        """Removed when the scenario strikes (not later)."""
        return not (self.during_rereplication or self.during_restore)

    def label(self) -> str:
        text = f"remove host{'s' if len(self.hosts) > 1 else ''} {','.join(map(str, self.hosts))}"
        return text + (" during re-replication" if self.during_rereplication else "") + (
            " during its restore" if self.during_restore else "")


@dataclass(frozen=True)
class CorruptReplica:
    """Flip one byte of ``host``'s in-memory copy of rank ``owner``'s shard of the newest
    committed version (a bad DIMM, a stray write). The copy must be skipped, never loaded."""

    host: int = 1
    owner: int = 1
    nan: bool = False
    """Write a NaN's bits over the first value of the biggest floating-point item instead of
    flipping a byte (memory poisoned after commit: the checksum, not the health check, must
    catch it, since the version was healthy when it was checked)."""

    def __post_init__(self) -> None:
        _nonneg_int("CorruptReplica.host", self.host)
        _nonneg_int("CorruptReplica.owner", self.owner)
        if not isinstance(self.nan, bool):
            raise ScenarioError(f"CorruptReplica.nan must be True or False, got {self.nan!r}")

    def label(self) -> str:
        return f"{'NaN in' if self.nan else 'corrupt'} host {self.host}'s copy of shard {self.owner}"


@dataclass(frozen=True)
class CorruptDurable:
    """Flip one byte of rank ``rank``'s data file of the newest persisted version on disk."""

    rank: int = 0

    def __post_init__(self) -> None:
        _nonneg_int("CorruptDurable.rank", self.rank)

    def label(self) -> str:
        return f"corrupt durable file of rank {self.rank}"


Fault = Union[KillWorker, KillStore, RemoveHosts, CorruptReplica, CorruptDurable]
FAULT_TYPES = (KillWorker, KillStore, RemoveHosts, CorruptReplica, CorruptDurable)


# --- conditions: what holds around the fault ----------------------------------------------------------
@dataclass(frozen=True)
class SlowReplication:
    """Rank ``rank`` waits ``seconds`` before handing its shard to its host store (a slow
    holder: every acknowledgement of its copies comes that much later), for ``steps`` (all
    steps before the fault when empty)."""

    rank: int = 1
    seconds: float = 1.0
    steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _nonneg_int("SlowReplication.rank", self.rank)
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or self.seconds <= 0:
            raise ScenarioError(f"SlowReplication.seconds must be a positive number, got {self.seconds!r}")
        object.__setattr__(self, "steps", tuple(_nonneg_int("SlowReplication.steps", s) for s in self.steps))

    def label(self) -> str:
        return f"slow holder (rank {self.rank} +{self.seconds:g}s)"


@dataclass(frozen=True)
class DurableWriteOutage:
    """Every write to durable storage fails while the versions of ``steps`` are persisted (a
    full disk, an unreachable bucket for a while); reads keep working."""

    steps: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ScenarioError("DurableWriteOutage.steps must name at least one step")
        object.__setattr__(self, "steps", tuple(_nonneg_int("DurableWriteOutage.steps", s) for s in self.steps))

    def label(self) -> str:
        return f"durable writes fail while persisting step {','.join(map(str, self.steps))}"


@dataclass(frozen=True)
class DurableUnreachable:
    """Durable storage refuses every operation (reads included) while the job restarts and
    restores; it comes back before training continues."""

    def label(self) -> str:
        return "durable unreachable at restart"


@dataclass(frozen=True)
class NanInState:
    """The fault step itself goes bad on rank ``rank``: after its optimizer step, a NaN lands in
    the first value of that rank's optimizer state (a bad step, silent data corruption) before
    the version is saved. The version commits but is unhealthy: it must never be persisted or
    restored, nor push a healthy version out of memory or the durable tier. Needs
    ``At(phase="step")``."""

    rank: int = 1

    def __post_init__(self) -> None:
        _nonneg_int("NanInState.rank", self.rank)

    def label(self) -> str:
        return f"NaN in rank {self.rank}'s optimizer state at the fault step"


Condition = Union[SlowReplication, DurableWriteOutage, DurableUnreachable, NanInState]
CONDITION_TYPES = (SlowReplication, DurableWriteOutage, DurableUnreachable, NanInState)


# --- the scenario -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One fault experiment: train, strike ``at``, restart on ``restart_hosts`` (default: the
    same hosts, replacements included), restore, continue to the last step, and check.

    Example::

        Scenario(name="pair-group-0-1", at=At(step=2), faults=(RemoveHosts(hosts=(0, 1)),))
    """

    name: str
    at: At
    faults: tuple[Fault, ...] = ()
    conditions: tuple[Condition, ...] = ()
    placement: str = "group"
    restart_hosts: Optional[tuple[int, ...]] = None
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ScenarioError(f"Scenario.name must be a non-empty word, got {self.name!r}")
        if not isinstance(self.at, At):
            raise ScenarioError(f"Scenario {self.name}: at must be an At(step=..., phase=...), got {self.at!r}")
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "conditions", tuple(self.conditions))
        for f in self.faults:
            if not isinstance(f, FAULT_TYPES):
                raise ScenarioError(f"Scenario {self.name}: {f!r} is not a fault; use one of "
                                    f"{', '.join(t.__name__ for t in FAULT_TYPES)}")
        for c in self.conditions:
            if not isinstance(c, CONDITION_TYPES):
                raise ScenarioError(f"Scenario {self.name}: {c!r} is not a condition; use one of "
                                    f"{', '.join(t.__name__ for t in CONDITION_TYPES)}")
        if self.placement not in PLACEMENTS:
            raise ScenarioError(f"Scenario {self.name}: placement={self.placement!r}; use one of {PLACEMENTS}")
        if self.restart_hosts is not None:
            object.__setattr__(self, "restart_hosts", _hosts(f"Scenario {self.name}: restart_hosts",
                                                             self.restart_hosts))

    # --- derived facts ---------------------------------------------------------------------
    def removed_hosts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(h for f in self.faults if isinstance(f, RemoveHosts) for h in f.hosts))

    def replaced_hosts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(h for f in self.faults if isinstance(f, RemoveHosts) and f.replace
                                   for h in f.hosts))

    def lost_in_restore(self) -> tuple[int, ...]:
        """Hosts removed again while their ranks restore (:attr:`RemoveHosts.during_restore`)."""
        return tuple(h for f in self.faults if isinstance(f, RemoveHosts) and f.during_restore for h in f.hosts)

    def unhealthy_steps(self) -> tuple[int, ...]:
        """Versions the scenario poisons before they are saved (:class:`NanInState`)."""
        return (self.at.step,) if self.condition(NanInState) is not None else ()

    def failed_slots(self) -> frozenset[int]:
        """Hosts whose host store (and so every copy it held) is gone."""
        killed = {h for f in self.faults if isinstance(f, KillStore) for h in f.hosts}
        return frozenset(killed | set(self.removed_hosts()))

    def dead_ranks(self, hosts: tuple[int, ...]) -> frozenset[int]:
        """Ranks (of a job on ``hosts``) whose training process the faults kill."""
        killed = {r for f in self.faults if isinstance(f, KillWorker) for r in f.ranks}
        removed = set(self.removed_hosts())
        return frozenset(killed | {r for r, h in enumerate(hosts) if h in removed})

    def destructive(self) -> bool:
        return any(isinstance(f, (KillWorker, KillStore, RemoveHosts)) for f in self.faults)

    def condition(self, kind: type):
        return next((c for c in self.conditions if isinstance(c, kind)), None)

    def describe(self) -> str:
        text = f"{', '.join(f.label() for f in self.faults) or 'clean stop'} {self.at.label()}"
        if self.conditions:
            text += "; " + "; ".join(c.label() for c in self.conditions)
        if self.restart_hosts is not None:
            text += f"; restart on hosts {','.join(map(str, self.restart_hosts))}"
        return text


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """The job every scenario strikes: ``hosts`` simulated hosts with one rank each, ``steps``
    training steps (0 .. steps-1), a version saved every step with ``replicas`` copies in
    memory (``keep_in_memory`` kept), every ``persist_every``-th persisted
    (steps ``persist_every - 1``, ``2 * persist_every - 1``, ...) and ``keep_durable`` kept.

    ``workdir``: where durable tiers live (default: a temporary directory, removed at the end).
    """

    hosts: int = 4
    replicas: int = 2
    steps: int = 6
    persist_every: int = 2
    keep_in_memory: int = 2
    keep_durable: int = 2
    seed: int = 0
    timeout_s: float = 60.0
    workdir: Optional[str] = None
    object_store_bytes: int = 80 << 20
    host_memory_budget_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("hosts", "replicas", "steps", "persist_every", "keep_in_memory", "keep_durable"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScenarioError(f"ChaosConfig.{name} must be an int >= 1, got {value!r}")
        if self.replicas > self.hosts:
            raise ScenarioError(f"ChaosConfig.replicas={self.replicas} needs at least that many hosts "
                                f"(hosts={self.hosts})")
        if self.steps < 3:
            raise ScenarioError("ChaosConfig.steps must be at least 3 (train, fault, continue)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ScenarioError(f"ChaosConfig.timeout_s must be a positive number, got {self.timeout_s!r}")

    def persisted_by_policy(self, step: int) -> bool:
        return (step + 1) % self.persist_every == 0

    def check(self, s: Scenario) -> None:
        """Raise :class:`ScenarioError` if ``s`` cannot run on this job."""
        last = self.steps - 1
        if s.at.step >= last:
            raise ScenarioError(f"Scenario {s.name}: At.step={s.at.step} leaves no step to continue with; "
                                f"use a step below {last} (ChaosConfig.steps={self.steps})")
        if s.at.rank >= self.hosts:
            raise ScenarioError(f"Scenario {s.name}: At.rank={s.at.rank} but the job has {self.hosts} ranks")
        if s.at.phase in PERSIST_PHASES and not self.persisted_by_policy(s.at.step):
            due = [x for x in range(self.steps) if self.persisted_by_policy(x)]
            raise ScenarioError(f"Scenario {s.name}: step {s.at.step} is not persisted "
                                f"(persist_every={self.persist_every}); phase {s.at.phase!r} needs one of {due}")
        if s.placement == "group" and self.hosts % self.replicas:
            raise ScenarioError(f"Scenario {s.name}: group placement needs replicas ({self.replicas}) to divide "
                                f"hosts ({self.hosts}); use mixed")
        for f in s.faults:
            for h in getattr(f, "hosts", ()) + tuple(getattr(f, "ranks", ())):
                if h >= self.hosts:
                    raise ScenarioError(f"Scenario {s.name}: {f!r} names host/rank {h}; the job has {self.hosts}")
            if isinstance(f, CorruptReplica):
                if f.host >= self.hosts or f.owner >= self.hosts:
                    raise ScenarioError(f"Scenario {s.name}: {f!r} is outside {self.hosts} hosts")
            if isinstance(f, CorruptDurable) and f.rank >= self.hosts:
                raise ScenarioError(f"Scenario {s.name}: {f!r} is outside {self.hosts} ranks")
        hosts_after = s.restart_hosts if s.restart_hosts is not None else tuple(range(self.hosts))
        gone = set(s.removed_hosts()) - set(s.replaced_hosts())
        if set(hosts_after) & gone:
            raise ScenarioError(f"Scenario {s.name}: restart_hosts {hosts_after} includes removed hosts "
                                f"{sorted(gone)} that are not replaced; set RemoveHosts(replace=True) or pick others")
        if any(h >= self.hosts for h in hosts_after):
            raise ScenarioError(f"Scenario {s.name}: restart_hosts {hosts_after} is outside {self.hosts} hosts")
        slow = s.condition(SlowReplication)
        if slow is not None and slow.rank >= self.hosts:
            raise ScenarioError(f"Scenario {s.name}: {slow!r} is outside {self.hosts} ranks")
        nan = s.condition(NanInState)
        if nan is not None:
            if nan.rank >= self.hosts:
                raise ScenarioError(f"Scenario {s.name}: {nan!r} is outside {self.hosts} ranks")
            if s.at.phase != STEP:
                raise ScenarioError(f"Scenario {s.name}: NanInState poisons the fault step before it is saved; "
                                    f"use At(step=..., phase='step'), not phase={s.at.phase!r}")
        outage = s.condition(DurableWriteOutage)
        if outage is not None and any(x >= self.steps for x in outage.steps):
            raise ScenarioError(f"Scenario {s.name}: {outage!r} names steps beyond {last}")


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
