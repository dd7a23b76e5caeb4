"""``Checkpointer``: the two-phase save (blocking snapshot, background commit) and restore.

The life of a version, on the trainer's side:

1. ``save(step)``: the plan's sources are captured (:mod:`gemini_ckpt.save.sources`; the
   first version, and a version whose structure changed, plan with DCP first:
   :mod:`gemini_ckpt.save.plan`, the only collective saving runs), a free segment of the
   memory tier is taken and the tensors are copied into it (:mod:`gemini_ckpt.save.stager`).
   ``save`` returns: the snapshot aliases nothing live. With ``staging="overlap"``
   (:mod:`gemini_ckpt.save.overlap`) the parameters and optimizer state are copied on a
   copying thread while the next step runs, and the next ``optimizer.step()`` waits for it.
   The segment is handed to the memory tier before ``save`` returns (one small message);
   with host stores the checksums, replication and commit happen there, not here.
   With a health check (``CheckpointConfig.health_check``, :mod:`gemini_ckpt.health`), ``save``
   judges the step's metrics (and runs the user's validator) here; the tensor check runs where
   the checksums are computed, not here.
2. The background thread waits for the version's outcome, its health included.
3. A committed, healthy version due for the durable tier goes to the
   :class:`~gemini_ckpt.persister.Persister`. An unhealthy one is never persisted; the first is
   logged loudly, and with ``on_unhealthy="raise"`` each is raised at the next ``save``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .collective import everyones, rank0s
from .config import CheckpointConfig
from .errors import (
    BackgroundError,
    CheckpointError,
    CheckpointTimeoutError,
    ConfigError,
    UnhealthyVersionError,
)
from .faults import fire
from .health import HEALTHY_VERDICT, UNCHECKED_VERDICT, Health, MetricHistory
from .lineage import Lineage, survey
from .persister import Persister
from .restore import restore_newest
from .retention import KeepNewest, Retention
from .results import CheckpointStats, RestoreResult, SaveHandle, StageInfo
from .save import overlap
from .save.checked import checked_items
from .save.plan import adopt, adoptable, make_plan, signature
from .save.sources import Sources, flatten
from .save.stager import Stager, check_saveable
from .state.train_state import TrainState
from .stores.base import MemoryTier
from .stores.durable import DurableTier, persist_policy
from .stores.memory import local_store
from .trust import no_gc

log = logging.getLogger("gemini_ckpt")


def _warm_up() -> None:
    from .trust import warm_up

    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - only an optimization
        log.debug("warm-up failed: %s: %s", type(exc).__name__, exc)


@dataclass
class _Job:
    handle: SaveHandle
    outcome: Any  # Future[Outcome] from the memory tier
    t0: float
    persist: bool
    slot: object  # the in-flight slot this version holds (Checkpointer._slots)



SLOW_SAVE_S = 1.0
"""A save() that stalls training longer than this (and 10x its average) is logged with its phases."""


class _Phases:
    """Wall time of the phases of one save() (``StageInfo.phases``)."""

    def __init__(self, t0: float) -> None:
        self._last, self._marks = t0, []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._marks.append((name, now - self._last))
        self._last = now

    def done(self) -> tuple:
        return tuple(self._marks)


class Checkpointer:
    """Checkpoint a :class:`TrainState` every step into memory (and every Nth to disk).

    Example::

        ckpt = Checkpointer(state, CheckpointConfig(store="local", keep_in_memory=2))
        result = ckpt.restore()          # None on a fresh start
        start = result.step + 1 if result else 0
        for step in range(start, total_steps):
            ...                          # forward, backward, optimizer.step()
            ckpt.save(step)              # returns once staged
        ckpt.close()

    Nothing is started at construction; the background thread (and, with ``store="ray"``,
    the connection to the host stores) starts at the first ``save``/``restore``/``start``.
    Rank and world size come from ``torch.distributed`` when it is initialized.
    """

    def __init__(self, state: TrainState, config: Optional[CheckpointConfig] = None, *,
                 store: Optional[MemoryTier] = None, durable: Optional[DurableTier] = None,
                 durable_retention: Optional[Retention] = None) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Checkpointer needs a TrainState, got {type(state).__name__}")
        self.state = state
        self.config = config if config is not None else CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError("Checkpointer(config=...) must be a CheckpointConfig")
        if store is not None and not isinstance(store, MemoryTier):
            raise TypeError(f"Checkpointer(store=...) must be a memory tier (gemini_ckpt.stores.base.MemoryTier), "
                            f"got {type(store).__name__}; a durable location goes in CheckpointConfig.durable_uri")
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self._store = store
        self.stats = CheckpointStats()
        self._lock = threading.Condition()
        # One token per save() holding an in-flight slot, added and discarded in single calls: a
        # KeyboardInterrupt anywhere in save() leaves the set telling whether the slot was taken.
        self._slots: set[object] = set()
        self._errors: list[BaseException] = []
        self._jobs: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._bg_group = None
        self._closed = False
        self._closing = False  # close()/abort() began: no save() takes a slot from here on
        self._stopped = False  # the background thread was told to stop: nothing more is queued
        self._policy = persist_policy(self.config.persist_every,
                                      self.config.durable_uri or (durable.uri if durable else None))
        self._durable: Optional[DurableTier] = durable
        # what the durable tier built from ``durable_uri`` lets go of (default: keep_durable newest)
        self._durable_retention = durable_retention or KeepNewest(self.config.keep_durable)
        self._persister: Optional[Persister] = None
        self._sources = Sources(state, self.rank)
        self._restored_plan = None  # the restored version's shard plan, until the first save decides on it
        self._stager = Stager()
        self._newest_committed: Optional[int] = None
        self._newest_healthy: Optional[int] = None  # what persist_on_close persists
        check = self.config.health_check
        self._metric_history = MetricHistory(check.metrics) if check is not None else None
        self._first_unhealthy: Optional[tuple[int, Health]] = None  # logged loudly; later ones quietly
        self._lineage = Lineage(self.config.resolved_namespace, overwrite=self.config.overwrite,
                                durable_uri=self.config.durable_uri or (durable.uri if durable else None))
        self._run_id = uuid.uuid4().hex
        self._warm: Optional[threading.Thread] = None
        # staging="overlap": the copying thread, the copy it is doing, the optimizers' hooks
        self._copier: Optional[ThreadPoolExecutor] = None
        self._copying: Optional[Future] = None
        self._step_hooks: list = []  # (optimizer, its pre-step hook's handle)
        self._split: Optional[tuple[int, list[int], list[int]]] = None  # (generation, now, behind)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Checkpointer":
        """Connect to the store and start the background threads (idempotent)."""
        if self._thread is not None:
            return self
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; build a new one")
        # One-time costs of a new process, paid while the ranks wait for each other below.
        self._warm = threading.Thread(target=_warm_up, name="gemini-ckpt-warm-up", daemon=True)
        self._warm.start()
        if self._store is None:
            self._store = self._make_store()
        if self._durable is None and self.config.durable_uri:
            self._durable = DurableTier(self.config.durable_uri, keep=self._durable_retention)
        existing = self._list_existing() if self.rank == 0 else ()
        if self.world_size > 1:
            # Background collectives get their own gloo group: sharing the training group from
            # another thread deadlocks when the two interleave differently on two ranks.
            self._bg_group = dist.new_group(backend="gloo")
            # rank 0's run id names this job's persist outcomes in the rendezvous store
            self._run_id, existing = rank0s((self._run_id, existing), world_size=self.world_size,
                                            group=self._bg_group)
        self._lineage.started(existing)
        if self._durable is not None:
            if self.rank == 0:
                try:
                    self._durable.cleanup_incomplete()
                except OSError as exc:
                    # Memory may hold everything needed; persists will report the outage.
                    log.warning("durable tier %s is not reachable at start (%s: %s); incomplete "
                                "versions are cleaned up next time", self._durable.uri, type(exc).__name__, exc)
            self._persister = Persister(
                self._durable, self._store, rank=self.rank, world_size=self.world_size,
                timeout_s=self.config.timeout_s, signing_key=self.config.signing_key, run_id=self._run_id,
                job=self._job_description(), stats=self.stats, on_error=self._persist_failed)
            self._persister.start()
        self._thread = threading.Thread(target=self._run, name="gemini-ckpt-bg", daemon=True)
        self._thread.start()
        return self

    def _list_existing(self) -> tuple[int, ...]:
        """Steps the memory and durable tiers hold now (rank 0; every rank gets its answer)."""
        return survey(self._store, self._durable)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (the first ``save``/``restore`` starts it)."""
        return self._thread is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` ran; a closed Checkpointer does not start again."""
        return self._closed

    @property
    def durable(self) -> Optional[DurableTier]:
        """The durable tier, when ``durable_uri`` is set (still readable after ``close``)."""
        if self._durable is None and not self._closed:
            self.start()
        return self._durable

    def _make_store(self) -> MemoryTier:
        if self.config.store == "local":
            if self.world_size > 1:
                raise ConfigError(
                    f"CheckpointConfig.store='local' keeps versions in one process, but this job has "
                    f"{self.world_size} ranks; use store='ray' (host stores) for multi-process jobs"
                )
            return local_store(self.config.resolved_namespace).attach(keep=KeepNewest(self.config.keep_in_memory))
        from .ray.client import connect  # Ray is imported only when it is used

        return connect(self.config, rank=self.rank, world_size=self.world_size)

    @property
    def store(self) -> MemoryTier:
        """Where versions live in memory (connects on first use; still readable after ``close``)."""
        if self._store is None:
            self.start()
        return self._store

    def __enter__(self) -> "Checkpointer":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Stop without waiting for in-flight versions and without raising what failed: for a
        job that is going down anyway (an exception in the training loop, a peer that died).
        Versions already committed stay in the store; one still in flight never commits."""
        if not self._closed:
            with self._lock:
                self._closing = True
            self._shutdown(raise_errors=False)

    @property
    def _inflight(self) -> int:
        return len(self._slots)

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int, *, persist: bool = False, metrics: Optional[dict] = None) -> SaveHandle:
        """Snapshot the state as version ``step`` and return once the copy is independent of
        the live tensors. Raises what failed in the background since the last call (with
        ``HealthCheck(on_unhealthy="raise")``, an :class:`~gemini_ckpt.UnhealthyVersionError`
        for a version whose state failed its health checks).

        ``metrics``: this step's numbers (e.g. ``{"loss": loss.item()}``) for the health check's
        metric predicates (:mod:`gemini_ckpt.health`); Ray Train's checkpointer also reports them."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"save(step) needs a non-negative int step, got {step!r}")
        if metrics is not None and not isinstance(metrics, dict):
            raise TypeError(f"save(metrics=...) must be a dict of metric name -> number, got {type(metrics).__name__}")
        self.start()
        if persist and self._durable is None:
            raise ConfigError("save(persist=True) needs CheckpointConfig.durable_uri (a path or pyarrow.fs URI)")
        self._raise_background_errors()
        self._lineage.admit(step)
        t0 = time.perf_counter()
        self._wait_copy()  # the previous version's overlapped copy (done by now, unless no optimizer step ran)
        slot, segment, queued = object(), None, False
        try:  # whatever interrupts us before the job is queued (KeyboardInterrupt too) frees the slot
            with self._lock:
                while True:
                    if self._closing:
                        raise CheckpointError(f"save({step}): this Checkpointer is closing (close() or abort() "
                                              f"was called from another thread); build a new one")
                    if self._inflight < self.config.max_inflight:
                        break
                    if self.config.inflight_policy == "skip":
                        self.stats.skipped += 1
                        log.warning("skipped save of step %d: %d version(s) still in flight (skipped %d so far)",
                                    step, self._inflight, self.stats.skipped)
                        return SaveHandle(step, skipped=True)
                    if not self._lock.wait(timeout=self.config.timeout_s):
                        raise CheckpointTimeoutError(
                            f"save({step}) waited {self.config.timeout_s}s for the previous version's "
                            f"background work; raise CheckpointConfig.timeout_s or look at the store")
                self._slots.add(slot)
            self._raise_background_errors()
            phases = _Phases(t0)
            captured = self._sources.capture()
            if captured is None:
                captured = self._plan()
                phases.mark("plan")
            tensors, blobs = captured
            plan = self._sources.plan
            verdict = self._judge(step, metrics or {})
            phases.mark("check")
            segment = self._store.segment(plan.shard)
            phases.mark("segment")
            due = self._durable is not None and (persist or self._policy.should_persist(step))
            handle = SaveHandle(step)
            behind = self._behind(tensors) if self.config.staging == "overlap" else []
            if behind:
                outcome = self._overlap(step, plan, segment, tensors, blobs, behind, due, verdict, handle, phases, t0)
                segment = None  # the copying thread's now
                stall = time.perf_counter() - t0
            else:
                self._stager.stage(plan.shard, segment, tensors, generation=self._sources.generation,
                                   volatile=self._sources.volatile)
                phases.mark("copy")
                fire("replicate", step=step, rank=self.rank)
                # Handed off before save() returns: a training process that dies right after still
                # leaves a whole shard with its host store, which commits the version without it.
                outcome = self._store.hand_off(step, plan.shard, segment, blobs, persist=due, verdict=verdict)
                segment = None  # the tier's now
                phases.mark("hand_off")
                stall = time.perf_counter() - t0
                handle.staged.set_result(StageInfo(step=step, stall_s=stall, staged_bytes=plan.shard.region_bytes,
                                                   phases=phases.done()))
            with self._lock:
                if self._stopped:  # abort() from another thread stopped the background thread meanwhile
                    raise CheckpointError(f"save({step}): this Checkpointer was aborted while the version was "
                                          f"being staged; it may still commit in the store, but is not tracked")
                self._jobs.put(_Job(handle, outcome, t0, due, slot))
                queued = True
        except Exception as exc:
            if self._stopped and slot in self._slots and "aborted" not in str(exc):
                # abort() from another thread closed the store under this save(): the store's
                # own error (an executor shut down, a closed channel) says nothing to the caller
                raise CheckpointError(f"save({step}): this Checkpointer was aborted while the version was "
                                      f"being staged ({type(exc).__name__}: {exc})") from exc
            raise
        finally:
            if not queued:
                if segment is not None:
                    self._store.give_back(segment)
                with self._lock:
                    self._slots.discard(slot)
                    self._lock.notify_all()
        self._lineage.saved(step)
        s = self.stats
        if s.saves >= 2 and stall > max(SLOW_SAVE_S, 10 * s.total_stall_s / s.saves):
            log.warning("rank %d: save(%d) stalled training %.2fs (%.3fs per save so far): %s", self.rank, step,
                        stall, s.total_stall_s / s.saves, ", ".join(f"{n} {t:.3f}s" for n, t in phases.done()))
        s.saves += 1
        s.last_stall_s = stall
        s.last_phases = phases.done()
        s.total_stall_s += stall
        s.staging_bytes = plan.shard.region_bytes
        s.staging_allocations = self._store.allocations
        return handle

    # --- overlapped staging (staging="overlap", gemini_ckpt.save.overlap) ------------------------
    def _behind(self, tensors: list) -> list[int]:
        """The tensor items the copying thread copies (cached per generation of the sources)."""
        gen = self._sources.generation
        if self._split is None or self._split[0] != gen:
            now, behind = overlap.split(self.state, tensors, self._sources.volatile)
            self._split = (gen, now, behind)
            hooked = {id(opt) for opt, _ in self._step_hooks}
            self._step_hooks += [(opt, opt.register_step_pre_hook(self._before_optimizer_step))
                                 for opt in self.state.optimizers if id(opt) not in hooked]
            log.info("rank %d: overlapped staging: %d tensor item(s) copied while the next step runs, %d by save()",
                     self.rank, len(behind), len(now))
        if not self._step_hooks:  # no optimizer: nothing would wait for the copy
            return []
        return self._split[2]

    def _overlap(self, step: int, plan, segment, tensors: list, blobs: list, behind: list[int], due: bool,
                 verdict, handle: SaveHandle, phases: _Phases, t0: float) -> Future:
        """Copy what may change before the next optimizer step now, queue the rest on the
        copying thread; the future resolves as the store's outcome does."""
        now = self._split[1]
        after = None
        if any(tensors[i].device.type == "cuda" for i in behind):
            after = torch.cuda.Event()
            after.record()  # the sources are final here on the training stream
        versions = [overlap.version_of(tensors[i]) for i in behind]
        self._stager.copy_items(plan.shard, segment, tensors, now)
        phases.mark("copy")
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-ckpt-copy-behind")
        outcome: Future = Future()
        info = dict(step=step, stall_s=time.perf_counter() - t0, staged_bytes=plan.shard.region_bytes,
                    phases=phases.done())
        self._copying = self._copier.submit(self._copy_behind, step, plan, segment, tensors, blobs, behind, versions,
                                            due, verdict, handle, outcome, after, info)
        return outcome

    def _copy_behind(self, step: int, plan, segment, tensors: list, blobs: list, behind: list[int],
                     versions: list[int], due: bool, verdict, handle: SaveHandle, outcome: Future, after,
                     info: dict) -> None:
        t0 = time.perf_counter()
        try:
            fire("copy_behind", step=step, rank=self.rank)
            self._stager.copy_items(plan.shard, segment, tensors, behind, after=after)
            changed = [plan.tensor_index[i].fqn for i, v in zip(behind, versions) if overlap.version_of(tensors[i]) != v]
            if changed:
                raise CheckpointError(
                    f"rank {self.rank}: version {step} is torn: {', '.join(changed[:5])}"
                    f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''} changed in place while "
                    f"staging='overlap' was copying it. Only optimizer.step() may change parameters and optimizer "
                    f"state between save() and the next step (it waits for the copy); change them after it, or use "
                    f"CheckpointConfig(staging='copy'). The previous version is kept")
            fire("replicate", step=step, rank=self.rank)
            store_outcome = self._store.hand_off(step, plan.shard, segment, blobs, persist=due, verdict=verdict)
            segment = None
        except BaseException as exc:  # noqa: BLE001 - reported through the version's futures
            if segment is not None:
                try:
                    self._store.give_back(segment)
                except Exception as give_exc:  # noqa: BLE001 - a closing store takes it back itself
                    log.debug("could not give back a segment: %s", give_exc)
            handle.staged.set_exception(exc)
            outcome.set_exception(exc)
            return
        handle.staged.set_result(StageInfo(**info, behind_s=time.perf_counter() - t0))
        store_outcome.add_done_callback(lambda f: outcome.set_exception(f.exception()) if f.exception() is not None
                                        else outcome.set_result(f.result()))

    def _wait_copy(self) -> float:
        """Wait for the overlapped copy in progress, if any; the seconds waited."""
        copying = self._copying
        if copying is None or copying.done():
            return 0.0
        t0 = time.perf_counter()
        try:
            copying.result(timeout=self.config.timeout_s)
        except TimeoutError as exc:
            raise CheckpointTimeoutError(f"rank {self.rank}: the overlapped copy of a version did not finish "
                                         f"within {self.config.timeout_s}s") from exc
        return time.perf_counter() - t0

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        waited = self._wait_copy()
        if waited:
            self.stats.overlap_wait_s += waited
            self.stats.total_stall_s += waited

    def _plan(self):
        """Plan the state with every rank (collective) and bind the sources to the new plan; the
        first save after a restore takes the restored version's plan over instead when every
        rank can (no planning collective, no new templates: seconds for a large state)."""
        state_dict = self._sources.live_state()
        restored, self._restored_plan = self._restored_plan, None
        if restored is not None:
            flat, job = flatten(state_dict), self._job_description()
            sig = signature(flat)
            ok = adoptable(restored, sig, rank=self.rank, world_size=self.world_size, job=job)
            ok = all(everyones(ok, world_size=self.world_size, group=self._bg_group))
            if ok:
                log.info("rank %d: this save takes over the plan of the restored version", self.rank)
                return self._use_plan(adopt(restored, sig, run_id=self._run_id, job=job), flat)
        plan, flat = make_plan(state_dict, rank=self.rank, world_size=self.world_size, group=self._bg_group,
                               job=self._job_description())
        self.stats.plans += 1
        log.info("rank %d: planned the snapshot (%d tensor items, %d values, %.1f MB per version)", self.rank,
                 len(plan.shard.tensors), len(plan.shard.values), plan.shard.region_bytes / 1e6)
        return self._use_plan(plan, flat)

    def _use_plan(self, plan, flat: dict):
        """Bind the sources to ``plan`` (made from, or checked against, the live state ``flat``)."""
        for index in plan.tensor_index:
            value = flat[index.fqn]
            check_saveable(index.fqn, value._local_tensor if hasattr(value, "_local_tensor") else value)
        # The store checks the items the plan names: only here do we know parameters from buffers.
        plan.shard = dataclasses.replace(plan.shard, checked=checked_items(plan, flat, self.state,
                                                                           self.config.health_check))
        return self._sources.bind(plan, flat)

    def _judge(self, step: int, metrics: dict) -> Optional[Health]:
        """The trainer's part of the health check (metrics, validator): None when it is off."""
        check = self.config.health_check
        if check is None:
            return None
        return check.judge(step, self.state, metrics, self._metric_history)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every version in flight is committed (or failed); raise what failed."""
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._lock.wait(timeout=left):
                    raise CheckpointTimeoutError(f"wait() timed out after {limit}s with {self._inflight} in flight")
        self._raise_background_errors()

    def close(self) -> None:
        """Wait for in-flight work, stop the background thread, raise what failed."""
        if self._closed:
            return
        with self._lock:
            self._closing = True  # saves from other threads are refused from here on
        try:
            if self._thread is not None:
                self.wait()
                if self._persister is not None and self.config.persist_on_close and self.config.persist_every > 0:
                    self._persister.persist_on_close(self._newest_healthy)
                self.wait_persisted()
        finally:
            self._shutdown(raise_errors=True)
            if self.stats.persist_failed:
                warnings.warn(f"rank {self.rank}: {self.stats.persist_failed} persist(s) to {self._durable.uri} "
                              f"failed in this run; the last: {self.stats.last_persist_error}", stacklevel=2)

    def wait_persisted(self, timeout: Optional[float] = None) -> None:
        """Block until every version saved so far is committed and its persist, if it is due
        one, is done (succeeded or failed)."""
        if self._thread is not None:
            self.wait(timeout)  # a persist is queued when its version commits
        if self._persister is not None:
            self._persister.wait(self.config.timeout_s if timeout is None else timeout)
        self._raise_background_errors()

    def _shutdown(self, *, raise_errors: bool) -> None:
        with self._lock:
            self._closing = self._stopped = True
            self._jobs.put(None)  # after every job queued so far; none is queued after it
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s)
            self._thread = None
        self._stop_copier()
        self._fail_unfinished()
        if self._persister is not None:
            self._persister.stop(self.config.timeout_s)
        self._closed = True
        if self._store is not None:
            self._store.close()
        if raise_errors:
            self._raise_background_errors()

    def _stop_copier(self) -> None:
        """The overlapped copy in progress finishes before the store (and its segments) close."""
        for _, hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def _fail_unfinished(self) -> None:
        """Resolve the handles of versions the stopped background thread never took (abort, or a
        thread that did not stop in time): every handle a save() returned resolves."""
        stop = False
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                if stop:  # a thread that did not stop in time still finds it
                    self._jobs.put(None)
                return
            if job is None:
                stop = True
                continue
            err = CheckpointError(f"rank {self.rank}: version {job.handle.step} was not tracked to its commit: "
                                  f"the Checkpointer was closed first")
            for fut in (job.handle.health, job.handle.committed, job.handle.persisted):
                if not fut.done():
                    fut.set_exception(err)
            with self._lock:
                self._slots.discard(job.slot)
                self._lock.notify_all()

    def _raise_background_errors(self) -> None:
        with self._lock:
            if not self._errors:
                return
            first, self._errors = self._errors[0], []
        raise first

    # --- background ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handle = job.handle
            try:
                outcome = self._hand_off(job)
                health = outcome.health or (HEALTHY_VERDICT if self.config.health_check is not None
                                            else UNCHECKED_VERDICT)
                self.stats.committed += 1
                self.stats.last_commit_s = time.perf_counter() - job.t0
                self._newest_committed = handle.step
                if not health.unhealthy:
                    self._newest_healthy = handle.step
                else:  # before ``committed`` resolves: a save() after it sees the error (on_unhealthy="raise")
                    self._unhealthy(handle.step, health, job.persist)
                handle.health.set_result(health)
                handle.committed.set_result(handle.step)
                fire("committed", step=handle.step, rank=self.rank)
                if health.unhealthy:
                    handle.persisted.set_result(None)
                elif job.persist:
                    self._persister.queue(handle, pinned=True)
                else:
                    handle.persisted.set_result(None)
            except BaseException as exc:  # DCP's CheckpointException derives from BaseException
                with self._lock:
                    self._lineage.failed(handle.step, self._newest_committed)
                err = BackgroundError(f"rank {self.rank}: version {handle.step} was not committed: "
                                      f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                self.stats.failed += 1
                log.error("%s", err)
                for fut in (handle.health, handle.committed, handle.persisted):
                    if not fut.done():
                        fut.set_exception(err)
                with self._lock:
                    self._errors.append(err)
            finally:
                with self._lock:
                    self._slots.discard(job.slot)
                    self._lock.notify_all()

    def _hand_off(self, job: _Job):
        if self._lineage.discard_pending and self.rank == 0:
            self._lineage.discard_abandoned(self._store, self._durable)
        outcome = job.outcome.result(timeout=self.config.timeout_s)
        if not outcome.committed:
            if outcome.error is not None:
                raise outcome.error
            raise CheckpointError(outcome.reason or "the memory tier did not commit it")
        return outcome

    def _unhealthy(self, step: int, health: Health, pinned: bool) -> None:
        """A committed version whose state failed its health checks (background thread): never
        persisted (a persist-due one is let go at once), logged, raised if so configured."""
        self.stats.unhealthy += 1
        self.stats.last_unhealthy_step = step
        if pinned:
            try:
                self._store.unpin(step)
            except Exception as exc:  # noqa: BLE001 - retention catches up at the next commit
                log.warning("rank %d: could not release unhealthy step %d: %s", self.rank, step, exc)
        good = (f"the newest healthy version is step {self._newest_healthy}" if self._newest_healthy is not None
                else "no healthy version was saved by this run")
        if self._first_unhealthy is None:
            self._first_unhealthy = (step, health)
            banner = "!" * 88
            log.error("%s\nrank %d: step %d is UNHEALTHY: %s.\nIt is kept in memory for inspection only: it is never "
                      "restored (unless named: restore(step=%d)), persisted, reported or counted by retention; %s. "
                      "Later unhealthy versions are logged at INFO.\n%s", banner, self.rank, step, health.reason, step,
                      good, banner)
        else:
            log.info("rank %d: step %d is unhealthy too: %s", self.rank, step, health.reason)
        if self.config.health_check is not None and self.config.health_check.on_unhealthy == "raise":
            err = UnhealthyVersionError(
                f"rank {self.rank}: step {step} is unhealthy: {health.reason}; {good}. Stop and restart from it "
                f"(restore() skips unhealthy versions), or set HealthCheck(on_unhealthy='warn') to train on",
                step=step, health=health)
            with self._lock:
                self._errors.append(err)

    def _persist_failed(self, err: BaseException) -> None:
        if self.config.persist_errors == "raise":  # else counted in stats and logged only
            with self._lock:
                self._errors.append(err)

    def _job_description(self) -> dict:
        from ._version import __version__

        return {"namespace": self.config.resolved_namespace, "world_size": self.world_size,
                "replicas": self.config.replicas,
                "placement": self.config.placement, "gemini_ckpt": __version__, "torch": torch.__version__}

    # --- restore ------------------------------------------------------------------------------
    def restore(self, step: Optional[int] = None) -> Optional[RestoreResult]:
        """Load the newest healthy committed version into the live objects; ``None`` if there is none.

        The next ``save`` must be a later step; versions newer than the restored one (which
        could not be read, or are unhealthy) are discarded before it is written.

        A version whose bytes fail their checksums, or whose state failed its health checks, is
        skipped (with a warning; :attr:`RestoreResult.skipped_reasons` says why) in favour of the
        next older one; a version whose structure does not match raises
        :class:`~gemini_ckpt.StructureMismatchError` naming the keys that differ.

        ``step``: load exactly that version (every rank must name the same one), even an
        unhealthy one (with a warning: for debugging); :class:`~gemini_ckpt.VersionNotFoundError`
        when no tier holds it, and no fallback to another version.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"restore(step=...) needs a non-negative int step or None, got {step!r}")
        with no_gc():
            return self._restore(step)

    def _restore(self, step: Optional[int] = None) -> Optional[RestoreResult]:
        marks = [("called", time.time())]
        self.start()
        self.wait()
        if self._warm is not None:
            self._warm.join(timeout=self.config.timeout_s)
        marks.append(("connected", time.time()))
        tiers = [self._store]
        if self._durable is not None:
            tiers.append(self._durable)
        plans: dict = {}
        result = restore_newest(self.state, tiers, rank=self.rank, world_size=self.world_size,
                                group=self._bg_group, config=self.config, marks=marks, step=step, plans=plans)
        if result is None and self.config.init_from and step is None:
            from .init_from import init_from

            result = init_from(self.state, self.config.init_from, rank=self.rank, world_size=self.world_size,
                               group=self._bg_group)
        if result is not None and self._store.recovery:
            result = dataclasses.replace(result, recovery=self._store.recovery)
        if result is not None:
            log.info("rank %d: %s", self.rank, result.summary())
            # Continue from here: versions newer than this one (damaged, or abandoned) are
            # discarded before the next save is written, and never restored later.
            existing = plans.get("held", ())  # what the tiers held (the survey every rank walked)
            self._lineage.restored_to(result.step, existing)
            self._restored_plan = plans.get("restored")  # the first save may take it over
        return result
