"""Failure injection: a fault matrix that checks every outcome against the planner's prediction.

A deterministic training job runs on a local Ray cluster of simulated hosts (one rank per
host, gloo). Each :class:`Scenario` strikes it at a chosen step and phase — killed training
processes, killed host stores, hosts removed (and replaced), faults inside the replicate /
commit / persist phases, durable storage that fails or is unreachable, a slow holder,
corrupt bytes in memory or on disk, a step that leaves NaN in the state, a restart at a smaller world size,
and (with ``ChaosConfig(network="netns")``) a host partitioned, a slow or flapping link — then restarts the
job, restores, trains to the end and checks:

- the restored step and tier equal what ``placement.plan_recovery`` predicts from the
  failed hosts and the versions known committed/persisted before the fault;
- every rank restored the same version, bit-identical to the uninterrupted reference run at
  that step (model, optimizer and rank-local state), and only a committed one;
- the continued run repeats the reference's losses bit for bit and ends in the same state;
- the job finished.

Example::

    from gemini_ckpt.chaos import At, RemoveHosts, Scenario, ci_matrix, run_matrix

    report = run_matrix(ci_matrix() + [
        Scenario(name="lose-2-3", at=At(step=2), faults=(RemoveHosts((2, 3)),), placement="ring"),
    ], json_path="chaos.json")
    print(report.format_table())

Or from a shell: ``python -m gemini_ckpt chaos --matrix ci --json chaos.json``. See
``docs/chaos.md``.
"""

from ._cli import add_chaos_command
from ._harness import Harness
from ._job import TinyJob, TrainJob
from ._memory import damage_copy
from ._matrix import MatrixReport, run_matrix
from ._scenarios import CI_SCENARIOS, ci_matrix, full_matrix
from ._predict import Prediction, plan_scenario, predict, versions_after
from ._results import Check, HarnessError, InfraError, ScenarioResult
from ._runner import run_scenario
from ._storage import FaultyFsHandler, faulty_filesystem
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
from ._phases import (
    PHASES,
    At,
    ScenarioError,
)
from ._spec import (
    ChaosConfig,
    Scenario,
)

__all__ = [
    "CI_SCENARIOS",
    "PHASES",
    "At",
    "ChaosConfig",
    "Check",
    "CorruptDurable",
    "CorruptReplica",
    "DurableUnreachable",
    "DurableWriteOutage",
    "FaultyFsHandler",
    "FlappingLink",
    "Harness",
    "HarnessError",
    "InfraError",
    "KillStore",
    "KillWorker",
    "MatrixReport",
    "NanInState",
    "PartitionHost",
    "Prediction",
    "RemoveHosts",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "SlowLink",
    "SlowReplication",
    "TinyJob",
    "TrainJob",
    "add_chaos_command",
    "faulty_filesystem",
    "ci_matrix",
    "full_matrix",
    "kill_rack",
    "plan_scenario",
    "predict",
    "run_matrix",
    "run_scenario",
    "versions_after",
    "damage_copy",
]
