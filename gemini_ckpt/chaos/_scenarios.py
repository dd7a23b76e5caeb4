"""The fault matrix's scenarios: the full matrix, the network scenarios, and the subset CI runs."""

from __future__ import annotations

import itertools
from typing import Optional

from ._faults import (
    CorruptDurable,
    CorruptReplica,
    DurableUnreachable,
    DurableWriteOutage,
    FlappingLink,
    KillStore,
    KillWorker,
    NanInState,
    PartitionHost,
    RemoveHosts,
    SlowLink,
    SlowReplication,
    kill_rack,
)
from ._phases import PLACEMENTS, At, ScenarioError
from ._spec import ChaosConfig, Scenario

SINGLE_PHASES = ("step", "replicate", "commit", "committed", "persist", "persist_commit")
CI_SCENARIOS = (
    "kill-worker-replicate",
    "kill-store-commit",
    "remove-host-persist",
    "pair-group-0-1",
    "pair-ring-1-3",
    "second-loss-during-rereplication",
    "durable-write-outage",
    "durable-unreachable-group-lost",
    "corrupt-durable",
    "corrupt-replica-peer-slow-holder",
    "nan-in-optimizer-state",
    "resize-after-loss",
)
"""The reduced matrix CI runs: one scenario per kind of fault (and, with ``ChaosConfig.domains``,
every ``kill-rack-*``; with ``ChaosConfig.network="netns"``, :data:`CI_NETWORK_SCENARIOS`)."""
CI_NETWORK_SCENARIOS = ("partition-host",)
"""The network scenarios of the CI matrix, only with ``--network netns`` (CI may not be root)."""


def fault_steps(config: ChaosConfig) -> tuple[int, int]:
    """``(boundary, phase)``: the step boundary faults strike after (a version that is not
    persisted, so memory and durable predictions differ), and the step whose phases phase
    faults strike (a persisted one, with an earlier persisted version to fall back to)."""
    due = [s for s in range(1, config.steps - 2) if config.persisted_by_policy(s)]
    if len(due) < 2:
        raise ScenarioError(
            f"the matrix needs two persisted steps before step {config.steps - 2}; "
            f"raise ChaosConfig.steps or lower persist_every (steps={config.steps}, "
            f"persist_every={config.persist_every})"
        )
    return due[1] - 1, due[1]


def full_matrix(config: Optional[ChaosConfig] = None) -> list[Scenario]:
    """Every scenario: single faults x phases, pairs of host losses per placement, storage
    faults, corruption, a slow holder, and restarts at a smaller world size."""
    cfg = config or ChaosConfig()
    boundary, ph = fault_steps(cfg)
    out: list[Scenario] = []

    # Single faults x phases (group placement). The fault hits the rank the phase runs on:
    # rank 1 for step/replicate/committed, the coordinator (rank 0) for the others.
    for phase in SINGLE_PHASES:
        rank = 0 if phase in ("commit", "persist", "persist_commit") else 1
        at = At(step=boundary, phase="step") if phase == "step" else At(step=ph, phase=phase, rank=rank)
        out.append(Scenario(name=f"kill-worker-{phase}", at=at, faults=(KillWorker((rank,)),)))
        out.append(
            Scenario(
                name=f"kill-store-{phase}",
                at=at,
                faults=(KillStore((1,)),),
                note="the store of host 1 (a peer of the coordinator) dies; its process lives",
            )
        )
        out.append(Scenario(name=f"remove-host-{phase}", at=at, faults=(RemoveHosts((rank,)),)))

    # Pairs of simultaneous host losses, replaced, for each placement.
    for strategy in PLACEMENTS:
        for pair in itertools.combinations(range(cfg.hosts), 2):
            note = ""
            if strategy == "mixed" and cfg.hosts % cfg.replicas == 0:
                note = f"mixed with replicas={cfg.replicas} dividing hosts={cfg.hosts} is group placement"
            out.append(
                Scenario(
                    name=f"pair-{strategy}-{pair[0]}-{pair[1]}",
                    at=At(step=boundary),
                    faults=(RemoveHosts(pair),),
                    placement=strategy,
                    note=note,
                )
            )
    last_group = tuple(range(cfg.hosts - cfg.replicas, cfg.hosts))
    first_group = tuple(range(cfg.replicas))
    out.append(
        Scenario(
            name="group-lost-during-persist",
            at=At(step=ph, phase="persist"),
            faults=(RemoveHosts(last_group),),
            note="rank 0 lives but cannot read the lost group's shards: the persist fails",
        )
    )
    out.append(
        Scenario(
            name="group-with-coordinator-lost-in-persist-commit",
            at=At(step=ph, phase="persist_commit"),
            faults=(RemoveHosts(first_group),),
            note="data files are on disk, the marker is not: the version must be ignored",
        )
    )

    # A second host lost while the first one's copies are being made again (group placement:
    # host 2 is outside host 1's group, so every shard keeps a copy; host 0 is inside it).
    out.append(
        Scenario(
            name="second-loss-during-rereplication",
            at=At(step=boundary),
            faults=(RemoveHosts((1,)), RemoveHosts((2,), during_rereplication=True)),
            note="before its copies are made again, a host of the other group is lost too",
        )
    )
    out.append(
        Scenario(
            name="partner-lost-during-rereplication",
            at=At(step=boundary),
            faults=(RemoveHosts((1,)), RemoveHosts((0,), during_rereplication=True)),
            note="host 1's only other copy goes with host 0 before it is copied again: durable",
        )
    )

    out.append(
        Scenario(
            name="replacement-lost-during-restore",
            at=At(step=boundary),
            faults=(RemoveHosts((1,)), RemoveHosts((1,), during_restore=True)),
            note="the replacement of host 1 (seeded with its copies) is lost while it restores",
        )
    )

    # Durable storage.
    after = ph + 1
    out.append(
        Scenario(
            name="durable-write-outage",
            at=At(step=after),
            conditions=(DurableWriteOutage((ph,)),),
            faults=(RemoveHosts(last_group),),
            note="the failed persist must not count",
        )
    )
    out.append(
        Scenario(
            name="durable-outage-recovers",
            at=At(step=after),
            conditions=(DurableWriteOutage((ph - cfg.persist_every,)),),
            faults=(RemoveHosts(last_group),),
            note="the next persist after the outage succeeds",
        )
    )
    out.append(
        Scenario(
            name="durable-unreachable-memory-ok",
            at=At(step=boundary),
            conditions=(DurableUnreachable(),),
            faults=(RemoveHosts((1,)),),
            note="memory holds every shard: restore should not need durable storage",
        )
    )
    out.append(
        Scenario(
            name="durable-unreachable-group-lost",
            at=At(step=boundary),
            conditions=(DurableUnreachable(),),
            faults=(RemoveHosts(first_group),),
            note="nothing left to restore from: restore must fail, not start from scratch",
        )
    )
    out.append(
        Scenario(
            name="corrupt-durable",
            at=At(step=after),
            faults=(CorruptDurable(rank=last_group[0]), RemoveHosts(last_group)),
        )
    )

    # Memory corruption and a slow holder.
    out.append(
        Scenario(
            name="corrupt-replica-local",
            at=At(step=boundary),
            faults=(CorruptReplica(host=1, owner=1), KillWorker((1,))),
            note="the copy restore reads first is bad; the peer's copy is good",
        )
    )
    out.append(
        Scenario(
            name="corrupt-replica-peer-slow-holder",
            at=At(step=boundary),
            conditions=(SlowReplication(rank=1, seconds=1.0),),
            faults=(CorruptReplica(host=0, owner=1), KillWorker((1,))),
        )
    )
    out.append(
        Scenario(
            name="corrupt-replica-only-copy-left",
            at=At(step=boundary),
            faults=(CorruptReplica(host=0, owner=1), RemoveHosts((1,))),
            note="the only live copy of shard 1 of the newest version is bad: the older one wins",
        )
    )
    # Poisoned states (NaN): a bad step at a persist-due step, and memory poisoned after commit.
    out.append(
        Scenario(
            name="nan-in-optimizer-state",
            at=At(step=ph),
            conditions=(NanInState(rank=1),),
            faults=(KillWorker((1,)),),
            note=f"step {ph} commits unhealthy: never persisted, never restored; step {ph - 1} is",
        )
    )
    out.append(
        Scenario(
            name="nan-in-replica-after-commit",
            at=At(step=boundary),
            faults=(CorruptReplica(host=1, owner=1, nan=True), KillWorker((1,))),
            note="the checksum catches the NaN written after the health check; the peer's copy is read",
        )
    )
    out.append(
        Scenario(
            name="slow-holder",
            at=At(step=boundary),
            conditions=(SlowReplication(rank=2, seconds=2.0),),
            faults=(KillWorker((2,)),),
        )
    )

    # A smaller world size.
    half = tuple(range(cfg.hosts // 2))
    out.append(
        Scenario(
            name="resize-clean",
            at=At(step=boundary),
            restart_hosts=half,
            note=f"a planned restart at world size {len(half)}",
        )
    )
    lost = (1, 2) if cfg.hosts >= 4 else (1,)
    keep = tuple(x for x in range(cfg.hosts) if x not in lost)[: cfg.hosts // 2]
    out.append(
        Scenario(
            name="resize-after-loss",
            at=At(step=boundary),
            faults=(RemoveHosts(lost, replace=False),),
            restart_hosts=keep,
            note="hosts lost for good; the job goes on with the survivors",
        )
    )
    if cfg.hosts >= 4:
        out.append(
            Scenario(
                name="resize-leaves-idle-store",
                at=At(step=boundary),
                faults=(RemoveHosts((1,), replace=False),),
                restart_hosts=(0, 2),
                note="host 3 lives on without ranks: the registry moves its store to the new "
                "epoch, where it still holds copies",
            )
        )

    # A whole failure domain lost at once (hosts with domains: copies spread over them).
    for domain in dict.fromkeys(cfg.domains or ()):
        out.append(
            Scenario(
                name=f"kill-rack-{domain}",
                at=At(step=boundary),
                faults=(kill_rack(cfg.domains, domain),),
                note="every host of one rack at once: with copies in other racks, memory holds every shard",
            )
        )
    if cfg.network == "netns":
        out += network_scenarios(cfg)
    return out


def network_scenarios(cfg: ChaosConfig) -> list[Scenario]:
    """Hosts cut off or slowed but alive (``ChaosConfig.network="netns"`` only): a partition that
    Ray turns into a lost host, a partition in the middle of a persist, a slow link and a
    flapping one."""
    boundary, ph = fault_steps(cfg)
    cut = 1 if cfg.hosts > 1 else 0
    slow = 0 if cfg.hosts > 1 else cut
    flap = min(2, cfg.hosts - 1)
    return [
        Scenario(
            name="partition-host",
            at=At(step=boundary),
            faults=(PartitionHost(cut, seconds=20.0),),
            note=f"host {cut} is cut off, alive, until Ray declares it dead; the job restarts without it (on a "
            f"replacement), then its link comes back: its old raylet, rank process and host store must be "
            f"fenced",
        ),
        Scenario(
            name="partition-during-persist",
            at=At(step=ph, phase="persist"),
            faults=(PartitionHost(cut, seconds=20.0),),
            note=f"host {cut} is cut off while step {ph} is persisted: the durable version is whole or absent",
        ),
        Scenario(
            name="slow-link",
            at=At(step=boundary),
            conditions=(SlowLink(slow, "10mbit"),),
            faults=(RemoveHosts((cut,)),),
            note=f"host {slow}'s link at 10 Mbit/s throughout; host {cut}'s replacement reads its copies "
            f"from there: versions commit or fail within the timeouts",
        ),
        Scenario(
            name="flapping-link",
            at=At(step=boundary),
            conditions=(FlappingLink(flap, 3, 2.0, 2.0),),
            note=f"host {flap}'s link down 3 x 2 s while the job trains: no false death, every version commits",
        ),
    ]


def ci_matrix(config: Optional[ChaosConfig] = None) -> list[Scenario]:
    """The representative subset of :func:`full_matrix` that CI runs (:data:`CI_SCENARIOS`)."""
    every = full_matrix(config)
    by_name = {s.name: s for s in every}
    return (
        [by_name[n] for n in CI_SCENARIOS if n in by_name]
        + [s for s in every if s.name.startswith("kill-rack-")]
        + [by_name[n] for n in CI_NETWORK_SCENARIOS if n in by_name]
    )
