"""The failure-injection harness (``gemini_ckpt.chaos``): every fault's outcome matches the
planner's prediction and the resumed run is bit-identical to an uninterrupted one; and the
harness notices when the library misbehaves (a store that acknowledges copies it never made).

One harness for the module, on the session's cluster (head + 4 simulated hosts; rank actors
reused across scenarios), runs the reduced CI matrix (``gemini_ckpt.chaos.CI_SCENARIOS``);
the pure parts are in ``tests/unit/tools/test_chaos_plans.py``. Every test here is ``slow`` and
``ci``: CI runs them after the default suite, on one harness. Run:
``python -m pytest tests/integration/tools/test_chaos.py -q -m "slow or not slow"``
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from gemini_ckpt.chaos import (
    CI_SCENARIOS,
    At,
    ChaosConfig,
    Harness,
    KillStore,
    KillWorker,
    RemoveHosts,
    Scenario,
    TinyJob,
    ci_matrix,
    run_matrix,
    run_scenario,
)
from helpers import listening
from gemini_ckpt.chaos._jobrun import JobRun

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

CONFIG = ChaosConfig()  # 4 hosts, replicas 2, steps 0..5, persisted 1, 3, 5


# --- Ray: one harness for the module ---------------------------------------------------------------
@pytest.fixture(scope="module")
def harness(ray_cluster):
    h = Harness(CONFIG, cluster=ray_cluster)
    h.start()
    try:
        yield h
    finally:
        h.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
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

    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings

    return connect(store_settings(dataclasses.replace(config, replicas=1)), rank=rank, world_size=world_size)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # with the CI matrix: one harness cluster for all, after the default run
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
        self.model = DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), find_unused_parameters=True
        )
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
@pytest.mark.slow
@pytest.mark.ci  # with the CI matrix: one harness cluster for all, after the default run
def test_a_user_job_runs_under_the_harness(harness):
    s = Scenario(name="user-job-kill-worker", at=At(step=2, phase="committed", rank=2), faults=(KillWorker((2,)),))
    result = run_scenario(s, harness, job=_UserJob())
    assert result.ok, (result.error, result.failed_checks())
    assert result.observed_label == "memory@2"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # with the CI matrix: one harness cluster for all, after the default run
def test_ranks_join_the_process_group_through_the_drivers_bound_store(harness):
    hosts = tuple(range(CONFIG.hosts))
    job = JobRun(harness, "rendezvous-port", job=TinyJob(), persist=False)
    harness.ensure(hosts)
    try:
        answers = job.setup(hosts)
        address = list(job.rendezvous.address)
        assert {r: a["rendezvous"] for r, a in answers.items()} == {r: address for r in range(len(hosts))}
        assert listening(address[1])  # the driver's store holds it while the job runs
    finally:
        job.cleanup(hosts)
    assert job.rendezvous is None and not listening(address[1])  # and releases it with the job


class _LosesItsRendezvousOnce(TinyJob):
    """TinyJob, except that the second time rank 1 builds it (the first scenario's start, after
    the reference run) it breaks that process's torch.distributed exactly as an earlier
    incident did: its process group's store cannot bind a port another socket holds
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
                    dist.init_process_group(
                        "gloo",
                        init_method=f"tcp://127.0.0.1:{taken.getsockname()[1]}",
                        rank=0,
                        world_size=2,
                        timeout=datetime.timedelta(seconds=5),
                    )
                raise RuntimeError("the process group started on a port already taken")
        return super().build(rank, world_size, seed)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # with the CI matrix: one harness cluster for all, after the default run
def test_a_scenario_that_fails_at_setup_is_an_infra_error_and_the_next_one_passes(harness, tmp_path):
    job = _LosesItsRendezvousOnce(str(tmp_path / "builds-of-rank-1"))
    scenarios = [
        Scenario(name="fails-at-setup", at=At(step=2), faults=(KillStore((1,)),)),
        Scenario(name="runs-next", at=At(step=2), faults=(KillStore((1,)),)),
    ]
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
