"""What should happen: the planner's answer for a scenario, decided before the fault strikes.

Two steps, both pure:

1. :func:`versions_after` — which versions exist after the fault: the committed and persisted
   steps observed before it, plus the fate of the version in flight, which follows from the
   phase and the faults (a process or store lost before its shard is handed to its host store,
   or a host store lost before the decision, means the version is never committed; a training
   process lost after its shard is handed off does not stop the commit; a persist finishes only
   if rank 0 survives and every shard is still readable).
2. :func:`predict` — ``placement.plan_recovery(p, failed_slots, durable_available=...)`` says
   whether memory still holds every shard; restore then takes the newest candidate version,
   memory before durable at equal steps, skipping copies known to be corrupt (a corrupt copy
   is replaced by another live holder's copy, or the durable copy of the same step); a version
   the scenario poisons (:class:`~gemini_ckpt.chaos.NanInState`) is never a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import placement

from ..hoststore.slots import placement_for
from ._faults import DurableWriteOutage
from ._phases import STEP
from ._spec import ChaosConfig, Scenario

MEMORY, DURABLE, FRESH, ERROR = "memory", "durable", "fresh", "error"


@dataclass(frozen=True)
class Versions:
    """Versions that exist right after the fault (before any restart)."""

    committed: tuple[int, ...]  # every committed step still kept in memory (newest K)
    persisted: tuple[int, ...]  # complete durable versions (newest keep_durable)
    in_flight: Optional[int]  # the step being saved when the fault struck (phase faults)
    in_flight_committed: Optional[bool] = None
    in_flight_persisted: Optional[bool] = None


@dataclass(frozen=True)
class Prediction:
    """``outcome``: ``memory``/``durable`` (``RestoreResult.source``), ``fresh`` (restore
    finds nothing and returns None) or ``error`` (restore must fail: memory lost and durable
    storage unreachable). ``tier`` is the planner's answer for the failed slots."""

    outcome: str
    step: Optional[int]
    tier: str
    failed_slots: tuple[int, ...]
    lost_hosts: tuple[int, ...]
    memory_steps: tuple[int, ...]
    durable_steps: tuple[int, ...]
    reason: str
    skipped: tuple[int, ...] = field(default=())  # newer candidates restore must skip (corrupt)

    def label(self) -> str:
        return outcome_label(self.outcome, self.step)

    def to_json(self) -> dict:
        return {
            "outcome": self.outcome,
            "step": self.step,
            "tier": self.tier,
            "label": self.label(),
            "failed_slots": list(self.failed_slots),
            "lost_hosts": list(self.lost_hosts),
            "memory_steps": list(self.memory_steps),
            "durable_steps": list(self.durable_steps),
            "skipped": list(self.skipped),
            "reason": self.reason,
        }


def outcome_label(outcome: Optional[str], step: Optional[int]) -> str:
    if outcome in (MEMORY, DURABLE):
        return f"{outcome}@{step}"
    if outcome == FRESH:
        return "fresh start"
    return outcome or "?"


def make_placement(
    strategy: str, hosts: int, replicas: int, domains: Optional[tuple[str, ...]] = None
) -> placement.Placement:
    """Where the job's copies are: the library's own rule (``ChaosConfig.domains``: each host's
    failure domain, as the job reads it from the node labels)."""
    return placement_for(hosts=hosts, replicas=replicas, strategy=strategy, domains=domains)


def versions_after(
    s: Scenario,
    config: ChaosConfig,
    *,
    committed: Iterable[int],
    persisted: Iterable[int],
    p: placement.Placement,
    hosts: tuple[int, ...],
) -> Versions:
    """The versions that exist after ``s``'s faults, from the steps observed before them.

    ``committed``/``persisted``: observed before the fault (with ``phase="step"``: including
    the fault step's own outcome)."""
    # An unhealthy version commits but is never a candidate: not restored, not persisted, not
    # counted by keep_in_memory/keep_durable (it cannot push a healthy one out).
    unhealthy = set(s.unhealthy_steps())
    committed = sorted(set(committed) - unhealthy)
    persisted = sorted(set(persisted) - unhealthy)
    in_flight = ok = durable = None
    if s.at.phase != STEP:
        in_flight = s.at.step
        if s.at.phase == "replicate":  # a lost process or store before its shard is handed off
            ok = not s.destructive()
        elif s.at.phase == "commit":  # every copy acknowledged: only a lost host store stops it
            ok = not s.failed_slots()
        else:
            ok = True
        if ok:
            committed.append(in_flight)
        outage = s.condition(DurableWriteOutage)
        durable = bool(
            ok
            and config.persisted_by_policy(in_flight)
            and 0 not in s.dead_ranks(hosts)  # rank 0 writes and commits the durable version
            and placement.survives(p, s.failed_slots())  # every shard still has a live copy to read
            and not (outage and in_flight in outage.steps)
        )
        if durable:
            persisted.append(in_flight)
    return Versions(
        committed=tuple(sorted(set(committed))[-config.keep_in_memory :]),
        persisted=tuple(sorted(set(persisted))[-config.keep_durable :]),
        in_flight=in_flight,
        in_flight_committed=ok,
        in_flight_persisted=durable,
    )


def predict(
    p: placement.Placement,
    *,
    failed: Iterable[int],
    versions: Versions,
    durable_available: bool = True,
    corrupt_memory: Optional[Mapping[int, Mapping[int, set]]] = None,
    corrupt_durable: Iterable[int] = (),
) -> Prediction:
    """The restore outcome the planner predicts (see the module docstring).

    ``corrupt_memory``: step -> owner slot -> slots whose copy of that owner's shard is bad.
    ``corrupt_durable``: durable steps with a bad file."""
    failed = frozenset(failed)
    corrupt_memory = corrupt_memory or {}
    bad_durable = set(corrupt_durable)
    plan = placement.plan_recovery(p, failed, durable_available=durable_available)
    durable_ok = [st for st in versions.persisted if durable_available and st not in bad_durable]
    candidates: list[tuple[int, str]] = []
    notes = []
    if plan.from_memory:
        for st in versions.committed:
            unreadable = [
                o
                for o, bad in corrupt_memory.get(st, {}).items()
                if not [h for h in p.holders(o) if h not in failed and h not in bad]
            ]
            if unreadable and st not in durable_ok:
                notes.append(f"memory@{st} has no good copy of shard(s) {unreadable}")
                continue
            candidates.append((st, MEMORY))
    candidates += [(st, DURABLE) for st in durable_ok]
    base = dict(
        tier=plan.tier,
        failed_slots=tuple(sorted(failed)),
        lost_hosts=plan.lost_hosts,
        memory_steps=versions.committed,
        durable_steps=versions.persisted,
    )
    where = f"slots {sorted(failed)} failed: " if failed else "no slot failed: "
    if plan.from_memory:
        where += "every shard keeps a live copy"
    else:
        where += f"every copy of host(s) {list(plan.lost_hosts)} is gone"
    if not candidates:
        if durable_available:
            return Prediction(FRESH, None, reason=f"{where}; nothing to restore", **base)
        return Prediction(ERROR, None, reason=f"{where}; durable storage unreachable: restore must fail", **base)
    step, outcome = max(candidates, key=lambda c: (c[0], c[1] == MEMORY))
    tried = sorted({st for st in versions.persisted if st in bad_durable and st > step}, reverse=True)
    reason = f"{where}; newest {outcome} version is {step}"
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    if tried:
        reason += f"; corrupt durable step(s) {tried} are skipped"
    return Prediction(outcome, step, reason=reason, skipped=tuple(tried), **base)


def plan_scenario(s: Scenario, config: ChaosConfig) -> Prediction:
    """The prediction for ``s`` before anything runs, assuming a healthy run up to the fault:
    every step commits and every due step persists (except where a ``DurableWriteOutage``
    says otherwise). :func:`~gemini_ckpt.chaos.run_scenario` predicts from what it observed."""
    from ._faults import CorruptDurable, CorruptReplica, DurableUnreachable

    f = s.at.step
    before = list(range(0, f + 1 if s.at.phase == STEP else f))
    outage = s.condition(DurableWriteOutage)
    persisted = [
        x
        for x in before
        if config.persisted_by_policy(x) and not (outage and x in outage.steps) and x not in s.unhealthy_steps()
    ]
    hosts = tuple(range(config.hosts))
    p = make_placement(s.placement, config.hosts, config.replicas, config.domains)
    corrupt_memory: dict[int, dict[int, set]] = {}
    corrupt_durable: set[int] = set()
    for fault in s.faults:
        healthy = [x for x in before if x not in s.unhealthy_steps()]
        if isinstance(fault, CorruptReplica) and healthy:
            corrupt_memory.setdefault(max(healthy), {}).setdefault(fault.owner, set()).add(fault.host)
        if isinstance(fault, CorruptDurable) and persisted:
            corrupt_durable.add(max(persisted))
    versions = versions_after(s, config, committed=before, persisted=persisted, p=p, hosts=hosts)
    return predict(
        p,
        failed=s.failed_slots(),
        versions=versions,
        durable_available=s.condition(DurableUnreachable) is None,
        corrupt_memory=corrupt_memory,
        corrupt_durable=corrupt_durable,
    )
