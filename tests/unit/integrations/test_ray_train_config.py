"""Ray Train integration without a cluster: settings default from the run, retention is Ray's,
the callback adapter checks its config, ``host_stores()`` needs a name; the demo's options,
report and timeline. (TorchTrainer runs are in ``tests/integration/integrations/test_ray_train.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pyarrow.fs as pafs
import pytest

from gemini_ckpt import CheckpointConfig, CheckpointError, ConfigError
from gemini_ckpt.demo.cli import add_demo_command
from gemini_ckpt.demo.options import DemoOptions
from gemini_ckpt.demo.report import DemoReport
from gemini_ckpt.demo.timeline import plot_timeline
from gemini_ckpt.integrations.ray_train import (
    DURABLE_DIR,
    HostStores,
    RayTrainCheckpointer,
    checkpointer,
    host_stores,
    resolve_config,
)
from gemini_ckpt.retention import KeepNewest, LeftToRayTrain


def _storage(path: str):
    """Ray Train's StorageContext, as far as the integration reads it."""
    return types.SimpleNamespace(experiment_fs_path=path, storage_filesystem=pafs.LocalFileSystem())


def test_config_defaults_come_from_the_run(tmp_path):
    run_dir = str(tmp_path / "run-7")
    config, durable = resolve_config(CheckpointConfig(persist_every=10), run_name="run-7", storage=_storage(run_dir))
    assert durable is None
    assert config.namespace == "run-7"
    assert config.durable_uri == os.path.join(run_dir, DURABLE_DIR)
    assert config.keep_durable == CheckpointConfig().keep_durable  # untouched; but it does not apply:
    local, _ = resolve_config(
        CheckpointConfig(store="local", persist_every=10), run_name="run-7", storage=_storage(run_dir)
    )
    from gemini_ckpt import TrainState
    from torch import nn

    ckpt = RayTrainCheckpointer(TrainState(model=nn.Linear(2, 2)), local, storage=_storage(run_dir))
    try:  # abort, not close: close reports to Ray Train, which needs a training function
        assert ckpt.durable.retention == LeftToRayTrain()  # Ray's num_to_keep decides retention
        assert ckpt.durable.retention.doomed([1, 2, 3, 4, 5]) == []
    finally:
        ckpt.abort()
    ckpt = RayTrainCheckpointer(TrainState(model=nn.Linear(2, 2)), local, storage=_storage(run_dir), report=False)
    try:
        assert ckpt.durable.retention == KeepNewest(local.keep_durable)
    finally:
        ckpt.abort()
    # Explicit settings win; without a durable tier nothing durable is set.
    config, _ = resolve_config(CheckpointConfig(namespace="mine"), run_name="run-7", storage=_storage(run_dir))
    assert config.namespace == "mine" and config.durable_uri is None
    inside = os.path.join(run_dir, "elsewhere")
    config, _ = resolve_config(
        CheckpointConfig(persist_every=5, durable_uri=inside), run_name="r", storage=_storage(run_dir)
    )
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
    report = DemoReport(
        options=DemoOptions(),
        run_dir=str(tmp_path),
        seconds=1.0,
        failure_step=34,
        failure_t=5.0,
        restored_step=33,
        restored_from="memory",
        restore_s=0.2,
        durable_before_failure=29,
        stalls_s=[0.001, 0.002, 0.003],
    )
    assert (report.steps_lost, report.steps_lost_durable_only) == (1, 5)
    text = report.format()
    assert "restored     step 33 from memory" in text and "would have lost 5" in text
    assert DemoReport(options=DemoOptions(), run_dir=".", seconds=0, failure_step=3).steps_lost_durable_only == 4


def test_timeline_png(tmp_path):
    events = [{"kind": "step", "t": 0.1 * i, "step": i, "stall_s": 0.002, "attempt": 0} for i in range(12)]
    events += [{"kind": "commit", "t": 0.1 * i + 0.05, "step": i, "latency_s": 0.05} for i in range(11)]
    events += [
        {"kind": "persist", "t": 1.0, "step": 9},
        {"kind": "failure", "t": 1.25, "host": 2},
        {"kind": "restore", "t": 3.0, "step": 10, "source": "memory", "seconds": 0.3},
    ]
    events += [{"kind": "step", "t": 3.0 + 0.1 * i, "step": 11 + i, "stall_s": 0.002, "attempt": 1} for i in range(5)]
    path = plot_timeline(events, str(tmp_path / "t.png"), title="test")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_host_stores_names_the_run_from_a_run_config_without_a_name():
    from ray.train import RunConfig

    run_config = RunConfig()  # Ray generates the name when the config is built
    with host_stores(CheckpointConfig(), run_config=run_config) as namespace:
        assert namespace == run_config.name and namespace.startswith("ray_train_run-")
    with host_stores(CheckpointConfig(namespace="lm-7"), run_config=run_config) as namespace:
        assert namespace == "lm-7"  # CheckpointConfig.namespace wins, as it does on the workers
    # Neither a name nor a connected Ray (to tell the run's new stores apart): say what to pass.
    # In a fresh process, since an earlier test of this session may have left Ray connected.
    code = (
        "import pytest\n"
        "from gemini_ckpt import CheckpointConfig\n"
        "from gemini_ckpt.errors import ConfigError\n"
        "from gemini_ckpt.integrations.ray_train import host_stores\n"
        "with pytest.raises(ConfigError, match='run_config=run_config'):\n"
        "    with host_stores(CheckpointConfig()):\n"
        "        pass\n"
        "print('raised')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "raised", out.stderr[-2000:]


def test_the_demo_report_never_counts_negative_steps_lost():
    from gemini_ckpt.demo.options import DemoOptions
    from gemini_ckpt.demo.report import DemoReport

    # The kill is asynchronous: here step 37 committed after step 36 was seen to finish.
    report = DemoReport(
        DemoOptions(),
        run_dir="runs/x",
        seconds=1.0,
        failure_step=36,
        failure_t=36.1,
        restored_step=37,
        restored_from="memory",
        restore_s=0.4,
        durable_before_failure=29,
    )
    assert report.steps_lost == 0 and report.steps_lost_durable_only == 7
    assert "steps lost   0 (the newest finished step was committed in memory)" in report.format()
    report.restored_step = 34
    assert report.steps_lost == 2 and "redone: 35..36" in report.format()


def test_the_demo_report_times_the_step_after_each_persisted_version():
    from gemini_ckpt.demo.report import step_times

    # Steps 0..5 every 0.1 s except the step after persisted step 2 (0.3 s); then a restart
    # (attempt 1) whose first step has no predecessor in its attempt.
    unix = [0.0, 0.1, 0.2, 0.5, 0.6, 0.7]
    events = [{"kind": "step", "rank": 0, "attempt": 0, "step": i, "unix": t} for i, t in enumerate(unix)]
    events += [
        {"kind": "step", "rank": 0, "attempt": 1, "step": 4, "unix": 9.0},
        {"kind": "step", "rank": 0, "attempt": 1, "step": 5, "unix": 9.1},
    ]
    times, after = step_times(events, persisted={2})
    assert [round(t, 6) for t in times] == [0.1, 0.1, 0.3, 0.1, 0.1, 0.1]
    assert [round(t, 6) for t in after] == [0.3]
    report = DemoReport(DemoOptions(), run_dir="runs/x", seconds=1.0, step_s=times, after_persist_s=after)
    assert (
        "step time    median 100 ms (rank 0, save included); the step after a persisted version median "
        "300 ms (3.00x, 1 versions)" in report.format()
    )
