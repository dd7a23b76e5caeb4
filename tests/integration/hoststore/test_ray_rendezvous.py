"""The host stores' rendezvous across attempts: a rank that joined and left (its attempt failed
while it waited, its process died) is never counted in a later attempt's rendezvous, and a rank
waiting in it leaves as soon as its in-place attempt ends.

The chaos scenario ``elastic-loss-during-grow`` found it: three survivors waited 60 s for a dead
rank 0 in the rendezvous of a 4-rank attempt (no cut connection ends a Ray call), and their joins,
left behind, completed the next 3-rank attempt's rendezvous with two of its ranks still absent.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray

from gemini_ckpt import CheckpointConfig, attempts
from gemini_ckpt.errors import AttemptInterruptedError
from gemini_ckpt.hoststore.cluster import get_or_create_registry


def _registry():
    namespace = f"rendezvous-{uuid.uuid4().hex[:6]}"
    return namespace, get_or_create_registry(namespace)


def _waiting(registry, ranks: set, timeout: float = 20.0) -> None:
    """Until the registry's waiting rendezvous holds exactly ``ranks`` (calls to a fresh async actor
    may start out of order: the test orders them by waiting)."""

    def pending(self):
        rnd = self.rendezvous._round
        return set(rnd.pending) if rnd is not None else set()

    deadline = time.monotonic() + timeout
    while (now := ray.get(registry.__ray_call__.remote(pending), timeout=timeout)) != ranks:
        assert time.monotonic() < deadline, f"waiting ranks {now}, expected {ranks}"
        time.sleep(0.05)


def _join(registry, rank: int, world_size: int, *, generation=None, timeout_s: float = 20.0):
    node = ray.get_runtime_context().get_node_id()
    return registry.join.remote(rank, world_size, node, timeout_s, 2, None, generation=generation)


@pytest.mark.ray
def test_a_newer_attempts_join_ends_the_older_rendezvous_and_its_ranks_are_refused(ray_cluster):
    _, registry = _registry()
    try:
        # Attempt 4 (4 ranks): ranks 1 and 2 wait for ranks 0 and 3, which never come.
        stale = [_join(registry, r, 4, generation=4) for r in (1, 2)]
        _waiting(registry, {1, 2})
        # Attempt 5 (3 ranks): rank 0 arrives first. Before, the stale ranks 1 and 2 completed
        # the rendezvous with it at once.
        first = _join(registry, 0, 3, generation=5)
        for ref in stale:
            with pytest.raises(ray.exceptions.RayTaskError, match="moved on to attempt 5"):
                ray.get(ref, timeout=10)
        _waiting(registry, {0})  # attempt 5's rendezvous waits for its ranks 1 and 2 (the stale ones left)
        # An attempt-4 rank arriving now is refused at once.
        with pytest.raises(ray.exceptions.RayTaskError, match="attempt 5's ranks are joining"):
            ray.get(_join(registry, 1, 4, generation=4), timeout=10)
        tables = ray.get([first] + [_join(registry, r, 3, generation=5) for r in (1, 2)], timeout=20)
        assert {t["epoch"] for t in tables} == {tables[0]["epoch"]}
        assert sorted(tables[0]["ranks"]) == [0, 1, 2]
    finally:
        ray.kill(registry)


@pytest.mark.ray
def test_a_join_that_timed_out_or_was_withdrawn_leaves_the_rendezvous(ray_cluster):
    _, registry = _registry()
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ranks \[0\] of 2 did not connect"):
            ray.get(_join(registry, 1, 2, timeout_s=0.3), timeout=10)
        withdrawn = _join(registry, 1, 2)
        _waiting(registry, {1})
        ray.cancel(withdrawn)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(withdrawn, timeout=10)
        # Rank 0 alone: rank 1 left twice, so the rendezvous waits for it (before, rank 0 went on alone).
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ranks \[1\] of 2 did not connect"):
            ray.get(_join(registry, 0, 2, timeout_s=0.5), timeout=10)
    finally:
        ray.kill(registry)


@pytest.mark.ray
def test_a_rank_waiting_in_the_rendezvous_leaves_when_its_in_place_attempt_ends(ray_cluster):
    from gemini_ckpt.hoststore.client import connect
    from gemini_ckpt.settings import store_settings

    namespace, registry = _registry()
    settings = store_settings(CheckpointConfig(namespace=namespace, replicas=1, timeout_s=60))
    try:
        with attempts.attempt(generation=7) as attempt:
            threading.Timer(0.5, attempt.interrupted.set).start()
            t0 = time.monotonic()
            with pytest.raises(AttemptInterruptedError, match="a newer round was asked for"):
                connect(settings, rank=0, world_size=2)
            assert time.monotonic() - t0 < 10, "the wait did not end with the attempt (timeout_s is 60)"
        # Its join was withdrawn: attempt 7's rank 1 does not find rank 0 there.
        _waiting(registry, set())
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ranks \[0\] of 2 did not connect"):
            ray.get(_join(registry, 1, 2, generation=7, timeout_s=0.5), timeout=10)
    finally:
        ray.kill(registry)
