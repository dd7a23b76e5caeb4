"""Metrics through Ray's metrics API (``ray.util.metrics``): they appear wherever the cluster's go
(each node's Prometheus export, the dashboard's Grafana). ``CheckpointConfig(metrics=False)``
turns them off. docs/metrics.md lists them; ``docs/grafana/gemini_ckpt.json`` is a dashboard.

Two sources, both off the training thread:

- :class:`TrainerMetrics`, a checkpoint listener of every rank (``store="ray"``): the save stall,
  the time to a committed copy, versions committed / failed / unhealthy, persists and their time,
  the newest committed and durable step, each restore's stages. Tagged ``namespace``, ``rank``.
- :class:`StoreMetrics`, updated by each host store about once a second: bytes held and reserved
  against its budget, versions held, bytes replicated to peers. Tagged ``namespace``, ``host``.

Ray names each one ``ray_<name>`` in Prometheus (a counter also gets ``_total``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..events import CheckpointEvent, CheckpointListener

log = logging.getLogger("gemini_ckpt")

PREFIX = "gemini_ckpt_"
SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]

# name -> (kind, description, tag keys): what docs/metrics.md and the dashboard name
TRAINER = {
    "save_stall_seconds": (
        "histogram",
        "save(): the training thread's stall (the copy into staging memory)",
        ("namespace", "rank"),
    ),
    "commit_seconds": ("histogram", "from save() to every copy of the version acknowledged", ("namespace", "rank")),
    "staged_bytes": ("counter", "bytes of this rank's shards staged by save()", ("namespace", "rank")),
    "versions": ("counter", "versions by outcome: committed, failed, unhealthy", ("namespace", "rank", "outcome")),
    "persisted": ("counter", "versions whose durable copy is committed", ("namespace", "rank")),
    "persist_failures": ("counter", "persists that failed (the version stays in memory)", ("namespace", "rank")),
    "persist_seconds": ("histogram", "from a version's commit to its durable commit", ("namespace", "rank")),
    "newest_committed_step": ("gauge", "the newest step committed in memory", ("namespace", "rank")),
    "newest_durable_step": ("gauge", "the newest step persisted", ("namespace", "rank")),
    "restores": (
        "counter",
        "restores by where the version came from (memory, durable, init)",
        ("namespace", "rank", "source"),
    ),
    "restore_stage_seconds": (
        "gauge",
        "the last restore's stages (called, connected, surveyed, ..., done)",
        ("namespace", "rank", "stage"),
    ),
    "restored_step": ("gauge", "the step the last restore loaded", ("namespace", "rank")),
}
STORE = {
    "host_held_bytes": (
        "gauge",
        "bytes of kept versions' shards on this host (own and replicas)",
        ("namespace", "host"),
    ),
    "host_reserved_bytes": (
        "gauge",
        "bytes counted against the budget (shards, staging, pooled buffers)",
        ("namespace", "host"),
    ),
    "host_budget_bytes": ("gauge", "this host store's memory budget", ("namespace", "host")),
    "host_versions": (
        "gauge",
        "versions held on this host, by state (committed, pending)",
        ("namespace", "host", "state"),
    ),
    "host_replicated_bytes": ("counter", "bytes this host sent to peers as copies", ("namespace", "host")),
}


def _make(spec: dict) -> dict:
    from ray.util import metrics

    out = {}
    for name, (kind, description, tags) in spec.items():
        if kind == "histogram":
            out[name] = metrics.Histogram(PREFIX + name, description=description, boundaries=SECONDS, tag_keys=tags)
        elif kind == "counter":
            out[name] = metrics.Counter(PREFIX + name, description=description, tag_keys=tags)
        else:
            out[name] = metrics.Gauge(PREFIX + name, description=description, tag_keys=tags)
    return out


class TrainerMetrics(CheckpointListener):
    """One rank's metrics, recorded on the Checkpointer's events thread."""

    def __init__(self, namespace: str, rank: int) -> None:
        self.tags = {"namespace": namespace, "rank": str(rank)}
        self.m = _make(TRAINER)

    def on_committed(self, event: CheckpointEvent) -> None:
        self.m["versions"].inc(1, tags={**self.tags, "outcome": "committed"})
        if event.staged is not None:
            self.m["save_stall_seconds"].observe(event.staged.stall_s, tags=self.tags)
            self.m["staged_bytes"].inc(event.staged.staged_bytes, tags=self.tags)
        if event.seconds is not None:
            self.m["commit_seconds"].observe(event.seconds, tags=self.tags)
        self.m["newest_committed_step"].set(event.step, tags=self.tags)

    def on_unhealthy(self, event: CheckpointEvent) -> None:
        self.m["versions"].inc(1, tags={**self.tags, "outcome": "unhealthy"})

    def on_failed(self, event: CheckpointEvent) -> None:
        if event.stage == "persist":
            self.m["persist_failures"].inc(1, tags=self.tags)
        else:
            self.m["versions"].inc(1, tags={**self.tags, "outcome": "failed"})

    def on_persisted(self, event: CheckpointEvent) -> None:
        self.m["persisted"].inc(1, tags=self.tags)
        if event.seconds is not None:
            self.m["persist_seconds"].observe(event.seconds, tags=self.tags)
        self.m["newest_durable_step"].set(event.step, tags=self.tags)

    def on_restored(self, event: CheckpointEvent) -> None:
        result = event.result
        self.m["restores"].inc(1, tags={**self.tags, "source": result.source})
        self.m["restored_step"].set(result.step, tags=self.tags)
        for stage, seconds in result.stage_seconds().items():
            self.m["restore_stage_seconds"].set(seconds, tags={**self.tags, "stage": stage})


class StoreMetrics:
    """One host store's gauges (:meth:`update` from its housekeeping thread, at most once a second)."""

    PERIOD_S = 1.0

    def __init__(self, namespace: str, node_id: str) -> None:
        self.tags = {"namespace": namespace, "host": node_id[:12]}
        self.m = _make(STORE)
        self._last = 0.0
        self._replicated = 0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.PERIOD_S

    def update(self, *, held: int, reserved: int, budget: int, versions: dict[str, int], replicated: int) -> None:
        self._last = time.monotonic()
        self.m["host_held_bytes"].set(held, tags=self.tags)
        self.m["host_reserved_bytes"].set(reserved, tags=self.tags)
        self.m["host_budget_bytes"].set(budget, tags=self.tags)
        for state in ("committed", "pending"):
            self.m["host_versions"].set(versions.get(state, 0), tags={**self.tags, "state": state})
        if replicated > self._replicated:
            self.m["host_replicated_bytes"].inc(replicated - self._replicated, tags=self.tags)
            self._replicated = replicated


def store_figures(table, replicated: int) -> dict:
    """What :meth:`StoreMetrics.update` takes, read from a host store's version table (its lock held)."""
    pool = table.pool
    states: dict[str, int] = {}
    for v in table.versions.values():
        key = "committed" if v.state == "committed" else "pending"
        states[key] = states.get(key, 0) + 1
    return dict(
        held=table.held_bytes(),
        reserved=pool.held + pool.pooled,
        budget=pool.budget_bytes,
        versions=states,
        replicated=replicated,
    )


def trainer_metrics(namespace: str, rank: int) -> Optional[TrainerMetrics]:
    """The rank's listener, or None (logged) where Ray's metrics cannot be made."""
    try:
        return TrainerMetrics(namespace, rank)
    except Exception as exc:  # noqa: BLE001 - metrics never stop a job
        log.warning("rank %d: metrics are off: %s: %s", rank, type(exc).__name__, exc)
        return None
