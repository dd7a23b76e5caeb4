"""Elastic in place: a lost host that no node replaces in time is dropped from the worker group,
and the survivors go on at fewer ranks in their own processes (Ray Train internals, Ray 2.60).

With replica groups, Ray Train's controller replaces a failed worker on the placement-group
bundle it ran on. When that bundle's node is dead and no node takes it, the replacement waits
without end (its actor can never be placed). Ray's elastic mode (``ScalingConfig(num_workers=(min,
max))``) restarts every worker at the smaller size instead, but only once its view of the cluster
has caught up (the autoscaling coordinator ticks every 20 s) and the same-size placement timed
out (60 s): a full restart, a minute or more later.

So for an elastic run the in-place backend stands in for one call of the run's worker group,
``WorkerGroup.replace_replica_group`` (:func:`install`), and handles every failing group of the
controller's poll at once:

1. a failed worker whose host is there (a process fault: its node alive, its raylet answering) is
   replaced as before;
2. a failed worker whose host is gone is replaced as before if, once Ray declared the node dead,
   a node takes its bundle within ``replace_within_s`` (a standby host, a replacement that joins
   at once);
3. otherwise its group is shut down and the survivors are renumbered (ranks ``0..M-1`` in their
   old order); the controller's worker group, its report queues and its barrier are set for ``M``
   workers (:func:`drop`), and the backend opens a round whose membership gives every survivor
   its new rank: they form the process group again without the lost host, in their processes,
   and restore the newest committed version resharded to ``M`` from the host stores' memory;
4. at fewer than ``min_workers`` it waits for a node up to ``reform_timeout_s``, then ends the run.

The dropped bundle stays in the placement group: when a node joins, Ray places it there, and
Ray's elastic policy grows the group back to ``max_workers`` at its next resize (a full restart,
restoring from memory: the new host's store is seeded with the copies its slot held).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Callable, Optional

from ..errors import RecoveryGaveUpError

log = logging.getLogger("gemini_ckpt")

POLL_S = 0.1  # how often a lost bundle is checked for a node that took it
CALL_TIMEOUT_S = 10.0
WATCH_S = 1.0  # how often an elastic run's controller looks for hosts that joined
PROBE_S = 1.0  # a lost host's raylet: how long a connection to it may take before it counts as gone


def support() -> Optional[str]:
    """Why an elastic run cannot shrink in place on this Ray (None when it can): the names of Ray
    Train's worker group it rewrites (read for Ray 2.60; ``tests/unit/integrations/
    test_inplace_adapter.py`` checks them). Without it, Ray's own elastic restart applies."""
    try:
        from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
        from ray.train.v2._internal.execution.context import TrainContext
        from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
        from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    except ImportError as exc:
        return f"Ray Train's worker group cannot be imported ({exc})"
    fields = set(getattr(WorkerGroupState, "__dataclass_fields__", ()))
    init = WorkerGroup.__init__.__code__.co_names
    missing = [
        name
        for name, ok in (
            (
                "WorkerGroupState(start_time, placement_group_handle, workers, sync_actor)",
                {"start_time", "placement_group_handle", "workers", "sync_actor"} <= fields,
            ),
            ("WorkerGroup's replica-group tables", all(n in init for n in WORKER_GROUP_FIELDS)),
            (
                "ReportCallbackHandler.after_replica_group_start",
                hasattr(ReportCallbackHandler, "after_replica_group_start"),
            ),
            (
                "TrainContext.distributed_context",
                "distributed_context" in getattr(TrainContext, "__dataclass_fields__", ()),
            ),
        )
        if not ok
    ]
    return f"Ray Train lacks {', '.join(missing)}" if missing else None


# What drop() rewrites on Ray Train's WorkerGroup (set in its __init__, Ray 2.60)
WORKER_GROUP_FIELDS = (
    "_worker_group_state",
    "_replica_groups",
    "_worker_rank_to_replica_group_rank",
    "_world_rank_to_ongoing_poll",
    "_worker_group_context",
    "_replica_group_callbacks",
    "_train_run_context",
)


def elastic_bounds(whole) -> Optional[tuple[int, int]]:
    """(min_workers, max_workers) of an elastic run's worker group, None for a fixed-size one."""
    scaling = whole._train_run_context.scaling_config
    if not scaling.elasticity_enabled:
        return None
    return scaling.min_workers, scaling.max_workers


def install(whole, replace_or_shrink: Callable[[int, Callable[[int], None]], None]) -> None:
    """Route the controller's replacement of a replica group through ``replace_or_shrink(index,
    replace)``, ``replace`` being Ray's own replacement of that group."""
    replace = whole.replace_replica_group  # bound to this worker group, Ray's method

    def replace_replica_group(index: int) -> None:
        replace_or_shrink(index, replace)

    whole.replace_replica_group = replace_replica_group


class ElasticReplacement:
    """What stands in for Ray Train's replacement of one failing replica group in an elastic run
    (see the module docstring): called as ``(index, replace)``, ``replace`` being Ray's own, it
    handles every failing group of the controller's latest poll at its first call (in place where
    a node holds or takes the group's bundle, the others dropped and the survivors renumbered) and
    none twice. ``lost(workers)``: the workers of lost hosts, found (their incarnations end now);
    ``before_shrink()`` may end the run (raises); ``shrunk(survivors, lost ranks)`` opens their
    round."""

    def __init__(
        self,
        whole,
        config,
        *,
        lost: Callable[[list], None],
        before_shrink: Callable[[], None],
        shrunk: Callable[[list, list], None],
    ):
        self.whole, self.config = whole, config
        self.lost, self.before_shrink, self.shrunk = lost, before_shrink, shrunk
        self._handled = None  # the poll status whose failing groups were handled

    def __call__(self, index: int, replace: Callable[[int], None]) -> None:
        status = self.whole.get_latest_poll_status()
        if status is None:  # not a poll's failure (Ray Train replaces after a poll): as Ray would
            return replace(index)
        if status is self._handled:
            return None  # handled with the first failing group of this poll
        self._handled = status
        groups = self.whole.get_replica_groups()
        failing = sorted(status.failing_replica_group_indices) or [index]
        node_of = {i: groups[i].get_workers()[0].metadata.node_id for i in failing}
        lost = {i for i in failing if host_lost(node_of[i])}
        for i in failing:
            if i not in lost:
                replace(i)  # a process fault: its host is there
        if not lost:
            return None
        # the survivors end their attempt now (they wait a bounded time for this), not once Ray
        # has declared the hosts dead and their places were kept
        self.lost([w for i in lost for w in groups[i].get_workers()])
        config = self.config
        dead = {node_of[i] for i in lost}
        declared = await_deaths(dead, within_s=config.reform_timeout_s)
        if declared != dead:
            log.warning(
                "gemini_ckpt: host(s) %s do not answer, and Ray has not declared them dead within %.0fs",
                sorted(n[:12] for n in dead - declared),
                config.reform_timeout_s,
            )
        bundles = {bundle_index(groups[i]): i for i in lost}
        low, _ = elastic_bounds(self.whole)
        within = config.replace_within_s
        if len(groups) - len(lost) < low:
            within = config.reform_timeout_s  # below min_workers: only a node can help
            log.warning(
                "gemini_ckpt: %d host(s) lost and %d worker(s) left, below min_workers=%d: waiting up to %.0fs "
                "for a node to take their place",
                len(lost),
                len(groups) - len(lost),
                low,
                within,
            )
        placed = bundles_placed(self.whole, sorted(bundles), within_s=within, dead=dead)
        for bundle in placed:
            replace(bundles[bundle])  # a node took the lost host's place
        dropped = sorted(bundles[b] for b in set(bundles) - placed)
        if not dropped:
            return None
        left = len(groups) - len(dropped)
        if left < low:
            raise RecoveryGaveUpError(
                f"gemini_ckpt ended the run: {len(dropped)} host(s) lost, {left} worker(s) left, below "
                f"ScalingConfig min_workers={low}, and no node took their place within {within:.0f}s"
            )
        ranks = [groups[i].get_workers()[0].distributed_context.world_rank for i in dropped]
        self.before_shrink()
        self.shrunk(drop(self.whole, dropped), ranks)
        return None


def live_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def host_lost(node_id: str) -> bool:
    """Whether the host ``node_id`` is gone: Ray declared it dead, or its raylet refuses or does not
    answer a connection (a machine just lost is still alive in Ray's table for a few seconds:
    its node health checks have not failed yet)."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            if not node.get("Alive"):
                return True
            try:
                socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), PROBE_S).close()
            except OSError:
                return True
            return False
    return True


def await_deaths(node_ids: set[str], *, within_s: float) -> set[str]:
    """Wait until Ray has declared each of ``node_ids`` dead (its placement-group bundles are only
    placed elsewhere then), at most ``within_s``; returns the ones it declared dead."""
    deadline = time.monotonic() + within_s
    while True:
        dead = node_ids - live_nodes()
        if dead == node_ids or time.monotonic() >= deadline:
            return dead
        time.sleep(POLL_S)


def bundles_placed(whole, indices, *, within_s: float, dead: set[str]) -> set[int]:
    """Which of the bundles ``indices`` of the group's placement group a live node took (none
    of ``dead``) within ``within_s``; returns as soon as all are placed."""
    import ray.util

    pg = whole._worker_group_state.placement_group_handle.placement_group
    deadline = time.monotonic() + within_s
    while True:
        table = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        alive = live_nodes()
        placed = {i for i in indices if table.get(i) in alive and table.get(i) not in dead}
        if placed == set(indices) or time.monotonic() >= deadline:
            return placed
        time.sleep(POLL_S)


def bundle_index(group) -> int:
    return group.get_workers()[0].placement_group_bundle_index


def drop(whole, indices) -> list:
    """Shut the replica groups ``indices`` down and renumber the other workers ``0..M-1`` (their
    order kept); the controller's worker group, its report queues and its barrier then count
    ``M`` workers. Returns the survivors, in their new rank order."""
    import ray
    from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
    from ray.train.v2._internal.util import time_monotonic

    groups = whole.get_replica_groups()
    for i in sorted(indices):
        groups[i].shutdown()  # the backend's on_shutdown: the failed worker's process is ended
    keep = [g for i, g in enumerate(groups) if i not in set(indices)]
    survivors = sorted((w for g in keep for w in g.get_workers()), key=lambda w: w.distributed_context.world_rank)
    renumbered = {w.distributed_context.world_rank: new for new, w in enumerate(survivors)}
    for new, worker in enumerate(survivors):
        worker.distributed_context = dataclasses.replace(
            worker.distributed_context, world_rank=new, world_size=len(survivors)
        )
    state = whole._worker_group_state
    whole._worker_group_state = WorkerGroupState(
        # a group of this size starts now: Ray's elastic policy considers resizing it only a
        # monitor interval later (the cluster view it sizes from may still count the lost host)
        start_time=time_monotonic(),
        placement_group_handle=state.placement_group_handle,
        workers=survivors,
        sync_actor=state.sync_actor,
    )
    whole._replica_groups = keep
    whole._worker_rank_to_replica_group_rank = {
        w.distributed_context.world_rank: i for i, g in enumerate(keep) for w in g.get_workers()
    }
    whole._world_rank_to_ongoing_poll = {
        renumbered[old]: poll for old, poll in whole._world_rank_to_ongoing_poll.items() if old in renumbered
    }
    whole._worker_group_context = dataclasses.replace(
        whole._worker_group_context,
        num_workers=len(survivors),
        label_selector=None
        if whole._worker_group_context.label_selector is None
        else [whole._worker_group_context.label_selector[bundle_index(g)] for g in keep],
    )
    # the latest poll status stays until the next poll: Ray Train goes on through its failing indices
    # (old numbering), and the backend, knowing that status, handles none of them twice
    for callback in whole._replica_group_callbacks:
        if isinstance(callback, ReportCallbackHandler):
            callback.after_replica_group_start(keep[0])  # its queues, one per worker, made again
    ray.get(state.sync_actor.reset.remote(), timeout=CALL_TIMEOUT_S)  # a barrier half-filled by the old world
    refresh_cluster_view()
    return survivors


def refresh_cluster_view() -> None:
    """Have Ray's autoscaling coordinator read the cluster again now: Ray's elastic policy sizes
    the group from its view, which it refreshes every 20 s, and until then the lost host still
    counts (a resize to the old size would restart every worker and wait a minute for a host that
    is gone). Best effort: the group's new start time already holds the next resize back."""
    import ray

    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote("gemini-ckpt", recompute=True), timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - an internal actor of Ray's; its own tick catches up in 20 s
        log.info("gemini_ckpt: Ray's autoscaling coordinator did not refresh its view of the cluster: %s", exc)


class JoinWatch:
    """While an elastic run lasts: when a host joins, have Ray's autoscaling coordinator see it at
    once (:func:`refresh_cluster_view`), so that Ray's elastic policy grows the group back at its
    next resize (``elastic_resize_monitor_interval_s``) rather than up to 20 s after it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gemini-ckpt-elastic-joins", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread = None

    def _run(self) -> None:
        seen = None
        while not self._stop.wait(WATCH_S):
            try:
                alive = live_nodes()
            except Exception as exc:  # noqa: BLE001 - the run is ending (Ray going down)
                log.debug("gemini_ckpt: reading the node table: %s", exc)
                continue
            if seen is not None and alive - seen:
                log.info("gemini_ckpt: host(s) %s joined; the run can grow back", sorted(n[:12] for n in alive - seen))
                refresh_cluster_view()
            seen = alive


def placed_in_ray_train(rank: int, world_size: int) -> None:
    """A survivor's new place, in Ray Train's context of this worker (``ray.train.get_context()``)."""
    from ray.train.v2._internal.execution.context import get_train_context

    context = get_train_context()
    context.distributed_context = dataclasses.replace(
        context.distributed_context, world_rank=rank, world_size=world_size
    )
