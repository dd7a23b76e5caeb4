"""Ray Train integration: a TorchTrainer job with ``gemini_ckpt.integrations.ray_train`` survives a killed
worker and a lost host by restoring from peer memory, bit-identically; persisted versions are
Ray checkpoints that stock DCP loads; the demo runs end to end.

The scenarios run on the session's cluster (head without CPUs + 4 simulated hosts, one Ray
Train worker each); each compares with one uninterrupted reference run (a module fixture, so
any of them passes alone). The pure parts are in ``tests/unit/integrations/test_ray_train_config.py``. Run:
``python -m pytest tests/integration/integrations/test_ray_train.py -q``
"""

from __future__ import annotations

import os
import re

import pytest

from gemini_ckpt import CheckpointConfig
from gemini_ckpt.demo.options import DemoOptions
from gemini_ckpt.integrations.ray_train import (
    DURABLE_DIR,
    HostStores,
    detection_env,
    host_stores,
    ranks_on_hosts,
    recoverable,
    torch_config,
)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HOSTS = 4
STEPS = 14  # persisted by policy: 4, 9; on close: 13
PERSIST_EVERY = 5


# --- Ray Train on a local cluster -------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


def _fit(
    tmp_path,
    name: str,
    *,
    kill=None,
    num_to_keep=2,
    callback=False,
    staging="copy",
    in_place=False,
    progress=None,
    raise_at=None,
    max_stuck=3,
    max_failures=2,
):
    """One TorchTrainer run of the demo's loop. Host stores are stopped by ``host_stores()``
    around ``fit()`` (the public path), or with ``callback`` by the ``HostStores`` adapter.
    ``in_place``: recover in place (``recoverable`` + ``torch_config``)."""
    from ray.train import CheckpointConfig as RayCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from gemini_ckpt.demo.job import train_loop

    ckpt_config = CheckpointConfig(
        replicas=2, keep_in_memory=2, persist_every=PERSIST_EVERY, timeout_s=60.0, staging=staging
    )
    trainer = TorchTrainer(
        recoverable(train_loop) if in_place else train_loop,
        torch_config=torch_config(reform_timeout_s=60, max_stuck=max_stuck) if in_place else None,
        train_loop_config={
            "ckpt": ckpt_config,
            "steps": STEPS,
            "kill": kill,
            "progress": progress,
            "raise_at": raise_at,
        },
        scaling_config=ScalingConfig(num_workers=HOSTS, label_selector=ranks_on_hosts(HOSTS)),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path),
            callbacks=[HostStores(ckpt_config)] if callback else [],
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=RayCheckpointConfig(num_to_keep=num_to_keep),
        ),
    )
    if callback:
        return trainer.fit()
    with host_stores(ckpt_config, run_name=name):
        return trainer.fit()


def _gemini_actors(namespace: str, timeout: float = 10.0) -> dict:
    """The namespace's live gemini_ckpt actors, once none are left (or after ``timeout``)."""
    import time

    from gemini_ckpt.hoststore.cluster import named_actors

    deadline = time.monotonic() + timeout
    while (found := named_actors().get(namespace, {})) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The uninterrupted run every failure scenario must end equal to: ``(run dir, Result)``."""
    tmp = tmp_path_factory.mktemp("reference")
    return tmp, _fit(tmp, "reference")


@pytest.mark.ray
class TestRayTrain:
    def test_uninterrupted_run_reports_persisted_versions_that_stock_dcp_loads(self, reference):
        import torch.distributed.checkpoint as dcp

        from gemini_ckpt.demo.job import digest_state
        from gemini_ckpt.toy import TinyLM

        tmp_path, result = reference
        out = result.return_value
        assert out["restore"] is None and out["reported"] == [4, 9, 13]
        root = os.path.join(str(tmp_path), "reference", DURABLE_DIR)
        assert result.checkpoint.path == os.path.join(root, "step_000000013")
        assert sorted(c.path for c, _ in result.best_checkpoints) == [
            os.path.join(root, "step_000000009"),
            os.path.join(root, "step_000000013"),
        ]
        assert result.metrics["step"] == 13
        # Ray's num_to_keep=2 owns retention: the oldest reported version is gone.
        assert not os.path.exists(os.path.join(root, "step_000000004"))
        # A stock DCP load of Ray's checkpoint gives the final model.
        state = {"model": TinyLM().state_dict()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(result.checkpoint.path))
        assert digest_state(state["model"]) == out["model_digest"]
        # fit() is over: host_stores() stopped the run's host stores and registry.
        assert not _gemini_actors("reference")

    @pytest.mark.slow
    @pytest.mark.ci
    def test_killed_worker_restarts_and_restores_from_memory(self, reference, tmp_path):
        """With overlapped staging: its versions are the reference's (copy staging) bit for bit."""
        marker = tmp_path / "killed"
        result = _fit(
            tmp_path, "sigkill", kill={"rank": 1, "step": 7, "marker": str(marker)}, callback=True, staging="overlap"
        )
        out = result.return_value
        assert marker.exists()  # rank 1 did SIGKILL itself after saving step 7
        assert out["restore"]["source"] == "memory" and out["restore"]["step"] in (6, 7)
        assert out["digest"] == reference[1].return_value["digest"]
        assert result.checkpoint.path.endswith("step_000000013")
        assert not _gemini_actors("sigkill")  # the HostStores callback stopped them at the end of fit()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_demo_host_loss_resumes_from_peer_memory_on_a_replacement_host(cluster, reference, tmp_path, capsys):
    """The demo, reduced: host 2 is removed after step 8 (its raylet, worker and host store
    die), a replacement joins and is given host 2's copies by the surviving holders, Ray Train
    restarts every worker (rank r on host r) and each restores from its own host's memory;
    the final state equals the uninterrupted run's."""
    from gemini_ckpt.demo.driver import run_demo

    options = DemoOptions(
        hosts=HOSTS,
        replicas=2,
        kill_host=2,
        kill_at_step=8,
        steps=STEPS,
        persist_every=PERSIST_EVERY,
        out=str(tmp_path),
    )
    report = run_demo(options, cluster=cluster)
    text = report.format()
    print(text)
    assert report.restored_from == "memory", text
    assert report.restored_step is not None and report.restored_step >= 7, text
    assert report.failure_step >= 8 and report.steps_lost < report.steps_lost_durable_only, text
    # Rank 2 is pinned to host 2 (ranks_on_hosts): the replacement's store was given host 2's
    # copies before the new workers started, so every rank read its shard from its own host's
    # memory. From peers only the few replicated tensors (step counters) that DCP's planner had
    # another rank save: a few KB, where a shard is 65 KB (before pinning: whole shards).
    stages = {what: t for t, what, _ in report.stages}
    assert stages["replacement seeded"] < stages["restore called"], text
    assert report.bytes_local > 0 and report.bytes_peer < 8192, text
    assert "from memory" in text and os.path.isfile(report.timeline)
    assert os.path.isfile(os.path.join(report.run_dir, "report.txt"))
    assert report.final_digest == reference[1].return_value["digest"]


@pytest.fixture
def progress():
    """An actor the demo's loop reports its events to (pids, restores, steps): ``(name, events())``."""
    import uuid

    import ray

    from gemini_ckpt.demo.job import RAY_NAMESPACE, Progress

    name = f"progress-{uuid.uuid4().hex[:8]}"
    actor = (
        ray.remote(Progress)
        .options(name=name, namespace=RAY_NAMESPACE, num_cpus=0, resources={"node:__internal_head__": 0.001})
        .remote()
    )
    yield name, lambda: ray.get(actor.since.remote(0), timeout=60)
    ray.kill(actor)


@pytest.mark.ray
@pytest.mark.parametrize(
    "killed", [pytest.param(1, marks=pytest.mark.slow), pytest.param(0, marks=[pytest.mark.slow, pytest.mark.ci])]
)  # CI: rank 0, after the default run (and chaos: 2, 3)
def test_in_place_a_killed_worker_is_replaced_alone_and_every_rank_rolls_back_in_its_own_process(
    reference, tmp_path, progress, monkeypatch, killed
):
    """Rank ``killed`` SIGKILLs itself after saving step 7; Ray Train replaces only it (same rank,
    same host); the other three keep their processes, form the process group again with it and run
    the training function again from the newest committed version; the run ends equal to the
    uninterrupted one. Rank 0 too: the process group's store is not on a worker."""
    for key, value in detection_env().items():
        monkeypatch.setenv(key, value)
    name, events = progress
    marker = tmp_path / "killed"
    result = _fit(
        tmp_path,
        f"inplace-{killed}",
        kill={"rank": killed, "step": 7, "marker": str(marker)},
        in_place=True,
        progress=name,
    )
    assert marker.exists()
    starts = [e for e in events() if e["kind"] == "start"]
    pids = {r: [e["pid"] for e in starts if e["rank"] == r] for r in range(HOSTS)}
    killed_pid = int(marker.read_text())
    for rank in range(HOSTS):
        if rank == killed:
            assert len(pids[rank]) == 2 and pids[rank][0] == killed_pid and pids[rank][1] != killed_pid, pids
            # the replacement ran in a warm spare: a process the backend had the raylet start before the kill
            newcomer = [e for e in starts if e["rank"] == rank][1]
            assert newcomer["process_t"] < os.path.getmtime(marker), (newcomer, os.path.getmtime(marker))
        else:  # a survivor: the same process ran the training function twice
            assert len(pids[rank]) == 2 and pids[rank][0] == pids[rank][1], pids
    restores = [e for e in events() if e["kind"] == "restore"]
    assert len(restores) == HOSTS and {e["source"] for e in restores} == {"memory"}
    assert len({e["step"] for e in restores}) == 1 and restores[0]["step"] in (6, 7)
    out = result.return_value
    assert out["digest"] == reference[1].return_value["digest"]
    assert result.checkpoint.path.endswith("step_000000013")
    assert sorted(c.path[-4:] for c, _ in result.best_checkpoints) == ["0009", "0013"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("where", [None, 2], ids=["every-rank", "one-rank"])
def test_in_place_an_error_of_the_training_code_ends_the_run_after_bounded_tries(tmp_path, monkeypatch, where):
    """The training code raises at step 9 (on every rank, or on rank 2 only): it is not a peer's
    failure, so it is not recovered in place; the worker(s) are replaced (in place, or all of them),
    fail again at the same step, and the controller ends the run instead of looping, even with
    ``max_failures=-1`` (with a finite one, Ray Train ends it with the same error sooner)."""
    from ray.train import TrainingFailedError

    for key, value in detection_env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainingFailedError) as caught:
        _fit(
            tmp_path, f"bug-{where}", in_place=True, raise_at={"step": 9, "rank": where}, max_stuck=2, max_failures=-1
        )  # only gemini_ckpt's bound ends it
    text = str(caught.value)
    # the controller's count or the ranks' own (survivors recovering in place from the lost peer)
    assert re.search(r"2 (in-place )?recoveries in a row ended without a newer version committed", text), text
    assert "ValueError: the training code fails at step 9" in text, text


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_in_place_a_rank_failing_after_the_others_finished_ends_the_run_with_its_error(tmp_path, monkeypatch):
    """Every rank but 1 returns; rank 1 then raises. No process group can form with the finished
    ranks again, so the controller ends the run at the replacement's start with rank 1's error
    (before: replacement after replacement, each waiting for a round that never forms, until the
    bound on starts; 12 starts and 84 s at 2 workers)."""
    from ray.train import TrainingFailedError

    for key, value in detection_env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainingFailedError) as caught:
        _fit(tmp_path, "end-bug", in_place=True, raise_at={"step": "end", "rank": 1}, max_failures=-1)
    text = str(caught.value)
    assert "3 worker(s) of this run already finished their training function" in text, text
    assert "ValueError: the training code fails after its last step on rank 1" in text, text


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_chaos_in_place_a_survivor_killed_during_the_reform(cluster):
    """The in-place chaos scenario CI runs (the full set: ``python -m gemini_ckpt chaos --matrix
    inplace``): rank 2 SIGKILLed, then rank 3 while the others wait for rank 2's replacement; every
    rank moves one round on, both are replaced, and the run ends equal to an uninterrupted one."""
    from gemini_ckpt.chaos._inplace import SCENARIOS, run_inplace

    scenario = next(s for s in SCENARIOS if s.name == "inplace-kill-during-reform")
    [result] = run_inplace([scenario], cluster=cluster, log=print)
    assert result.verdict == "PASS", result.to_json()
