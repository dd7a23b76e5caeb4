"""The local cluster tells a dead host from a busy one (:data:`gemini_ckpt.testing.cluster.HEALTH_CHECKS`),
and the test session heals a host that died without being removed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

pytestmark = pytest.mark.ray


def _alive(node_id: str) -> bool:
    return any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_a_removed_host_is_known_dead_within_5_seconds(ray_cluster):
    node_id = ray_cluster.node_id(3)
    t0 = time.monotonic()
    ray_cluster.remove_hosts((3,), wait=False)
    while _alive(node_id) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    ray_cluster.add_host(3)
    assert not _alive(node_id)
    assert seconds < 5.0, f"a removed host was reported dead only after {seconds:.1f}s"


def test_a_host_whose_raylet_pauses_for_3_seconds_is_not_declared_dead(ray_cluster):
    node_id = ray_cluster.node_id(2)
    died_at = None
    t0 = time.monotonic()
    with ray_cluster.paused(2):
        while time.monotonic() - t0 < 3.0:
            if died_at is None and not _alive(node_id):
                died_at = time.monotonic() - t0
            time.sleep(0.1)
    # A check that failed during the pause counts until the next one succeeds: watch a while longer.
    while time.monotonic() - t0 < 10.0:
        if died_at is None and not _alive(node_id):
            died_at = time.monotonic() - t0
        time.sleep(0.2)
    assert died_at is None, f"a raylet paused for 3 s was declared dead after {died_at:.1f}s"
    assert ray_cluster.unasked_deaths() == []
    # and it still runs work
    ref = ray.remote(num_cpus=0, resources={"host2": 0.01})(lambda: ray.get_runtime_context().get_node_id()).remote()
    assert ray.get(ref, timeout=60) == node_id


def test_heal_replaces_a_host_whose_raylet_died_without_being_removed(ray_cluster):
    node_id = ray_cluster.node_id(1)
    os.kill(ray_cluster.raylet_pid(1), signal.SIGKILL)  # not through remove_hosts: "unasked"
    deadline = time.monotonic() + 30
    while _alive(node_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.unasked_deaths() == [1]
    assert "DEAD" in ray_cluster.describe()
    assert ray_cluster.heal() == [1]
    assert ray_cluster.unasked_deaths() == []
    replacement = ray_cluster.node_id(1)
    assert replacement != node_id and _alive(replacement)
