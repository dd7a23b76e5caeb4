"""Warm spares on a host that joins while a run lasts (``gemini_ckpt.integrations._spares``): the
watch asks the new host's raylet for a spare as soon as it sees the host, before Ray Train places
any worker there (a replacement for a lost host then starts in a process that has been importing
while Ray was still declaring the lost host dead)."""

from __future__ import annotations

import uuid

import psutil
import pytest

from ray_helpers import wait_for

MARK = "GEMINI_CKPT_SPARE_TEST"


def _spares_under(raylet_pid: int, marker: str) -> list[int]:
    """Worker processes of this raylet started with the spares' runtime env (its env var)."""
    found = []
    for child in psutil.Process(raylet_pid).children(recursive=True):
        try:
            if child.environ().get(MARK) == marker:
                found.append(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.ray
def test_a_host_that_joins_gets_a_warm_spare_before_any_worker_is_placed_there(ray_cluster):
    import ray
    from ray.runtime_env import RuntimeEnv

    from gemini_ckpt.integrations._spares import Spares

    marker = uuid.uuid4().hex
    spares = Spares(1)
    spares.learn(RuntimeEnv(env_vars={MARK: marker}).serialize(), ray.get_runtime_context().get_job_id())
    spares.start(set())  # no Train worker yet: nothing to warm, but the watch starts
    try:
        ray_cluster.remove_hosts((3,))
        ray_cluster.add_host(3)
        raylet = ray_cluster.raylet_pid(3)
        wait_for(lambda: _spares_under(raylet, marker), timeout=60, what="a warm spare on the host that joined")
        assert not _spares_under(ray_cluster.raylet_pid(2), marker)  # hosts that were there get none
    finally:
        spares.stop()
