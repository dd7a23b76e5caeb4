"""The failure-injection harness (``gemini_ckpt.chaos``): every fault's outcome matches the
planner's prediction and the resumed run is bit-identical to an uninterrupted one; and the
harness notices when the library misbehaves (a store that acknowledges copies it never made).

The first tests are pure (scenario validation, predictions, the report). The Ray tests share
one harness per module (head + 4 simulated hosts, rank actors reused across scenarios) and run
the reduced CI matrix (``gemini_ckpt.chaos.CI_SCENARIOS``). Run:
``RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python -m pytest tests/test_chaos.py -q``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import pytest

import placement
from gemini_ckpt.chaos import (
    CI_SCENARIOS,
    At,
    ChaosConfig,
    Check,
    CorruptReplica,
    DurableUnreachable,
    DurableWriteOutage,
    Harness,
    KillStore,
    KillWorker,
    MatrixReport,
    RemoveHosts,
    Scenario,
    ScenarioError,
    ScenarioResult,
    TinyJob,
    add_chaos_command,
    ci_matrix,
    full_matrix,
    plan_scenario,
    run_matrix,
    run_scenario,
    versions_after,
)
from gemini_ckpt.chaos._harness import JobRun, Rendezvous

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

CONFIG = ChaosConfig()  # 4 hosts, replicas 2, steps 0..5, persisted 1, 3, 5


# --- no Ray --------------------------------------------------------------------------------------
def test_scenarios_are_validated_with_the_field_and_the_fix():
    with pytest.raises(ScenarioError, match="only on the coordinator: use rank=0"):
        At(step=3, phase="commit", rank=1)
    with pytest.raises(ScenarioError, match="is not a phase"):
        At(step=3, phase="flush")
    with pytest.raises(ScenarioError, match="names a host twice"):
        RemoveHosts((1, 1))
    with pytest.raises(ScenarioError, match="non-empty word"):
        Scenario(name="two words", at=At(step=1))
    with pytest.raises(ScenarioError, match="not persisted.*needs one of \\[1, 3, 5\\]"):
        CONFIG.check(Scenario(name="x", at=At(step=2, phase="persist")))
    with pytest.raises(ScenarioError, match="leaves no step to continue"):
        CONFIG.check(Scenario(name="x", at=At(step=5)))
    with pytest.raises(ScenarioError, match="includes removed hosts"):
        CONFIG.check(Scenario(name="x", at=At(step=2), faults=(RemoveHosts((3,), replace=False),)))


def test_every_matrix_scenario_is_valid_and_pairs_follow_the_planner():
    scenarios = full_matrix(CONFIG)
    assert len({s.name for s in scenarios}) == len(scenarios)
    assert [s.name for s in ci_matrix(CONFIG)] == list(CI_SCENARIOS)
    for s in scenarios:
        CONFIG.check(s)
        pred = plan_scenario(s, CONFIG)
        if s.name.startswith("pair-"):
            p = placement.make(s.placement, hosts=4, replicas=2)
            survives = placement.survives(p, s.failed_slots())
            assert (pred.outcome, pred.step) == (("memory", 2) if survives else ("durable", 1)), s.name
    preds = {s.name: plan_scenario(s, CONFIG).label() for s in scenarios}
    # Mixed with replicas dividing hosts is group placement: the same predictions.
    assert all(preds[f"pair-mixed-{a}-{b}"] == preds[f"pair-group-{a}-{b}"] for a in range(4) for b in range(a + 1, 4))
    assert [k for k, v in preds.items() if k.startswith("pair-ring") and v.startswith("durable")] == [
        "pair-ring-0-1", "pair-ring-0-3", "pair-ring-1-2", "pair-ring-2-3"]
    expected = {
        "kill-worker-replicate": "memory@2",  # the version in flight is never committed
        "kill-store-commit": "memory@2",
        "kill-worker-committed": "memory@3",
        "remove-host-persist": "memory@3",  # committed; its persist dies with the coordinator
        "group-lost-during-persist": "durable@1",  # the persist cannot read the lost group's shards
        "durable-write-outage": "durable@1",  # the failed persist of step 3 does not count
        "durable-outage-recovers": "durable@3",
        "durable-unreachable-memory-ok": "memory@2",
        "durable-unreachable-group-lost": "error",
        "corrupt-durable": "durable@1",  # step 3's bad file is skipped
        "corrupt-replica-local": "memory@2",  # the peer's copy is good
        "corrupt-replica-only-copy-left": "memory@1",
        "resize-after-loss": "memory@2",
    }
    assert {k: preds[k] for k in expected} == expected


def test_the_fate_of_the_version_in_flight_follows_phase_and_fault():
    p = placement.make("group", hosts=4, replicas=2)
    hosts = (0, 1, 2, 3)

    def fate(phase, faults, rank=0, step=3):
        s = Scenario(name="x", at=At(step=step, phase=phase, rank=rank), faults=faults)
        v = versions_after(s, CONFIG, committed=[0, 1, 2], persisted=[1], p=p, hosts=hosts)
        return v.committed, v.persisted

    assert fate("replicate", (KillWorker((1,)),), rank=1) == ((1, 2), (1,))
    assert fate("replicate", (CorruptReplica(),), rank=1) == ((2, 3), (1, 3))  # nothing died: it commits
    assert fate("committed", (KillWorker((1,)),), rank=1) == ((2, 3), (1, 3))  # rank 0 still persists it
    assert fate("persist", (KillWorker((0,)),)) == ((2, 3), (1,))
    assert fate("persist", (KillStore((1,)),)) == ((2, 3), (1, 3))  # written from the other holder
    assert fate("persist", (RemoveHosts((2, 3)),)) == ((2, 3), (1,))  # shards 2, 3 have no copy left
    s = Scenario(name="x", at=At(step=3, phase="persist"), conditions=(DurableWriteOutage((3,)),))
    assert versions_after(s, CONFIG, committed=[0, 1, 2], persisted=[1], p=p, hosts=hosts).persisted == (1,)


def test_report_table_and_json(tmp_path):
    s = Scenario(name="demo", at=At(step=2), faults=(RemoveHosts((0, 1)),), conditions=(DurableUnreachable(),))
    good = ScenarioResult(scenario=s, prediction=plan_scenario(s, CONFIG), observed={"outcome": "error", "step": None},
                          checks=[Check("prediction", True, "ok")], recovery_s=3.21)
    bad = ScenarioResult(scenario=Scenario(name="other", at=At(step=2)), prediction=None,
                         observed={"outcome": "memory", "step": 1}, steps_lost=1,
                         checks=[Check("prediction", False, "predicted memory@2; observed memory@1")])
    report = MatrixReport(results=[good, bad], config=CONFIG, seconds=12.0)
    table = report.format_table()
    lines = table.splitlines()
    assert lines[0].split() == ["scenario", "predicted", "observed", "steps", "lost", "recovery", "s", "verdict"]
    assert lines[2].split() == ["demo", "error", "error", "-", "3.2", "PASS"]
    assert lines[3].split() == ["other", "-", "memory@1", "1", "-", "MISMATCH"]
    assert "other: prediction: predicted memory@2; observed memory@1" in table
    assert report.exit_code == 1 and not report.ok
    path = tmp_path / "r.json"
    report.write_json(str(path))
    doc = json.loads(path.read_text())
    assert doc["ok"] is False and doc["counts"] == {"MISMATCH": 1, "PASS": 1}
    assert doc["scenarios"][0]["predicted"]["outcome"] == "error"
    assert doc["scenarios"][1]["checks"][0] == {"name": "prediction", "ok": False,
                                                "detail": "predicted memory@2; observed memory@1"}


def test_cli_lists_the_matrix(capsys):
    parser = argparse.ArgumentParser()
    add_chaos_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--matrix", "ci", "--list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(CI_SCENARIOS)
    args = parser.parse_args(["chaos", "--list", "-k", "pair-ring-*"])
    assert args.func(args) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6
    args = parser.parse_args(["chaos", "--steps", "3"])
    assert args.func(args) == 2  # too few steps for the matrix: a clear error, nothing started


def test_an_infrastructure_failure_is_its_own_verdict_and_fails_the_run():
    s = Scenario(name="x", at=At(step=2))
    infra = ScenarioResult(scenario=s, error="InfraError: rank 1 (host 1): rendezvous failed", infra=True)
    other = ScenarioResult(scenario=Scenario(name="y", at=At(step=2)), error="HarnessError: no commit")
    ok = ScenarioResult(scenario=Scenario(name="z", at=At(step=2)), checks=[Check("prediction", True)])
    report = MatrixReport(results=[infra, other, ok], config=CONFIG)
    assert [r.verdict for r in report.results] == ["INFRA-ERROR", "ERROR", "PASS"]
    assert report.counts() == {"INFRA-ERROR": 1, "ERROR": 1, "PASS": 1} and report.exit_code == 1
    table = report.format_table()
    assert "x: infrastructure error (not a verdict on the library): InfraError" in table
    assert report.to_json()["scenarios"][0]["verdict"] == "INFRA-ERROR"


def _listening(port):
    """Whether a socket on this machine listens on TCP ``port`` (Linux: /proc/net/tcp{,6}).
    Connections of a closed store (TIME_WAIT) and other processes' outgoing sockets that
    happen to get the port next do not count."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as fh:
                rows += [line.split() for line in fh.readlines()[1:]]
    return any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows)  # 0A: LISTEN


def test_the_rendezvous_port_is_bound_by_its_store_from_the_start():
    """No port is found free, released and bound again later: the store binds port 0 and
    holds the port the kernel gave it until ``close``."""
    import datetime

    import torch.distributed as dist

    rendezvous = Rendezvous(world_size=2, timeout_s=10)
    host, port = rendezvous.address
    try:
        assert port > 0 and _listening(port)
        client = dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
    finally:
        rendezvous.close()
    assert rendezvous.closed and not _listening(port)


# --- Ray: one harness for the module ---------------------------------------------------------------
@pytest.fixture(scope="module")
def harness():
    h = Harness(CONFIG)
    h.start()
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import tests/
    try:
        yield h
    finally:
        h.close()


@pytest.mark.ray
def test_ci_matrix_matches_the_planner_and_resumes_bit_identically(harness, tmp_path):
    report = run_matrix(ci_matrix(CONFIG), harness=harness, json_path=str(tmp_path / "chaos.json"))
    print("\n" + report.format_table())
    assert report.ok, report.format_table()
    doc = json.loads((tmp_path / "chaos.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == list(CI_SCENARIOS)
    by_name = {r.scenario.name: r for r in report.results}
    assert by_name["pair-group-0-1"].observed["outcome"] == "durable"  # a whole placement group lost
    assert by_name["resize-after-loss"].observed["world_size"] == 2
    assert by_name["resize-after-loss"].observed["saved_world_size"] == 4
    # Nothing left to restore from: restore fails loudly instead of starting from scratch.
    assert by_name["durable-unreachable-group-lost"].observed["outcome"] == "error"
    for r in report.results:
        names = {c.name for c in r.checks if c.ok}
        expected = {"prediction", "pre_fault", "durable_tier"}
        if r.observed["outcome"] != "error":
            expected |= {"agreed", "exact_restore", "committed_only", "continued", "final_state", "finished"}
        assert expected <= names, (r.scenario.name, r.checks)


def _acknowledges_without_copying(config, rank, world_size):
    """A deliberately broken store: every rank's shard stays on its own host only, yet the
    version commits (the host stores are told one copy is enough: a placement bug that
    "forgets" the peers)."""
    import dataclasses

    from gemini_ckpt.ray.client import connect

    return connect(dataclasses.replace(config, replicas=1), rank=rank, world_size=world_size)


@pytest.mark.ray
def test_the_harness_reports_a_store_that_skips_replication(harness):
    s = Scenario(name="buggy-store-host-lost", at=At(step=2), faults=(RemoveHosts((1,)),))
    result = run_scenario(s, harness, store_factory=_acknowledges_without_copying)
    assert result.error is None, result.error
    assert result.verdict == "MISMATCH"
    assert result.prediction.label() == "memory@2"
    assert result.observed_label == "durable@1"  # host 1's only copy died with it
    failed = {c.name for c in result.failed_checks()}
    assert "prediction" in failed


class _UserJob:
    """A user's own training function: DDP, SGD with momentum, a step LR schedule."""

    def build(self, rank, world_size, seed):
        import torch
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel

        from gemini_ckpt import TrainState

        torch.manual_seed(seed)
        self.rank, self.seed = rank, seed
        # find_unused_parameters=True: no bucket rebuild after the first step, so a restarted
        # process sums gradients in the same order as the uninterrupted run.
        self.model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                                             find_unused_parameters=True)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        return TrainState(model=self.model, optimizer=self.opt, scheduler=self.sched)

    def step(self, step):
        import torch

        g = torch.Generator().manual_seed(self.seed * 7919 + step * 31 + self.rank)
        loss = self.model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


@pytest.mark.ray
def test_a_user_job_runs_under_the_harness(harness):
    s = Scenario(name="user-job-kill-worker", at=At(step=2, phase="committed", rank=2), faults=(KillWorker((2,)),))
    result = run_scenario(s, harness, job=_UserJob())
    assert result.ok, (result.error, result.failed_checks())
    assert result.observed_label == "memory@2"


@pytest.mark.ray
def test_ranks_join_the_process_group_through_the_drivers_bound_store(harness):
    hosts = tuple(range(CONFIG.hosts))
    job = JobRun(harness, "rendezvous-port", job=TinyJob(), persist=False)
    harness.ensure(hosts)
    try:
        answers = job.setup(hosts)
        address = list(job.rendezvous.address)
        assert {r: a["rendezvous"] for r, a in answers.items()} == {r: address for r in range(len(hosts))}
        assert _listening(address[1])  # the driver's store holds it while the job runs
    finally:
        job.cleanup(hosts)
    assert job.rendezvous is None and not _listening(address[1])  # and releases it with the job


class _LosesItsRendezvousOnce(TinyJob):
    """TinyJob, except that the second time rank 1 builds it (the first scenario's start, after
    the reference run) it breaks that process's torch.distributed exactly as the incident of
    issue 13 did: its process group's store cannot bind a port another socket holds
    (EADDRINUSE). A failed init_process_group leaves the process unfit for the next one
    (it used up a group name its peers did not), so the harness must replace it."""

    def __init__(self, counter_path):
        super().__init__()
        self.counter_path = counter_path

    def build(self, rank, world_size, seed):
        if rank == 1:
            with open(self.counter_path, "a") as fh:
                fh.write("x")
            if os.path.getsize(self.counter_path) == 2:
                import datetime

                import torch.distributed as dist

                dist.destroy_process_group()
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", 0))
                    taken.listen()
                    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{taken.getsockname()[1]}",
                                            rank=0, world_size=2, timeout=datetime.timedelta(seconds=5))
                raise RuntimeError("the process group started on a port already taken")
        return super().build(rank, world_size, seed)


@pytest.mark.ray
def test_a_scenario_that_fails_at_setup_is_an_infra_error_and_the_next_one_passes(harness, tmp_path):
    job = _LosesItsRendezvousOnce(str(tmp_path / "builds-of-rank-1"))
    scenarios = [Scenario(name="fails-at-setup", at=At(step=2), faults=(KillStore((1,)),)),
                 Scenario(name="runs-next", at=At(step=2), faults=(KillStore((1,)),))]
    report = run_matrix(scenarios, harness=harness, job=job, json_path=str(tmp_path / "chaos.json"))
    print("\n" + report.format_table())
    failed, after = report.results
    assert failed.verdict == "INFRA-ERROR" and failed.infra, failed.error
    assert "rank 1 (host 1): build failed" in failed.error and "EADDRINUSE" in failed.error
    assert failed.prediction is None and not failed.checks  # no verdict on the library
    assert after.ok, (after.error, after.failed_checks())
    assert after.observed_label == "memory@2" and not after.notes  # nothing was left behind
    assert report.exit_code == 1 and report.counts() == {"INFRA-ERROR": 1, "PASS": 1}
    assert "fails-at-setup: infrastructure error (not a verdict on the library)" in report.format_table()
    doc = json.loads((tmp_path / "chaos.json").read_text())
    assert [s["verdict"] for s in doc["scenarios"]] == ["INFRA-ERROR", "PASS"]
