"""What a chaos scenario is: when the fault strikes (:class:`At`), what it does (faults), the
conditions around it, and the job it strikes (:class:`ChaosConfig`). Plain frozen
dataclasses, validated at construction; nothing here starts a process or touches Ray.

This module holds the scenario and the job; the moment and the phases are in
:mod:`._phases`, the faults and conditions in :mod:`._faults`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..testing.netns import parse_rate
from ..durable.tier import EveryNSteps
from ._faults import (
    CONDITION_TYPES,
    FAULT_TYPES,
    Condition,
    CorruptDurable,
    CorruptReplica,
    DurableWriteOutage,
    FlappingLink,
    Fault,
    KillStore,
    KillWorker,
    NETWORK_TYPES,
    NanInState,
    PartitionHost,
    RemoveHosts,
    SlowLink,
    SlowReplication,
)
from ._phases import PERSIST_PHASES, PLACEMENTS, STEP, At, ScenarioError, host_indices

NETWORKS = ("loopback", "netns")
DOMAIN_LABEL = "rack"
"""The Ray node label of a host's failure domain in the chaos job (``ChaosConfig.domains``)."""


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
                raise ScenarioError(
                    f"Scenario {self.name}: {f!r} is not a fault; use one of "
                    f"{', '.join(t.__name__ for t in FAULT_TYPES)}"
                )
        for c in self.conditions:
            if not isinstance(c, CONDITION_TYPES):
                raise ScenarioError(
                    f"Scenario {self.name}: {c!r} is not a condition; use one of "
                    f"{', '.join(t.__name__ for t in CONDITION_TYPES)}"
                )
        if self.placement not in PLACEMENTS:
            raise ScenarioError(f"Scenario {self.name}: placement={self.placement!r}; use one of {PLACEMENTS}")
        if self.restart_hosts is not None:
            object.__setattr__(
                self, "restart_hosts", host_indices(f"Scenario {self.name}: restart_hosts", self.restart_hosts)
            )

    # --- derived facts ---------------------------------------------------------------------
    def removed_hosts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(h for f in self.faults if isinstance(f, RemoveHosts) for h in f.hosts))

    def replaced_hosts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(h for f in self.faults if isinstance(f, RemoveHosts) and f.replace for h in f.hosts))

    def lost_in_restore(self) -> tuple[int, ...]:
        """Hosts removed again while their ranks restore (:attr:`RemoveHosts.during_restore`)."""
        return tuple(h for f in self.faults if isinstance(f, RemoveHosts) and f.during_restore for h in f.hosts)

    def partitioned_hosts(self) -> tuple[int, ...]:
        """Hosts cut off by a :class:`PartitionHost` (alive, but lost to the job: replaced)."""
        return tuple(dict.fromkeys(f.host for f in self.faults if isinstance(f, PartitionHost)))

    def needs_network(self) -> bool:
        """Whether a fault or condition needs hosts with their own links (``network="netns"``)."""
        return any(isinstance(x, NETWORK_TYPES) for x in self.faults + self.conditions)

    def unhealthy_steps(self) -> tuple[int, ...]:
        """Versions the scenario poisons before they are saved (:class:`NanInState`)."""
        return (self.at.step,) if self.condition(NanInState) is not None else ()

    def failed_slots(self) -> frozenset[int]:
        """Hosts whose host store (and so every copy it held) is gone."""
        killed = {h for f in self.faults if isinstance(f, KillStore) for h in f.hosts}
        return frozenset(killed | set(self.removed_hosts()) | set(self.partitioned_hosts()))

    def dead_ranks(self, hosts: tuple[int, ...]) -> frozenset[int]:
        """Ranks (of a job on ``hosts``) whose training process the faults kill."""
        killed = {r for f in self.faults if isinstance(f, KillWorker) for r in f.ranks}
        removed = set(self.removed_hosts()) | set(self.partitioned_hosts())
        return frozenset(killed | {r for r, h in enumerate(hosts) if h in removed})

    def destructive(self) -> bool:
        return any(isinstance(f, (KillWorker, KillStore, RemoveHosts, PartitionHost)) for f in self.faults)

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
    ``domains``: one failure-domain label per host (e.g. ``("0", "0", "1", "1")``): each host's
    node gets the label ``rack=<label>`` and the job runs with ``CheckpointConfig(failure_domain=
    "rack")``, so copies are spread over racks, and ``kill-rack-*`` scenarios join the matrix.
    ``network``: ``"loopback"`` (every host on this machine's one interface) or ``"netns"`` (each
    host's Ray node in its own network namespace, :mod:`gemini_ckpt.testing.netns`; needs root), where
    the network scenarios (``partition-host``, ``slow-link``, ...) join the matrix; ``link``: each
    host's link rate with ``"netns"`` (``"1gbit"``; None: unshaped).
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
    domains: Optional[tuple[str, ...]] = None
    network: str = "loopback"
    link: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("hosts", "replicas", "steps", "persist_every", "keep_in_memory", "keep_durable"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScenarioError(f"ChaosConfig.{name} must be an int >= 1, got {value!r}")
        if self.replicas > self.hosts:
            raise ScenarioError(
                f"ChaosConfig.replicas={self.replicas} needs at least that many hosts (hosts={self.hosts})"
            )
        if self.steps < 3:
            raise ScenarioError("ChaosConfig.steps must be at least 3 (train, fault, continue)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ScenarioError(f"ChaosConfig.timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.domains is not None:
            domains = tuple(self.domains) if not isinstance(self.domains, str) else ()
            if len(domains) != self.hosts or not all(isinstance(d, str) and d for d in domains):
                raise ScenarioError(
                    f"ChaosConfig.domains must give one non-empty label per host ({self.hosts}), "
                    f"e.g. {tuple(str(i // 2) for i in range(self.hosts))}; got {self.domains!r}"
                )
            object.__setattr__(self, "domains", domains)
        if self.network not in NETWORKS:
            raise ScenarioError(f"ChaosConfig.network={self.network!r}: choose one of {', '.join(NETWORKS)}")
        if self.link is not None:
            if self.network != "netns":
                raise ScenarioError(
                    f"ChaosConfig.link={self.link!r} shapes the hosts' own links: it needs network='netns'"
                )
            try:
                parse_rate(self.link)
            except ValueError as exc:
                raise ScenarioError(f"ChaosConfig.link: {exc}") from None

    def host_labels(self, host: int) -> dict[str, str]:
        """The extra Ray node labels of simulated host ``host`` (its failure domain, if any)."""
        return {} if self.domains is None else {DOMAIN_LABEL: self.domains[host]}

    def domain_hosts(self, domain: str) -> tuple[int, ...]:
        """The hosts of failure domain ``domain``."""
        return tuple(h for h, d in enumerate(self.domains or ()) if d == domain)

    def persisted_by_policy(self, step: int) -> bool:
        return EveryNSteps(self.persist_every).should_persist(step)  # the library's own rule

    def check(self, s: Scenario) -> None:
        """Raise :class:`ScenarioError` if ``s`` cannot run on this job."""
        last = self.steps - 1
        if s.at.step >= last:
            raise ScenarioError(
                f"Scenario {s.name}: At.step={s.at.step} leaves no step to continue with; "
                f"use a step below {last} (ChaosConfig.steps={self.steps})"
            )
        if s.at.rank >= self.hosts:
            raise ScenarioError(f"Scenario {s.name}: At.rank={s.at.rank} but the job has {self.hosts} ranks")
        if s.at.phase in PERSIST_PHASES and not self.persisted_by_policy(s.at.step):
            due = [x for x in range(self.steps) if self.persisted_by_policy(x)]
            raise ScenarioError(
                f"Scenario {s.name}: step {s.at.step} is not persisted "
                f"(persist_every={self.persist_every}); phase {s.at.phase!r} needs one of {due}"
            )
        if s.placement == "group" and self.hosts % self.replicas:
            raise ScenarioError(
                f"Scenario {s.name}: group placement needs replicas ({self.replicas}) to divide "
                f"hosts ({self.hosts}); use mixed"
            )
        for f in s.faults:
            if isinstance(f, RemoveHosts) and f.domain is not None and f.hosts != self.domain_hosts(f.domain):
                raise ScenarioError(
                    f"Scenario {s.name}: {f!r} is not every host of domain {f.domain!r} "
                    f"(ChaosConfig.domains: {self.domain_hosts(f.domain) or 'no such domain'})"
                )
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
            raise ScenarioError(
                f"Scenario {s.name}: restart_hosts {hosts_after} includes removed hosts "
                f"{sorted(gone)} that are not replaced; set RemoveHosts(replace=True) or pick others"
            )
        if s.needs_network() and self.network != "netns":
            raise ScenarioError(
                f"Scenario {s.name} cuts or shapes a host's link: it needs ChaosConfig.network="
                f"'netns' (--network netns)"
            )
        for c in s.conditions:
            if isinstance(c, (SlowLink, FlappingLink)) and c.host >= self.hosts:
                raise ScenarioError(f"Scenario {s.name}: {c!r} is outside {self.hosts} hosts")
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
                raise ScenarioError(
                    f"Scenario {s.name}: NanInState poisons the fault step before it is saved; "
                    f"use At(step=..., phase='step'), not phase={s.at.phase!r}"
                )
        outage = s.condition(DurableWriteOutage)
        if outage is not None and any(x >= self.steps for x in outage.steps):
            raise ScenarioError(f"Scenario {s.name}: {outage!r} names steps beyond {last}")
