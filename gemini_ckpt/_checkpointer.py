"""``Checkpointer``: the two-phase save (blocking snapshot, background commit) and restore."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ._config import CheckpointConfig
from ._dcp_storage import SerialBuffer, StoreWriter, save_version
from ._durable import DurableTier, persist_policy
from ._fs_store import step_dir_name
from ._errors import BackgroundError, CheckpointError, CheckpointTimeoutError, ConfigError
from ._faults import fire
from ._handle import RestoreResult, SaveHandle, StageInfo
from ._restore import restore_newest
from ._staging import StagingPool
from ._state import TrainState
from ._store import Store, local_store

log = logging.getLogger("gemini_ckpt")


@dataclass
class CheckpointStats:
    """Counters a training loop (or a dashboard) can read at any time."""

    saves: int = 0
    skipped: int = 0
    committed: int = 0
    failed: int = 0
    last_stall_s: float = 0.0
    total_stall_s: float = 0.0
    staging_bytes: int = 0
    staging_allocations: int = 0
    last_commit_s: float = 0.0  # save() start -> committed, of the newest committed version
    persisted: int = 0
    persist_failed: int = 0
    last_persisted_step: Optional[int] = None
    last_persist_error: Optional[str] = None


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
                 store: Optional[Store] = None, durable: Optional[DurableTier] = None) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Checkpointer needs a TrainState, got {type(state).__name__}")
        self.state = state
        self.config = config if config is not None else CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError("Checkpointer(config=...) must be a CheckpointConfig")
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self._store = store
        self.stats = CheckpointStats()
        self._pool = StagingPool(self.config.max_inflight)
        self._lock = threading.Condition()
        self._inflight = 0
        self._errors: list[BaseException] = []
        self._jobs: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._bg_group = None
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        # DCP caches plans per key; one key per checkpointer keeps two of them from mixing
        # (not id(self): ids are reused, and a new Checkpointer would inherit a dead one's plans).
        self._planner._cached_plans_key = f"gemini_ckpt:{uuid.uuid4().hex}"
        self._closed = False
        self._policy = persist_policy(self.config.persist_every,
                                      self.config.durable_uri or (durable.uri if durable else None))
        self._durable: Optional[DurableTier] = durable
        self._persist_jobs: queue.Queue = queue.Queue()
        self._persist_thread: Optional[threading.Thread] = None
        self._pinned: set[int] = set()  # versions being persisted: retention must not drop them
        self._persist_queued: set[int] = set()
        self._newest_committed: Optional[int] = None
        self._last_saved: Optional[int] = None  # the newest step save() accepted in this run
        self._existing: tuple[int, ...] = ()  # steps the tiers held when this run started
        self._restored: Optional[int] = None  # the step restore() loaded, if any
        self._discard_pending = False  # versions newer than the restored step still to remove
        self._discard_floor = -1  # ... namely those of ``_existing`` after this step
        self._kept_by_run: set[int] = set()  # steps this run committed while a discard was pending
        self._run_id = uuid.uuid4().hex
        self._serial_buffer = SerialBuffer()  # the background thread's, reused by every version

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Checkpointer":
        """Connect to the store and start the background thread (idempotent)."""
        if self._thread is not None:
            return self
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; build a new one")
        if self._store is None:
            self._store = self._make_store()
        if self._durable is None and self.config.durable_uri:
            self._durable = DurableTier(self.config.durable_uri, keep=self.config.keep_durable)
        existing = self._list_existing() if self.rank == 0 else ()
        if self.world_size > 1:
            # Background collectives get their own gloo group: sharing the training group from
            # another thread deadlocks when the two interleave differently on two ranks.
            self._bg_group = dist.new_group(backend="gloo")
            box = [(self._run_id, existing)]
            dist.broadcast_object_list(box, src=0, group=self._bg_group)
            # rank 0's run id names this job's persist outcomes in the rendezvous store
            self._run_id, existing = box[0]
        self._existing = tuple(existing)
        if self._durable is not None:
            if self.rank == 0:
                try:
                    self._durable.cleanup_incomplete()
                except OSError as exc:
                    # Memory may hold everything needed; persists will report the outage.
                    log.warning("durable tier %s is not reachable at start (%s: %s); incomplete "
                                "versions are cleaned up next time", self._durable.uri, type(exc).__name__, exc)
            self._persist_thread = threading.Thread(target=self._persist_run, name="gemini-ckpt-persist",
                                                    daemon=True)
            self._persist_thread.start()
        self._thread = threading.Thread(target=self._run, name="gemini-ckpt-bg", daemon=True)
        self._thread.start()
        return self

    def _list_existing(self) -> tuple[int, ...]:
        """Steps the memory and durable tiers hold now (rank 0; every rank gets its answer)."""
        steps = set(self._store.committed_steps())
        if self._durable is not None:
            try:
                steps.update(self._durable.complete_steps())
            except OSError as exc:
                log.warning("durable tier %s cannot be listed at start (%s); steps there are not checked "
                            "against this run's", self._durable.uri, exc)
        return tuple(sorted(steps))

    @property
    def durable(self) -> Optional[DurableTier]:
        """The durable tier, when ``durable_uri`` is set (still readable after ``close``)."""
        if self._durable is None and not self._closed:
            self.start()
        return self._durable

    def _make_store(self) -> Store:
        if self.config.store == "local":
            if self.world_size > 1:
                raise ConfigError(
                    f"CheckpointConfig.store='local' keeps versions in one process, but this job has "
                    f"{self.world_size} ranks; use store='ray' (host stores) for multi-process jobs"
                )
            return local_store(self.config.resolved_namespace).fence()
        from ._ray_store import connect_ray_store  # Ray is imported only when it is used

        return connect_ray_store(self.config, rank=self.rank, world_size=self.world_size)

    @property
    def store(self) -> Store:
        """Where versions live (connects on first use; still readable after ``close``)."""
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
            self._shutdown(raise_errors=False)

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int, *, persist: bool = False) -> SaveHandle:
        """Snapshot the state as version ``step`` and return once the copy is independent of
        the live tensors. Raises what failed in the background since the last call."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"save(step) needs a non-negative int step, got {step!r}")
        self.start()
        if persist and self._durable is None:
            raise ConfigError("save(persist=True) needs CheckpointConfig.durable_uri (a path or pyarrow.fs URI)")
        self._raise_background_errors()
        self._check_forward(step)
        t0 = time.perf_counter()
        with self._lock:
            while self._inflight >= self.config.max_inflight:
                if self.config.inflight_policy == "skip":
                    self.stats.skipped += 1
                    log.warning("skipped save of step %d: %d version(s) still in flight (skipped %d so far)",
                                step, self._inflight, self.stats.skipped)
                    return SaveHandle(step, skipped=True)
                if not self._lock.wait(timeout=self.config.timeout_s):
                    raise CheckpointTimeoutError(
                        f"save({step}) waited {self.config.timeout_s}s for the previous version's "
                        f"background work; raise CheckpointConfig.timeout_s or look at the store")
            self._inflight += 1
        buffers, queued = None, False
        try:  # whatever interrupts us before the job is queued (KeyboardInterrupt too) frees the slot
            self._raise_background_errors()
            buffers = self._pool.acquire()
            staged = buffers.stage(self.state.tensor_state())
            staged.update(self.state.opaque_state(self.rank))
            stall = time.perf_counter() - t0
            handle = SaveHandle(step)
            handle.staged.set_result(StageInfo(step=step, stall_s=stall, staged_bytes=buffers.nbytes))
            self._jobs.put((handle, staged, buffers, t0, persist))
            queued = True
        finally:
            if not queued:
                if buffers is not None:
                    self._pool.release(buffers)
                with self._lock:
                    self._inflight -= 1
                    self._lock.notify_all()
        self._last_saved = step
        s = self.stats
        s.saves += 1
        s.last_stall_s = stall
        s.total_stall_s += stall
        s.staging_bytes = self._pool.nbytes
        s.staging_allocations = self._pool.allocations
        return handle

    def _check_forward(self, step: int) -> None:
        """Steps only go forward: a step at or before one this job already has is refused,
        unless the job restored an older version (the newer ones are then discarded first) or
        ``overwrite=True`` says an earlier run's versions may go."""
        ns = self.config.resolved_namespace
        if self._last_saved is not None:
            if step <= self._last_saved:
                raise ValueError(f"save({step}): this run already saved step {self._last_saved}; steps only go "
                                 f"forward. To go back, restore() an older version first (in a new Checkpointer)")
            return
        floor = self._restored
        if floor is not None:
            if step <= floor:
                raise ValueError(f"save({step}): step {floor} was restored; the next save must be a later step")
            self._discard_pending, self._discard_floor = any(s > floor for s in self._existing), floor
            return
        clash = [s for s in self._existing if s >= step]
        if clash and not self.config.overwrite:
            where = f"namespace {ns!r}" + (f" and the durable tier {self._durable.uri}" if self._durable else "")
            raise CheckpointError(
                f"save({step}): {where} already hold(s) step(s) {clash[:5]}{' ...' if len(clash) > 5 else ''} "
                f"from an earlier run, and this run did not restore. Call restore() first to continue that run, "
                f"use another CheckpointConfig.namespace/durable_uri for a new run, or set "
                f"CheckpointConfig(overwrite=True) to discard those versions")
        self._discard_pending, self._discard_floor = bool(clash), step - 1

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
        try:
            if self._thread is not None:
                self.wait()
                self._persist_on_close()
                self.wait_persisted()
        finally:
            self._shutdown(raise_errors=True)
            if self.stats.persist_failed:
                warnings.warn(f"rank {self.rank}: {self.stats.persist_failed} persist(s) to {self._durable.uri} "
                              f"failed in this run; the last: {self.stats.last_persist_error}", stacklevel=2)

    def _persist_on_close(self) -> None:
        step = self._newest_committed
        if (self._durable is None or not self.config.persist_on_close or self.config.persist_every <= 0
                or step is None or step in self._persist_queued):
            return
        try:
            if step in self._durable.complete_steps():
                return
        except OSError as exc:
            log.warning("rank %d: cannot list the durable tier on close (%s); trying to persist anyway",
                        self.rank, exc)
        log.info("rank %d: persisting step %d on close", self.rank, step)
        handle = SaveHandle(step)
        self._queue_persist(handle)

    def wait_persisted(self, timeout: Optional[float] = None) -> None:
        """Block until every queued persist is done (succeeded or failed)."""
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            while self._persist_queued:
                left = deadline - time.monotonic()
                if left <= 0 or not self._lock.wait(timeout=left):
                    raise CheckpointTimeoutError(f"persist did not finish within {limit}s")
        self._raise_background_errors()

    def _shutdown(self, *, raise_errors: bool) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=self.config.timeout_s)
            self._thread = None
        if self._persist_thread is not None:
            self._persist_jobs.put(None)
            self._persist_thread.join(timeout=self.config.timeout_s)
            self._persist_thread = None
        self._closed = True
        if self._store is not None:
            self._store.close()
        _forget_plans(self._planner)
        if raise_errors:
            self._raise_background_errors()

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
            handle, staged, buffers, t0, persist = job
            try:
                self._write_version(handle.step, staged)
                self.stats.committed += 1
                self.stats.last_commit_s = time.perf_counter() - t0
                self._newest_committed = handle.step
                if self._discard_pending and self.rank == 0:
                    self._kept_by_run.add(handle.step)
                handle.committed.set_result(handle.step)
                if self._durable is not None and (persist or self._policy.should_persist(handle.step)):
                    self._queue_persist(handle)
                else:
                    handle.persisted.set_result(None)
            except BaseException as exc:  # DCP's CheckpointException derives from BaseException
                with self._lock:
                    if self._last_saved == handle.step:  # a failed version does not hold the step
                        self._last_saved = self._newest_committed
                err = BackgroundError(f"rank {self.rank}: version {handle.step} was not committed: "
                                      f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                self.stats.failed += 1
                log.error("%s", err)
                for fut in (handle.committed, handle.persisted):
                    fut.set_exception(err)
                with self._lock:
                    self._errors.append(err)
            finally:
                del staged
                self._pool.release(buffers)
                with self._lock:
                    self._inflight -= 1
                    self._lock.notify_all()

    def _queue_persist(self, handle: SaveHandle) -> None:
        with self._lock:
            self._pinned.add(handle.step)
            self._persist_queued.add(handle.step)
        self._persist_jobs.put(handle)

    def _persist_run(self) -> None:
        while True:
            handle = self._persist_jobs.get()
            if handle is None:
                return
            step = handle.step
            try:
                location = self._persist(step)
                self.stats.persisted += 1
                self.stats.last_persisted_step = step
                handle.persisted.set_result(location)
            except BaseException as exc:
                err = BackgroundError(f"rank {self.rank}: version {step} was not persisted to "
                                      f"{self._durable.uri}: {type(exc).__name__}: {exc}; "
                                      f"the memory tier is unaffected and the next persist retries")
                err.__cause__ = exc
                self.stats.persist_failed += 1
                self.stats.last_persist_error = str(err)
                log.error("%s", err)
                handle.persisted.set_exception(err)
                if self.config.persist_errors == "raise":
                    with self._lock:
                        self._errors.append(err)
            finally:
                with self._lock:
                    self._pinned.discard(step)
                    self._persist_queued.discard(step)
                    self._lock.notify_all()
            if self.rank == 0 and self._store is not None:
                try:
                    self._apply_retention()
                except Exception as exc:  # noqa: BLE001 - the persist thread must outlive any error
                    log.error("rank 0: retention after persisting step %d failed (%s: %s); kept versions stay "
                              "until the next one", step, type(exc).__name__, exc)

    def _persist(self, step: int) -> str:
        """Write a committed version from memory to the durable tier (coordinator commits)."""
        if self.rank != 0:
            return self._await_persist(step)
        try:
            return self._persist_as_coordinator(step)
        except BaseException as exc:
            self._publish_persist_failure(step, f"{type(exc).__name__}: {exc}")
            try:
                if self._durable.abandon(step):
                    log.info("rank 0: removed the partial directory of step %d", step)
            except Exception as cleanup:  # noqa: BLE001 - the next job's start removes it instead
                log.warning("rank 0: could not remove the partial directory of step %d: %s", step, cleanup)
            raise

    def _persist_key(self, step: int) -> str:
        return f"gemini_ckpt/{self._run_id}/persist_failed/{step}"

    def _publish_persist_failure(self, step: int, error: Optional[str]) -> None:
        """Rank 0 tells the other ranks (through torch.distributed's rendezvous store) that
        persisting ``step`` failed, so they stop waiting for it at once; ``None`` clears it."""
        store = _rendezvous_store() if self.world_size > 1 else None
        if store is None:
            return
        try:
            if error is None:
                store.delete_key(self._persist_key(step))
            else:
                store.set(self._persist_key(step), error)
        except Exception as exc:  # noqa: BLE001 - the others then find out by their timeout
            log.warning("rank 0: could not publish the persist outcome of step %d: %s", step, exc)

    def _await_persist(self, step: int) -> str:
        """Ranks other than 0: the version is durable when the tier lists it complete; rank 0
        publishes a failure in the rendezvous store (else the wait ends at ``timeout_s``)."""
        durable, store = self._durable, _rendezvous_store()
        key = self._persist_key(step)
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                if step in durable.complete_steps():
                    return durable.location(step)
            except OSError as exc:
                log.debug("rank %d: cannot list the durable tier yet: %s", self.rank, exc)
            if store is not None and store.check([key]):
                raise CheckpointError(f"rank 0 could not persist step {step}: {store.get(key).decode()}")
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(f"step {step} did not become durable within {self.config.timeout_s}s")
            time.sleep(0.2)

    def _persist_as_coordinator(self, step: int) -> str:
        durable = self._durable
        self._publish_persist_failure(step, None)  # an earlier failure of this step is history
        manifest = self._store.manifest(step)
        fire("persist", step=step, rank=self.rank)
        durable.begin(step)
        persist_from_store = getattr(self._store, "persist", None)
        if persist_from_store is not None and durable.uri_resolvable:
            # Host stores write their own ranks' files from their memory, in parallel.
            persist_from_store(step, durable.uri, step_dir_name(step))
        else:
            durable.write_files(step, {name: self._store.read_range(step, name, 0, size)
                                       for name, size in manifest.file_sizes.items()})
        fire("persist_commit", step=step, rank=self.rank)
        return durable.commit(step, manifest)

    def _discard_abandoned(self, step: int) -> None:
        """Rank 0, before the first version of a run is written: remove versions this run
        abandoned (newer than the restored step, or at/after its first step with overwrite).
        The other ranks wait in the first collective of the save, so none writes before this."""
        self._discard_pending = False
        # Never the versions this run wrote since (a retry after a failed discard).
        doomed = [s for s in self._existing if s > self._discard_floor and s not in self._kept_by_run]
        if not doomed:
            self._kept_by_run.clear()
            return
        log.warning("rank 0: discarding steps %s of namespace %r (%s); they will never be restored", doomed,
                    self.config.resolved_namespace,
                    f"newer than the restored step {self._restored}" if self._restored is not None
                    else "overwrite=True")
        try:
            for old in doomed:
                self._store.drop(old)
            if self._durable is not None:
                self._durable.discard(doomed)
            self._kept_by_run.clear()
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the save's collective: never fail here
            self._discard_pending = True  # tried again before the next version
            log.error("rank 0: could not discard steps %s yet (%s: %s); trying again at the next save", doomed,
                      type(exc).__name__, exc)

    def _write_version(self, step: int, staged: dict[str, Any]) -> None:
        if self._discard_pending and self.rank == 0:
            self._discard_abandoned(step)
        writer = StoreWriter(self._store, step, world_size=self.world_size, job=self._job_description(),
                             buffer=self._serial_buffer, signing_key=self.config.signing_key)
        save_version(staged, writer, planner=self._planner, group=self._bg_group, no_dist=self.world_size == 1)
        if self.rank == 0:
            self._apply_retention()
        fire("committed", step=step, rank=self.rank)

    def _apply_retention(self) -> None:
        committed = self._store.committed_steps()
        with self._lock:
            pinned = set(self._pinned)
        for old in committed[: -self.config.keep_in_memory]:
            if old not in pinned:
                self._store.drop(old)

    def _job_description(self) -> dict:
        from . import __version__

        return {"world_size": self.world_size, "replicas": self.config.replicas,
                "placement": self.config.placement, "gemini_ckpt": __version__, "torch": torch.__version__}

    # --- restore ------------------------------------------------------------------------------
    def restore(self) -> Optional[RestoreResult]:
        """Load the newest committed version into the live objects; ``None`` if there is none.

        The next ``save`` must be a later step; versions newer than the restored one (which
        could not be read) are discarded before it is written.

        A version whose bytes fail their checksums is skipped (with a warning) in favour of
        the next older one; a version whose structure does not match raises
        :class:`~gemini_ckpt.StructureMismatchError` naming the keys that differ.
        """
        self.start()
        self.wait()
        tiers = [("memory", self._store)]
        if self._durable is not None:
            tiers.append(("durable", self._durable.store))
        result = restore_newest(self.state, tiers, rank=self.rank, world_size=self.world_size,
                                group=self._bg_group, config=self.config)
        if result is None and self.config.init_from:
            from ._init_from import init_from

            result = init_from(self.state, self.config.init_from, rank=self.rank, world_size=self.world_size,
                               group=self._bg_group)
        if result is not None:
            log.info("rank %d: %s", self.rank, result.summary())
            # Continue from here: versions newer than this one (damaged, or abandoned) are
            # discarded before the next save is written, and never restored later.
            self._restored, self._last_saved = result.step, None
            existing = self._list_existing() if self.rank == 0 else ()
            if self.world_size > 1:
                box = [existing]
                dist.broadcast_object_list(box, src=0, group=self._bg_group)
                existing = box[0]
            self._existing = tuple(existing)
        return result


def _forget_plans(planner: DefaultSavePlanner) -> None:
    """Drop this checkpointer's entries from DCP's process-wide save-plan cache (class-level
    dicts keyed by ``_cached_plans_key``), which would otherwise keep them for the process's life."""
    key = getattr(planner, "_cached_plans_key", None)
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):
        cache = getattr(type(planner), name, None)
        if key is not None and isinstance(cache, dict):
            cache.pop(key, None)


def _rendezvous_store():
    """The key-value store every rank of the default process group shares, if any."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a private API: without it ranks fall back to the timeout
        return None
