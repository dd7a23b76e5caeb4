"""Warm Train workers (``gray.warm_runtime_env``): the imports run in the worker's new process
before it is given work, and an actor the worker creates, a host store, does not run them again
(an actor inherits its creator's runtime env)."""

from __future__ import annotations

import os
import sys

import ray

from gemini_ckpt.integrations.ray_train import warm_runtime_env
from ray_helpers import node_id_of_host


@ray.remote(num_cpus=0)
class _TrainLike:
    """Stands for a Ray Train worker: created with the Train workers' runtime env."""

    def loaded(self, modules: list[str]) -> dict:
        return {m: m in sys.modules for m in modules}

    def start_store(self, namespace: str, node_id: str) -> int:
        from gemini_ckpt.hoststore.actors.store_handle import get_or_create_store

        store = get_or_create_store(namespace, node_id, 64 << 20)
        ray.get(store.index.remote(), timeout=60)
        return ray._private.state.actors(store._actor_id.hex())["Pid"]


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_a_warm_worker_imports_before_work_and_its_host_store_does_not(ray_cluster, namespace):
    node = node_id_of_host(2)
    worker = _TrainLike.options(runtime_env=warm_runtime_env("json.decoder"), resources={"host2": 0.01}).remote()
    # imported by the setup hook, before this first call (nothing in the class imports them)
    assert ray.get(
        worker.loaded.remote(["torch", "ray.train.torch", "gemini_ckpt.integrations.ray_train", "json.decoder"]),
        timeout=120,
    ) == {"torch": True, "ray.train.torch": True, "gemini_ckpt.integrations.ray_train": True, "json.decoder": True}
    try:
        store_pid = ray.get(worker.start_store.remote(namespace, node), timeout=120)
        assert os.path.exists(f"/proc/{store_pid}")
        # the store cleared the inherited hook: it started without torch (~1 s, not ~5 s)
        assert not _maps_torch(store_pid)
    finally:
        ray.kill(worker)
