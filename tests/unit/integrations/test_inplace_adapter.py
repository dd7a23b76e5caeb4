"""The one adapter to Ray Train's in-place replacement, without a cluster: what it relies on in
Ray's internals is still there (this test fails loudly when a Ray upgrade moves it), the
fallback to the full restart on a Ray without the path, and the ranks it tells each worker."""

from __future__ import annotations

import inspect
import types
import warnings

import pytest

from gemini_ckpt import ConfigError
from gemini_ckpt.integrations import _inplace_backend as adapter
from gemini_ckpt.integrations.ray_train import detection_env, preload_env, torch_config, warm_runtime_env
from gemini_ckpt.hoststore.names import ACTOR_ENV, SETUP_HOOK_VAR


def test_ray_train_still_has_the_replica_group_path_the_adapter_uses():
    """Everything the adapter assumes about Ray Train's internals, read from the installed Ray.
    If this fails after a Ray upgrade, re-read the controller and the worker group before
    widening ``SUPPORTED_RAY``."""
    from ray.train.backend import Backend
    from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2._internal.execution.worker_group.execution_group import ReplicaGroup
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert adapter.support() is None
    assert Backend.has_replica_groups is False  # a class attribute a backend turns on
    controller = inspect.getsource(TrainController)
    assert "backend_cls.has_replica_groups" in controller  # read from the backend class
    assert "self._replace_bad_workers(poll_status)" in controller  # same size, some groups failing
    assert "failing_rgs != all_rgs" in controller  # every group failing: a full restart
    group = inspect.getsource(WorkerGroup)
    assert "replica_group_size=1 if self._manages_replica_groups" in group  # one worker per group
    replace = inspect.getsource(WorkerGroup._replace_replica_group_impl)
    for step in (
        "old_replica_group.shutdown()",
        "sync_actor.reset.remote()",
        "placement_group_bundle_indices",
        "starting_world_rank=replica_group_index",
        "start_training",
        "i != replica_group_index and rg.is_active()",
        "w.actor.clear_result_queue.remote()",  # on every other active group: a dead one fails the run
    ):  # other failing groups, and workers dead since the poll: shut first (adapter)
        assert step in replace, step
    assert replace.index("old_replica_group.shutdown()") < replace.index("clear_result_queue")  # our hook runs first
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker

    assert callable(RayTrainWorker.clear_result_queue)
    for name in ("get_latest_poll_status", "get_replica_groups", "get_workers"):
        assert callable(getattr(WorkerGroup, name)), name
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus

    assert hasattr(WorkerGroupPollStatus, "failing_replica_group_indices")
    assert callable(ReplicaGroup.is_active)
    starting = inspect.getsource(ReplicaGroup.start_training)
    assert "after_replica_group_start" in starting and "run_train_fn" in starting
    shutting = inspect.getsource(ReplicaGroup.shutdown)
    assert "before_replica_group_shutdown" in shutting
    # a whole group whose start raises after its state was built is not cleaned up by Ray Train:
    # the adapter shuts it down itself before it raises
    start = inspect.getsource(WorkerGroup._start)
    assert "if not self.has_started():" in start and "worker_group_state_builder.shutdown()" in start
    setup = inspect.getsource(BackendSetupCallback)
    assert "self._backend.on_start(execution_group" in setup  # on_start(ReplicaGroup) for a newcomer
    assert "self._backend.on_shutdown(execution_group" in setup
    # the worker metadata the adapter reads to place ranks and end a failed process
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata

    assert {"node_id", "pid"} <= set(inspect.signature(ActorMetadata).parameters)


def test_without_the_path_torch_config_is_rays_own_with_one_warning(monkeypatch):
    from ray.train.torch import TorchConfig

    config = torch_config()
    assert type(config).__name__ == "GeminiTorchConfig" and config.backend_cls.has_replica_groups
    monkeypatch.setenv(adapter.FALLBACK_ENV, "0")  # how a Ray the adapter does not know is simulated
    with pytest.warns(UserWarning, match="in-place recovery is unavailable .*restarts all workers"):
        config = torch_config(timeout_s=90)
    assert type(config) is TorchConfig and config.timeout_s == 90
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(torch_config(in_place=False)) is TorchConfig  # asked for: no warning


def test_a_ray_outside_the_tested_versions_is_not_trusted(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "2.61.0")
    assert "outside the versions" in adapter.support()
    monkeypatch.setattr(ray, "__version__", "2.59.0")
    assert "outside the versions" in adapter.support()


def test_ray_still_has_the_prestart_call_warm_spares_use():
    """Warm spares (``_spares.py``) call the raylet's ``PrestartWorkers`` and rely on
    ``RAY_preload_python_modules`` reaching a new worker as ``--worker-preload-modules``."""
    import ray._private.workers.default_worker as default_worker
    from ray._private.grpc_utils import init_grpc_channel  # noqa: F401
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
    from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

    assert "PrestartWorkers" in inspect.getsource(node_manager_pb2_grpc.NodeManagerServiceStub)
    fields = set(node_manager_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name)
    assert {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers"} <= fields
    assert "serialized_runtime_env" in RuntimeEnvInfo.DESCRIPTOR.fields_by_name
    assert "worker_preload_modules" in inspect.getsource(default_worker)


def test_ray_still_runs_the_setup_hook_named_in_a_workers_environment():
    """``warm_runtime_env`` names its hook through the variable Ray's worker reads at its start,
    and gemini_ckpt's actors clear it (they would inherit it from a Train worker)."""
    import ray._private.ray_constants as constants
    import ray._private.workers.default_worker as default_worker

    assert constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == SETUP_HOOK_VAR
    source = inspect.getsource(default_worker)
    assert "WORKER_PROCESS_SETUP_HOOK_ENV_VAR" in source and "load_and_execute_setup_hook" in source
    assert ACTOR_ENV[SETUP_HOOK_VAR] == ""


def test_warm_runtime_env_adds_to_the_users_own():
    mine = {"env_vars": {"A": "1"}, "pip": ["x"]}
    env = warm_runtime_env("numpy", runtime_env=mine)
    assert mine == {"env_vars": {"A": "1"}, "pip": ["x"]}  # not changed
    assert env["pip"] == ["x"] and env["env_vars"]["A"] == "1"
    assert env["env_vars"][SETUP_HOOK_VAR] == "gemini_ckpt.integrations._warm.warm_up"
    modules = env["env_vars"]["GEMINI_CKPT_WARM_MODULES"].split(",")
    assert modules[0] == "torch" and modules[-1] == "numpy" and "ray.train.torch" in modules
    with pytest.raises(ConfigError, match="module name"):
        warm_runtime_env("not a module")
    with pytest.raises(ConfigError, match="setup hook"):
        warm_runtime_env(runtime_env={"env_vars": {SETUP_HOOK_VAR: "mine.hook"}})
    with pytest.raises(ConfigError, match="runtime env dict"):
        warm_runtime_env(runtime_env="conda-env")


SPARES_WITHOUT_RAY = """
import logging
from gemini_ckpt.integrations._spares import Spares

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("gemini_ckpt").addHandler(handler)
spares = Spares(1)
spares.start({"node-a"})  # the workers' runtime env not learned yet: nothing to ask for
assert not records, records
spares.learn('{"env_vars": {}}', "01000000")
spares.start({"node-a", "node-b"})  # no Ray in this process: the first call fails
spares.start({"node-c"})
assert len([r for r in records if "warm spare" in r.getMessage()]) == 1, [r.getMessage() for r in records]
spares.stop()
records.clear()
none = Spares(0)
none.learn('{"env_vars": {}}', "01000000")
none.start({"node-a"})  # spares=0: never asks, so nothing fails
assert not records, records
print("ok")
"""


def test_spares_turn_off_once_when_rays_call_fails():
    """Without a reachable raylet the first call fails: one warning, no retries. In a process of
    its own: the suite's other tests may have connected this one to a cluster."""
    out = _run_alone(SPARES_WITHOUT_RAY)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="reform_timeout_s"):
        torch_config(reform_timeout_s=0)
    with pytest.raises(ConfigError, match="max_stuck"):
        torch_config(max_stuck=0)
    with pytest.raises(ConfigError, match="spares"):
        torch_config(spares=-1)
    assert torch_config(spares=0).spares == 0 and torch_config().spares == 1
    with pytest.raises(ConfigError, match="module name"):
        preload_env("not a module")
    modules = preload_env("numpy", "torch")["RAY_preload_python_modules"].split(",")
    assert modules[0] == "torch" and modules.count("torch") == 1 and modules[-1] == "numpy"
    assert "ray.train.torch" in modules and "gemini_ckpt.integrations.ray_train" in modules
    with pytest.raises(ConfigError, match="hang_s"):
        detection_env(hang_s=-1)
    assert detection_env(poll_s=0.5, hang_s=20) == {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": "20.0",
    }


def test_each_worker_is_told_its_rank_on_its_node():
    """Ray's own context says local rank 0 of 1 on every worker of a replica-group job."""

    def worker(rank, node):
        return types.SimpleNamespace(
            distributed_context=types.SimpleNamespace(world_rank=rank), metadata=types.SimpleNamespace(node_id=node)
        )

    workers = [worker(3, "b"), worker(0, "a"), worker(2, "b"), worker(1, "a"), worker(4, "c")]
    assert adapter.node_ranks(workers) == {0: (0, 2, 0), 1: (1, 2, 0), 2: (0, 2, 1), 3: (1, 2, 1), 4: (0, 1, 2)}


def test_the_reaper_kills_only_ray_train_workers_of_its_user():
    import os
    import subprocess
    import sys
    import time

    from gemini_ckpt.integrations._reaper import Reaper

    reaper = Reaper()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert reaper.kill(other.pid).startswith("refused")
        assert reaper.kill(os.getpid()).startswith("refused") and reaper.kill(1).startswith("refused")
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ray::RayTrainWorker"])
    for _ in range(100):  # until the child's command line is its own (after exec)
        if b"RayTrainWorker" in open(f"/proc/{worker.pid}/cmdline", "rb").read():
            break
        time.sleep(0.05)
    outcome = reaper.kill(worker.pid)
    assert outcome == "killed", (outcome, open(f"/proc/{worker.pid}/cmdline", "rb").read())
    assert worker.wait(timeout=10) == -9
    assert reaper.kill(worker.pid) == "gone"


WARMED_LEAVES_NOTHING = """
import inspect, os, sys
from gemini_ckpt.integrations._warm import warm_up
from gemini_ckpt.integrations.ray_train import PRELOAD
os.environ["GEMINI_CKPT_WARM_MODULES"] = ",".join(PRELOAD)
warm_up()
before = set(sys.modules)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))  # the first DTensor made
dist.destroy_process_group()
# what every ray.train.get_context() runs first (its decorator), read from Ray's source
from ray.train.v2._internal import util
source = inspect.getsource(util.requires_train_worker)
line = next(l.strip() for l in source.splitlines() if "_in_tune_session" in l and "import" in l)
exec(line)
from gemini_ckpt.hoststore.client import connect  # what a Checkpointer's first start imports
new = {".".join(m.split(".")[:2]) for m in set(sys.modules) - before}
new = sorted(m for m in new if m in ("torch._dynamo", "ray.tune", "gemini_ckpt.hoststore"))
print("new:", new)
"""


def test_a_warmed_worker_imports_nothing_more_for_fsdp_ray_trains_context_or_a_checkpointer():
    """What a replacement's training function would import lazily while the survivors wait (the
    first DTensor imports torch._dynamo, the first ``ray.train.get_context()`` Ray Tune's session
    check, the first Checkpointer start the host-store client) is in ``PRELOAD``: a warmed process
    imports none of it again. Fails when torch or Ray moves what they import lazily."""
    out = _run_alone(WARMED_LEAVES_NOTHING)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "new: []", out.stdout


def _run_alone(script: str):
    """``script`` in a Python process of its own (the suite's other tests may have imported or
    connected this one)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)


def test_ray_train_still_has_what_an_elastic_shrink_in_place_rewrites():
    """What ``_elastic`` relies on in Ray Train's internals (Ray 2.60): the controller replaces
    failing replica groups through the worker group's ``replace_replica_group`` (the one call an
    elastic run's backend stands in for), the worker group's tables it rewrites, the report
    queues and barrier it resets, the autoscaling coordinator it asks to look again, and the
    worker's context a survivor takes its new rank into. Fails loudly when a Ray upgrade moves them."""
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    from ray.train.v2.api.config import ScalingConfig

    from gemini_ckpt.integrations import _elastic

    assert _elastic.support() is None
    replace = inspect.getsource(TrainController._replace_bad_workers)
    assert "for rg_index in failing_rg_indices" in replace
    assert "self._worker_group.replace_replica_group(rg_index)" in replace  # the instance's method
    resize = inspect.getsource(TrainController._execute_resize_decision)
    assert "decision.num_workers == current_num_workers" in resize  # a smaller size: a full restart
    assert "get_latest_poll_status()" in resize  # the status whose failing groups are handled once
    policy = inspect.getsource(ElasticScalingPolicy.make_decision_for_running_worker_group)
    assert "worker_group_state.start_time" in policy  # a shrunk group's new start time holds a resize back
    assert "worker_group_state.num_workers" in policy
    for name in _elastic.WORKER_GROUP_FIELDS:
        assert name in WorkerGroup.__init__.__code__.co_names, name
    poll = inspect.getsource(WorkerGroup._get_poll_tasks)
    assert "self._world_rank_to_ongoing_poll.get(i)" in poll  # keyed by position: re-keyed at a shrink
    assert ScalingConfig(num_workers=(2, 4)).elasticity_enabled and ScalingConfig(num_workers=(2, 4)).min_workers == 2
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
        get_or_create_autoscaling_coordinator,
    )

    assert "recompute" in inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters
    made = inspect.getsource(get_or_create_autoscaling_coordinator)
    assert 'name="AutoscalingCoordinator"' in made and 'namespace="AutoscalingCoordinator"' in made
