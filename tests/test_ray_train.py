"""Ray Train integration: a TorchTrainer job with ``gemini_ckpt.ray_train`` survives a killed
worker and a lost host by restoring from peer memory, bit-identically; persisted versions are
Ray checkpoints that stock DCP loads; the demo runs end to end.

The Ray scenarios share one local cluster (head without CPUs + 4 simulated hosts, one Ray
Train worker each) built by the demo's own ``start_cluster``; the demo scenario runs last
because it replaces a host. Run:
``RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python -m pytest tests/test_ray_train.py -q``
"""

from __future__ import annotations

import os
import types

import pyarrow.fs as pafs
import pytest

from gemini_ckpt import CheckpointConfig, CheckpointError, ConfigError
from gemini_ckpt._demo import DemoOptions, DemoReport, add_demo_command
from gemini_ckpt._timeline import plot_timeline
from gemini_ckpt.ray_train import DURABLE_DIR, HostStores, checkpointer, resolve_config

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HOSTS = 4
STEPS = 14  # persisted by policy: 4, 9; on close: 13
PERSIST_EVERY = 5


# --- no Ray cluster -------------------------------------------------------------------------------
def _storage(path: str):
    """Ray Train's StorageContext, as far as the integration reads it."""
    return types.SimpleNamespace(experiment_fs_path=path, storage_filesystem=pafs.LocalFileSystem())


def test_config_defaults_come_from_the_run(tmp_path):
    run_dir = str(tmp_path / "run-7")
    config, durable = resolve_config(CheckpointConfig(persist_every=10), run_name="run-7",
                                     storage=_storage(run_dir))
    assert durable is None
    assert config.namespace == "run-7"
    assert config.durable_uri == os.path.join(run_dir, DURABLE_DIR)
    assert config.keep_durable > 10**6  # Ray's num_to_keep decides retention
    # Explicit settings win; without a durable tier nothing durable is set.
    config, _ = resolve_config(CheckpointConfig(namespace="mine"), run_name="run-7", storage=_storage(run_dir))
    assert config.namespace == "mine" and config.durable_uri is None
    inside = os.path.join(run_dir, "elsewhere")
    config, _ = resolve_config(CheckpointConfig(persist_every=5, durable_uri=inside), run_name="r",
                               storage=_storage(run_dir))
    assert config.durable_uri == inside


def test_durable_uri_outside_the_run_directory_cannot_be_reported(tmp_path):
    cfg = CheckpointConfig(persist_every=5, durable_uri=str(tmp_path / "other"), keep_durable=2)
    with pytest.raises(ConfigError, match="outside this Ray Train run's directory.*report=False"):
        resolve_config(cfg, run_name="r", storage=_storage(str(tmp_path / "run")))
    config, _ = resolve_config(cfg, run_name="r", storage=_storage(str(tmp_path / "run")), report=False)
    assert config.durable_uri == str(tmp_path / "other") and config.keep_durable == 2


def test_checkpointer_outside_ray_train_says_where_it_belongs():
    from gemini_ckpt import TrainState
    from torch import nn

    with pytest.raises(CheckpointError, match="inside a Ray Train training function"):
        checkpointer(TrainState(model=nn.Linear(2, 2)), CheckpointConfig())


def test_host_stores_callback_checks_its_config():
    with pytest.raises(TypeError, match="gemini_ckpt.CheckpointConfig"):
        HostStores({"replicas": 2})
    assert HostStores(CheckpointConfig(namespace="x")).namespace == "x"


def test_demo_options_and_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    add_demo_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--hosts", "3", "--kill-at-step", "5", "--steps", "9", "--no-failure"])
    assert (args.hosts, args.kill_at_step, args.steps, args.no_failure) == (3, 5, 9, True)
    with pytest.raises(ValueError, match="--kill-host"):
        DemoOptions(hosts=4, kill_host=4)
    with pytest.raises(ValueError, match="--kill-at-step"):
        DemoOptions(steps=10, kill_at_step=9)
    with pytest.raises(ValueError, match="--replicas"):
        DemoOptions(hosts=2, replicas=3)


def test_report_counts_steps_lost_against_durable_only(tmp_path):
    report = DemoReport(options=DemoOptions(), run_dir=str(tmp_path), seconds=1.0, failure_step=34,
                        failure_t=5.0, restored_step=33, restored_from="memory", restore_s=0.2,
                        durable_before_failure=29, stalls_s=[0.001, 0.002, 0.003])
    assert (report.steps_lost, report.steps_lost_durable_only) == (1, 5)
    text = report.format()
    assert "restored     step 33 from memory" in text and "would have lost 5" in text
    assert DemoReport(options=DemoOptions(), run_dir=".", seconds=0, failure_step=3).steps_lost_durable_only == 4


def test_timeline_png(tmp_path):
    events = [{"kind": "step", "t": 0.1 * i, "step": i, "stall_s": 0.002, "attempt": 0} for i in range(12)]
    events += [{"kind": "commit", "t": 0.1 * i + 0.05, "step": i, "latency_s": 0.05} for i in range(11)]
    events += [{"kind": "persist", "t": 1.0, "step": 9}, {"kind": "failure", "t": 1.25, "host": 2},
               {"kind": "restore", "t": 3.0, "step": 10, "source": "memory", "seconds": 0.3}]
    events += [{"kind": "step", "t": 3.0 + 0.1 * i, "step": 11 + i, "stall_s": 0.002, "attempt": 1} for i in range(5)]
    path = plot_timeline(events, str(tmp_path / "t.png"), title="test")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- Ray Train on a local cluster -------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    from gemini_ckpt._demo import start_cluster, stop_cluster

    cluster, nodes = start_cluster(HOSTS)
    try:
        yield cluster, nodes
    finally:
        stop_cluster(cluster)


def _fit(tmp_path, name: str, *, kill=None, num_to_keep=2):
    from ray.train import CheckpointConfig as RayCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from gemini_ckpt._demo import train_loop

    ckpt_config = CheckpointConfig(replicas=2, keep_in_memory=2, persist_every=PERSIST_EVERY, timeout_s=60.0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"ckpt": ckpt_config, "steps": STEPS, "kill": kill},
        scaling_config=ScalingConfig(num_workers=HOSTS),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), callbacks=[HostStores(ckpt_config)],
                             failure_config=FailureConfig(max_failures=2),
                             checkpoint_config=RayCheckpointConfig(num_to_keep=num_to_keep)))
    return trainer.fit()


def _gemini_actors(namespace: str, timeout: float = 10.0) -> dict:
    """The namespace's live gemini_ckpt actors, once none are left (or after ``timeout``)."""
    import time

    from gemini_ckpt._cluster import named_actors

    deadline = time.monotonic() + timeout
    while (found := named_actors().get(namespace, {})) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


@pytest.mark.ray
class TestRayTrain:
    reference: dict = {}

    def test_uninterrupted_run_reports_persisted_versions_that_stock_dcp_loads(self, cluster, tmp_path):
        import torch.distributed.checkpoint as dcp

        from gemini_ckpt._demo import digest_state
        from gemini_ckpt._toy import TinyLM

        result = _fit(tmp_path, "reference")
        out = result.return_value
        assert out["restore"] is None and out["reported"] == [4, 9, 13]
        TestRayTrain.reference.update(out)
        root = os.path.join(str(tmp_path), "reference", DURABLE_DIR)
        assert result.checkpoint.path == os.path.join(root, "step_000000013")
        assert sorted(c.path for c, _ in result.best_checkpoints) == [os.path.join(root, "step_000000009"),
                                                                      os.path.join(root, "step_000000013")]
        assert result.metrics["step"] == 13
        # Ray's num_to_keep=2 owns retention: the oldest reported version is gone.
        assert not os.path.exists(os.path.join(root, "step_000000004"))
        # A stock DCP load of Ray's checkpoint gives the final model.
        state = {"model": TinyLM().state_dict()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(result.checkpoint.path))
        assert digest_state(state["model"]) == out["model_digest"]
        # fit() is over: the run's host stores and registry are gone.
        assert not _gemini_actors("reference")

    def test_killed_worker_restarts_and_restores_from_memory(self, cluster, tmp_path):
        if not TestRayTrain.reference:
            pytest.skip("needs the uninterrupted reference run")
        marker = tmp_path / "killed"
        result = _fit(tmp_path, "sigkill", kill={"rank": 1, "step": 7, "marker": str(marker)})
        out = result.return_value
        assert marker.exists()  # rank 1 did SIGKILL itself after saving step 7
        assert out["restore"]["source"] == "memory" and out["restore"]["step"] in (6, 7)
        assert out["digest"] == TestRayTrain.reference["digest"]
        assert result.checkpoint.path.endswith("step_000000013")
        assert not _gemini_actors("sigkill")


@pytest.mark.ray
def test_demo_host_loss_resumes_from_peer_memory_on_a_replacement_host(cluster, tmp_path, capsys):
    """The demo, reduced: host 2 is removed after step 8 (its raylet, worker and host store
    die), a replacement joins, Ray Train restarts every worker and they restore from the
    surviving holders' memory; the final state equals the uninterrupted run's."""
    from gemini_ckpt._demo import run_demo

    options = DemoOptions(hosts=HOSTS, replicas=2, kill_host=2, kill_at_step=8, steps=STEPS,
                          persist_every=PERSIST_EVERY, out=str(tmp_path))
    report = run_demo(options, cluster=cluster)
    text = report.format()
    print(text)
    assert report.restored_from == "memory", text
    assert report.restored_step is not None and report.restored_step >= 7, text
    assert report.failure_step >= 8 and report.steps_lost < report.steps_lost_durable_only, text
    assert report.bytes_peer > 0  # host 2's shards came from its peer's memory
    assert "from memory" in text and os.path.isfile(report.timeline)
    assert os.path.isfile(os.path.join(report.run_dir, "report.txt"))
    if TestRayTrain.reference:
        assert report.final_digest == TestRayTrain.reference["digest"]
