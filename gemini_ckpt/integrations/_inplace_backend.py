"""The one adapter to Ray Train's in-place worker replacement (Ray 2.60's replica groups).

When a ``TorchConfig``'s backend declares ``has_replica_groups = True`` (a DeveloperAPI
attribute of ``ray.train.backend.Backend``), Ray Train's controller replaces only a failed
worker instead of restarting the group: the others keep running, and a new worker takes the
same world rank on the same placement-group bundle; the backend's ``on_start`` is called for
the newcomer alone. The path is internal to Ray Train v2 and pre-release in 2.60, so everything
that relies on it is here, behind :func:`support` (the Ray version and the names used), with
the plain ``TorchConfig`` (a full restart at every failure) as the fallback.

What this backend does differently from Ray's own ``_TorchBackend``:

- It forms no process group itself. The workers form it (:mod:`._rounds`) over a
  ``TCPStore`` served from the controller's process, which outlives every worker (losing rank 0
  loses nothing), and each start of workers opens a new round whose membership names every
  worker process (an incarnation) at its rank (:mod:`._members`): a replaced worker's zombie is
  refused. A host with k ranks is replaced one worker at a time; the survivors wait for all of
  them in one round.
- In an elastic run it stands in for the replacement of a failed worker whose host is gone and
  not replaced: the survivors go on at fewer ranks in their own processes (:mod:`._elastic`).
- It sets the true ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``NODE_RANK`` (with replica groups
  of one worker, Ray's own context says 0, 1 and 0 on every worker).
- It ends the run when recoveries stop helping (:class:`._bounds.Attempts`): an error raised
  here is not one Ray Train retries.
- Shutting a failed worker down does not wait for its process group (a stopped process never
  answers).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

from ..errors import RecoveryGaveUpError
from . import _bounds, _elastic, _rounds, _spares
from ._members import membership, worker_env
from ._ray_train_callback import ray_version

log = logging.getLogger("gemini_ckpt")

SUPPORTED_RAY = ((2, 60), (2, 60))  # the versions whose replica-group path was read and tested
REAP_S = 2.0  # the longest the controller waits to hear that a failed worker's process was ended
FALLBACK_ENV = "GEMINI_CKPT_INPLACE"  # "0": use the full restart even where the path exists


def support() -> Optional[str]:
    """Why the in-place path cannot be used on this Ray (None when it can)."""
    if os.environ.get(FALLBACK_ENV, "1") == "0":
        return f"${FALLBACK_ENV}=0"
    version = ray_version()
    low, high = SUPPORTED_RAY
    if not low <= version <= high:
        return (
            f"Ray {'.'.join(map(str, version))} is outside the versions whose in-place replacement this "
            f"release was tested with ({'.'.join(map(str, low))} to {'.'.join(map(str, high))})"
        )
    try:
        from ray.train.backend import Backend
        from ray.train.torch.config import TorchConfig, _TorchBackend  # noqa: F401
        from ray.train.v2._internal.execution.worker_group.execution_group import ReplicaGroup
        from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    except ImportError as exc:
        return f"Ray Train's replica-group interfaces cannot be imported ({exc})"
    missing = [
        name
        for name, ok in (
            ("Backend.has_replica_groups", hasattr(Backend, "has_replica_groups")),
            ("WorkerGroup.replace_replica_group", hasattr(WorkerGroup, "replace_replica_group")),
            ("WorkerGroup.get_workers", hasattr(WorkerGroup, "get_workers")),
            ("ReplicaGroup.get_workers", hasattr(ReplicaGroup, "get_workers")),
        )
        if not ok
    ]
    if missing:
        return f"Ray Train lacks {', '.join(missing)}"
    if os.environ.get("RAY_TRAIN_V2_ENABLED", "1") == "0":
        return "Ray Train v1 is enabled (RAY_TRAIN_V2_ENABLED=0)"
    return None


def _key(worker) -> tuple[str, int]:
    return worker.metadata.node_id, worker.metadata.pid


def _set_env(env: dict) -> tuple[str, str]:
    os.environ.update(env)
    return _spares.describe()


def node_ranks(workers) -> dict[int, tuple[int, int, int]]:
    """world rank -> (local rank, local world size, node rank), from where the workers run."""
    order: dict[str, list[int]] = {}
    for w in sorted(workers, key=lambda w: w.distributed_context.world_rank):
        order.setdefault(w.metadata.node_id, []).append(w.distributed_context.world_rank)
    out = {}
    for node_rank, ranks in enumerate(order.values()):
        for local, rank in enumerate(ranks):
            out[rank] = (local, len(ranks), node_rank)
    return out


def _bases() -> tuple[Optional[str], tuple]:
    """(why the internal names cannot be imported or None, (TorchConfig, context, backend, ReplicaGroup))."""
    try:
        from ray.train.torch.config import TorchConfig, TorchConfigContextManager, _TorchBackend
        from ray.train.v2._internal.execution.worker_group.execution_group import ReplicaGroup
    except ImportError as exc:
        return str(exc), (object, object, object, type(None))
    return None, (TorchConfig, TorchConfigContextManager, _TorchBackend, ReplicaGroup)


_IMPORT_ERROR, (_TorchConfig, _TorchContext, _TorchBackendBase, _ReplicaGroup) = _bases()


class _Context(_TorchContext):  # type: ignore[misc, valid-type]
    """Around the training function on each worker: form the process group's round first."""

    def __enter__(self):
        super().__enter__()
        from ._inplace_worker import Session

        session = Session.current()
        if session is not None:
            if _elastic.placed_in_ray_train not in session.on_placed:
                session.on_placed.append(_elastic.placed_in_ray_train)
            session.ensure_formed()


class _InPlaceBackend(_TorchBackendBase):  # type: ignore[misc, valid-type]
    """Ray Train's backend for in-place replacement (in Ray Train's controller process)."""

    has_replica_groups = True

    def __init__(self) -> None:
        self._server = None
        self._host: Optional[str] = None
        self._whole = None  # the WorkerGroup (a replica group is a slice of it)
        self._attempts: Optional[_bounds.Attempts] = None
        self._reapers: dict = {}  # node id -> its Reaper actor
        self._reapers_lock = None  # made in the controller (this object is pickled to it)
        self._shutting_others = False
        self._spares: Optional[_spares.Spares] = None
        self._tokens: dict[tuple[str, int], str] = {}  # (node id, pid) -> the worker's incarnation
        self._joins: Optional[_elastic.JoinWatch] = None

    def on_start(self, group, config) -> None:
        import ray

        if self._server is None:
            self._reapers_lock = threading.Lock()
            self._host = ray.util.get_node_ip_address()
            self._server = _rounds.server(self._host, timeout_s=config.reform_timeout_s)
            self._attempts = _bounds.Attempts(max_stuck=config.max_stuck, max_starts=4 * len(group) + config.max_stuck)
            self._spares = _spares.Spares(config.spares)
        if not isinstance(group, _ReplicaGroup):
            self._whole = group
            self._tokens = {}
            _rounds.new_group(self._server)
            if _elastic.elastic_bounds(group) is not None and self._elastic_supported():
                _elastic.install(
                    group,
                    _elastic.ElasticReplacement(
                        group,
                        config,
                        lost=self._ended,
                        before_shrink=lambda: self._check_attempts(None),
                        shrunk=self._shrunk,
                    ),
                )
                self._joins = self._joins or _elastic.JoinWatch()
                self._joins.start()
        self._check_attempts(group)
        resources = group.get_resources_per_worker()
        backend = config.backend or ("nccl" if resources.get("GPU", 0) > 0 else "gloo")
        for worker in group.get_workers():
            self._tokens[_key(worker)] = _rounds.new_token(self._server)
        workers = self._whole.get_workers()
        round_ = _rounds.open_round(self._server, self._membership(workers))
        placed = node_ranks(workers)
        refs = []
        for worker in group.get_workers():
            rank = worker.distributed_context.world_rank
            local, local_size, node_rank = placed[rank]
            env = worker_env(
                host=self._host,
                port=self._server.port,
                round_=round_,
                rank=rank,
                world_size=len(workers),
                local_rank=local,
                local_world_size=local_size,
                node_rank=node_rank,
                backend=backend,
                timeout_s=config.timeout_s,
                reform_timeout_s=config.reform_timeout_s,
                token=self._tokens[_key(worker)],
                secret=self._server.secret,
                max_stuck=config.max_stuck,
            )
            refs.append(worker.execute_async(_set_env, env))
        described = ray.get(refs, timeout=config.reform_timeout_s)
        nodes = {w.metadata.node_id for w in group.get_workers()}
        if isinstance(group, _ReplicaGroup) and nodes - set(self._reapers):
            # a replacement on a new host: its reaper starts later, so that its process start
            # does not take a core from the recovery (until then Ray Train ends a failed
            # worker there itself, seconds later)
            timer = threading.Timer(_spares.REFILL_DELAY_S, self._start_reapers, args=(group.get_workers(),))
            timer.daemon = True
            timer.start()
        else:
            self._start_reapers(group.get_workers())
        # a warm process for the next replacement on each of these hosts (a replacement took one)
        self._spares.learn(*described[0])
        if isinstance(group, _ReplicaGroup):
            self._spares.start(nodes, count=1, delay_s=_spares.REFILL_DELAY_S)
        else:
            self._spares.start(nodes)
        log.info(
            "gemini_ckpt: %s, round %d",
            f"replacement for rank {group.get_workers()[0].distributed_context.world_rank}"
            if isinstance(group, _ReplicaGroup)
            else f"group of {len(workers)} workers started",
            round_,
        )

    @staticmethod
    def _elastic_supported() -> bool:
        why = _elastic.support()
        if why is not None:
            log.warning(
                "gemini_ckpt: an elastic run cannot shrink in place on this Ray (%s): a host lost with no node "
                "to take its place restarts every worker at the smaller size (Ray Train's elastic path), still "
                "restoring from memory",
                why,
            )
        return why is None

    def _check_attempts(self, group) -> None:
        """End the run (an error Ray Train does not retry) when recoveries stopped helping."""
        why = self._attempts.start(self._server, replacing=group is None or isinstance(group, _ReplicaGroup))
        if why is not None:
            if group is not None and not isinstance(group, _ReplicaGroup):
                # Ray Train cleans up a replica group whose start raised, but not a whole worker
                # group past this point (its placement group and workers would outlive the run)
                group.shutdown()
            raise RecoveryGaveUpError(f"gemini_ckpt ended the run: {why}")

    def _membership(self, workers):
        """The round's members: every worker's incarnation at its world rank and place on its node."""
        placed = node_ranks(workers)
        return membership(
            {
                self._tokens[_key(w)]: (w.distributed_context.world_rank, *placed[w.distributed_context.world_rank])
                for w in workers
            }
        )

    def _ended(self, workers) -> None:
        """Failed workers: their incarnations join no round again (a zombie), and the survivors end
        their attempt now (the next round is asked for), whatever they saw."""
        if self._server is None:
            return
        try:
            for worker in workers:
                if (token := self._tokens.get(_key(worker))) is not None:
                    _rounds.revoke(self._server, token)
            _rounds.worker_failed(self._server)
        except Exception as exc:  # noqa: BLE001 - the store serves in this process; the replacement's start asks again
            log.warning("gemini_ckpt: asking for the next round at a worker's failure: %s", exc)

    def _shrunk(self, survivors: list, lost: list[int]) -> None:
        """An elastic run went on without the lost ranks ``lost``: the survivors' round."""
        round_ = _rounds.open_round(self._server, self._membership(survivors))
        log.warning(
            "gemini_ckpt: rank(s) %s lost with their host(s) and no node took their place: going on with %d "
            "workers in their own processes (round %d; ranks renumbered 0..%d), restoring the newest committed "
            "version resharded from memory",
            lost,
            len(survivors),
            round_,
            len(survivors) - 1,
        )

    def on_shutdown(self, group, config) -> None:
        # A failed worker's process is ended at once (Ray Train would wait 5 s for it to shut
        # down, then several more for ray.kill); a stopped one would never answer a request to
        # destroy its process group, and the survivors' groups are theirs to end.
        if isinstance(group, _ReplicaGroup):
            self._ended(group.get_workers())
            self._reap(group.get_workers())
            if not self._shutting_others:
                self._shut_other_failing(group)
        else:
            if self._spares is not None:
                self._spares.stop()
            if self._joins is not None:
                self._joins.stop()

    def _shut_other_failing(self, group) -> None:
        """Ray Train replaces failing replica groups one at a time, and while it replaces the
        first it asks every other *active* group's worker to clear its result queue: a second
        dead worker fails that call and the whole run with it. So the other failing groups are
        shut down (their processes ended) before the first is replaced; Ray Train replaces each
        in turn (an inactive group is replaced without a shutdown)."""
        status = self._whole.get_latest_poll_status() if self._whole is not None else None
        groups = self._whole.get_replica_groups() if self._whole is not None else None
        if status is None or not groups:
            return
        self._shutting_others = True
        try:
            for index in sorted(status.failing_replica_group_indices):
                other = groups[index]
                if other is not group and other.is_active():
                    other.shutdown()
            self._shut_dead_since_the_poll(group, groups)
        finally:
            self._shutting_others = False

    def _shut_dead_since_the_poll(self, group, groups) -> None:
        """A worker that died after the poll (a second failure during the reform) is not among the
        failing groups, and Ray Train's call to clear its result queue would fail the whole run. So
        that call is made here first, where a dead worker's group is shut down instead (a worker
        that does not answer in time is left to Ray Train's next poll)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        calls = [
            (other, [w.actor.clear_result_queue.remote() for w in other.get_workers()])
            for other in groups
            if other is not group and other.is_active()
        ]
        for other, refs in calls:
            try:
                ray.get(refs, timeout=REAP_S)
            except RayActorError:
                log.info("gemini_ckpt: a worker died since the last poll; its group is replaced next")
                other.shutdown()
            except GetTimeoutError:
                pass

    def _start_reapers(self, workers) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ._reaper import Reaper

        with self._reapers_lock:  # a timer's thread may start them too: one reaper per node
            for node in {w.metadata.node_id for w in workers} - set(self._reapers):
                self._reapers[node] = (
                    ray.remote(num_cpus=0)(Reaper)
                    .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                    .remote()
                )

    def _reap(self, workers) -> None:
        import ray

        for worker in workers:
            reaper = self._reapers.get(worker.metadata.node_id)
            if reaper is None:
                continue
            try:
                outcome = ray.get(reaper.kill.remote(worker.metadata.pid), timeout=REAP_S)
            except Exception as exc:  # noqa: BLE001 - a lost node's reaper is gone with it; Ray kills
                outcome = f"{type(exc).__name__}"
            log.info(
                "gemini_ckpt: failed worker of rank %d (pid %d): %s",
                worker.distributed_context.world_rank,
                worker.metadata.pid,
                outcome,
            )


@dataclass
class GeminiTorchConfig(_TorchConfig):  # type: ignore[misc, valid-type]
    """``TorchConfig`` for in-place recovery (build it with ``gray.torch_config``)."""

    reform_timeout_s: float = 120.0
    max_stuck: int = 3
    spares: int = 1
    replace_within_s: float = 3.0

    @property
    def backend_cls(self):
        return _InPlaceBackend

    @property
    def train_func_context(self):
        return _Context
