"""``Checkpointer``: the facade users call (start, save, wait, close, restore) over its collaborators.

``save()`` reads as its steps: admission (:mod:`.inflight`), the snapshot (:mod:`.snapshot`,
or :mod:`.overlapped` with ``staging="overlap"``), the hand-off to the background thread
(:mod:`.background`); ``start()`` builds the tiers (:mod:`.tiers`); ``restore()`` is
:mod:`.restoring`; listeners hear of it all through :mod:`gemini_ckpt.events`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import warnings
from typing import Optional, Sequence

import torch.distributed as dist

from .. import attempts
from ..config import CheckpointConfig
from ..settings import compile_config
from ..errors import CheckpointError, ConfigError
from ..faults import fire
from ..format.commstate import Marker
from ..lineage import Lineage
from ..durable.writer import Persister
from ..retention import KeepNewest, Retention
from ..results import CheckpointStats, RestoreResult, SaveHandle
from ..restore.peek import Peeked, peek_newest
from ..state.train_state import TrainState
from ..stores.base import MemoryTier
from ..durable.tier import DurableTier, persist_policy
from ..unpickle import no_gc
from .background import Background, Job
from ..events import CheckpointListener, Events
from .inflight import InFlight
from .restoring import restore_version
from .snapshot import Snapshot
from .tiers import make_store, start_persister, start_survey, warm_up

log = logging.getLogger("gemini_ckpt")


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

    Nothing is started at construction: threads and connections start at the first
    ``save``/``restore``/``peek``. Rank and world size come from ``torch.distributed``.
    """

    def __init__(
        self,
        state: TrainState,
        config: Optional[CheckpointConfig] = None,
        *,
        store: Optional[MemoryTier] = None,
        durable: Optional[DurableTier] = None,
        durable_retention: Optional[Retention] = None,
        listeners: Sequence[CheckpointListener] = (),
    ) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Checkpointer needs a TrainState, got {type(state).__name__}")
        self.state = state
        self.config = config if config is not None else CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError("Checkpointer(config=...) must be a CheckpointConfig")
        self.settings = compile_config(self.config)  # what each part is told (gemini_ckpt.settings)
        if store is not None and not isinstance(store, MemoryTier):
            raise TypeError(
                f"Checkpointer(store=...) must be a memory tier (gemini_ckpt.stores.base.MemoryTier), "
                f"got {type(store).__name__}; a durable location goes in CheckpointConfig.durable_uri"
            )
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self._store = store
        self.stats = CheckpointStats()
        self._flight = InFlight()  # the in-flight slots, the background's errors, the closing flags
        self._bg_group = None
        self._closed = False
        durable_uri = self.settings.durable.uri or (durable.uri if durable else None)
        self.persist_policy = persist_policy(self.settings.durable.every, durable_uri)
        self._durable: Optional[DurableTier] = durable
        self._durable_retention = durable_retention or KeepNewest(self.settings.durable.keep)
        self._persister: Optional[Persister] = None
        # the snapshot phase: sources, stager, overlap copier (staging="overlap"), metric history
        self._snapshot = Snapshot(state, self.settings.save, self.stats, rank=self.rank, world_size=self.world_size)
        self._lineage = Lineage(self.settings.namespace, overwrite=self.settings.overwrite, durable_uri=durable_uri)
        self._background = Background(self._flight, self._lineage, self.stats, self.settings.save, rank=self.rank)
        self._run_id = uuid.uuid4().hex
        self._warm: Optional[threading.Thread] = None
        self._events = Events(rank=self.rank, on_error=self._flight.add_error)
        for listener in listeners:
            self._events.add(listener)

    def add_listener(self, listener: CheckpointListener) -> None:
        """Tell ``listener`` (a :class:`~gemini_ckpt.CheckpointListener`, see
        :mod:`gemini_ckpt.events`) what happens to this rank's versions; before start."""
        if self._background.started or self._closed:
            raise CheckpointError("add_listener() after the Checkpointer started; pass Checkpointer(listeners=[...])")
        self._events.add(listener)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Checkpointer":
        """Connect to the store and start the background threads (idempotent)."""
        self._start()
        return self

    def _start(self, restoring: Optional[tuple] = None) -> Optional[tuple]:
        """:meth:`start`. ``restoring``: ``(step,)`` when :meth:`restore` starts it. Rank 0 then
        takes the restore's survey of the tiers here, and the start's one collective carries it:
        returned when every rank asked for the same restore, so the restore needs no survey
        round of its own (None otherwise: the restore surveys, and raises on different steps)."""
        if self._background.started:
            return None
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; build a new one")
        # A runner that can run the training function again (in-place recovery) aborts this
        # Checkpointer when the attempt fails, and hears of its progress.
        attempt = attempts.current()
        if attempt is not None:
            attempt.adopt(self)
            self._background.on_commit = attempt.committed
        # One-time costs of a new process, paid while the ranks wait for each other below.
        self._warm = threading.Thread(target=warm_up, name="gemini-ckpt-warm-up", daemon=True)
        self._warm.start()
        if self._store is None:
            self._store = make_store(self.settings, rank=self.rank, world_size=self.world_size)
        for listener in self._store.listeners():
            self._events.add(listener)
        if self._durable is None and self.settings.durable.uri:
            self._durable = DurableTier(self.settings.durable.uri, keep=self._durable_retention)
        if self.world_size > 1:
            # Background collectives get their own gloo group: sharing the training group from
            # another thread deadlocks when the two interleave differently on two ranks.
            self._bg_group = dist.new_group(backend="gloo")
        self._run_id, existing, surveyed = start_survey(
            self._tiers(), restoring, self._run_id, rank=self.rank, world_size=self.world_size, group=self._bg_group
        )
        self._lineage.started(existing)
        self._snapshot.start(self._store, group=self._bg_group, run_id=self._run_id)
        if self._durable is not None:
            self._persister = start_persister(
                self._durable,
                self._store,
                self.settings,
                self.stats,
                rank=self.rank,
                world_size=self.world_size,
                run_id=self._run_id,
                on_error=self._persist_failed,
            )
        self._background.start(self._store, self._durable, self._persister)
        self._events.started(self)
        return surveyed

    def _tiers(self) -> list:
        return [self._store] + ([self._durable] if self._durable is not None else [])

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (the first ``save``/``restore`` starts it)."""
        return self._background.started

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

    @property
    def store(self) -> MemoryTier:
        """Where versions live in memory (connects on first use; still readable after ``close``)."""
        if self._store is None:
            self.start()
        return self._store

    def __enter__(self) -> "Checkpointer":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close() if exc_type is None else self.abort()

    def abort(self) -> None:
        """Stop without waiting for in-flight versions and without raising what failed (a job
        going down anyway). Committed versions stay in the store; the handles of those in flight
        fail within moments and none of them is persisted by this process."""
        if not self._closed:
            self._flight.begin_closing()
            self._events.abort(self)
            self._shutdown(raise_errors=False, wait=False)

    # --- interleaving (docs/interleave.md) ----------------------------------------------------
    def communicating(self):
        """A context manager around training communication the library does not hook (DDP's and
        FSDP2's are hooked by :func:`gemini_ckpt.interleave`): while any rank of a host is inside
        one, its host store sends no replication bytes (``with ckpt.communicating():
        dist.all_reduce(x)``). Free of messages; a no-op before start, after close, with
        ``interleave=False`` or ``"network"``, or ``store="local"`` (docs/interleave.md).
        """
        marker = self.comm_marker()
        return marker if marker is not None else contextlib.nullcontext()

    def comm_marker(self) -> Optional[Marker]:
        """This rank's marker, for a hook whose collective completes later: ``enter()`` when it
        is issued, ``exit()`` when it completes (from any thread). None when nothing is marked
        (see :meth:`communicating`)."""
        store = self._store
        if self._closed or store is None or not self._background.started:
            return None
        return store.comm_marker()

    @property
    def inflight(self) -> int:
        """Versions saved and not yet committed or failed (at most ``max_inflight``)."""
        return self._flight.count

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
        self._snapshot.wait_copy()
        slot, queued = object(), False
        try:  # whatever interrupts us before the job is queued (KeyboardInterrupt too) frees the slot
            if not self._flight.take(slot, step, self.settings.save, self.stats):
                return SaveHandle(step, skipped=True)
            fire("admitted", step=step, rank=self.rank)
            self._raise_background_errors()
            due = self._durable is not None and (persist or self.persist_policy.should_persist(step))
            handle = SaveHandle(step)
            taken = self._snapshot.take(step, due=due, metrics=metrics or {}, handle=handle, t0=t0)
            self._background.queue(Job(handle, taken.outcome, t0, due, slot))
            queued = True
            self._events.watch(handle, metrics, t0)
        except Exception as exc:
            if self._flight.stopped and slot in self._flight.slots and "aborted" not in str(exc):
                # abort() from another thread closed the store under this save(): the store's
                # own error (an executor shut down, a closed channel) says nothing to the caller
                raise CheckpointError(
                    f"save({step}): this Checkpointer was aborted while the version was "
                    f"being staged ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        finally:
            if not queued:
                self._flight.release(slot)
        self._lineage.saved(step)
        self._snapshot.record(step, taken)
        return handle

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every version in flight is committed (or failed); raise what failed."""
        self._flight.wait(self.settings.timeout_s if timeout is None else timeout)
        self._raise_background_errors()

    def close(self) -> None:
        """Wait for in-flight work, stop the background thread, raise what failed."""
        if self._closed:
            return
        self._flight.begin_closing()  # saves from other threads are refused from here on
        try:
            if self._background.started:
                self.wait()
                if self._persister is not None and self.settings.durable.on_close and self.settings.durable.every > 0:
                    self._persister.persist_on_close(self._background.newest_healthy)
                self.wait_persisted()
        finally:
            try:
                self._events.close(self, timeout=self.settings.timeout_s)
            finally:
                self._shutdown(raise_errors=True)
            if self.stats.persist_failed:
                warnings.warn(
                    f"rank {self.rank}: {self.stats.persist_failed} persist(s) to {self._durable.uri} "
                    f"failed in this run; the last: {self.stats.last_persist_error}",
                    stacklevel=2,
                )

    def wait_persisted(self, timeout: Optional[float] = None) -> None:
        """Block until every version saved so far is committed and its persist, if it is due
        one, is done (succeeded or failed)."""
        if self._background.started:
            self.wait(timeout)  # a persist is queued when its version commits
        if self._persister is not None:
            self._persister.wait(self.settings.timeout_s if timeout is None else timeout)
        self._raise_background_errors()

    def _shutdown(self, *, raise_errors: bool, wait: bool = True) -> None:
        # abort (wait=False): the version the background thread is tracking is not waited for;
        # closing the store below fails its outcome at once (the attach socket shuts)
        self._background.stop(self.settings.timeout_s if wait else 0.0, drain=wait)
        self._snapshot.stop()
        self._background.fail_unfinished()
        if self._persister is not None:  # an abort does not wait for rank 0's persist (it may be the lost one)
            self._persister.stop(self.settings.timeout_s, abandon=not wait)
        self._closed = True
        if self._store is not None:
            self._store.close()
        if raise_errors:
            self._raise_background_errors()

    def _raise_background_errors(self) -> None:
        self._flight.raise_errors()

    def _persist_failed(self, err: BaseException) -> None:
        if self.settings.durable.raise_errors:  # else counted in stats and logged only
            self._flight.add_error(err)

    # --- restore ------------------------------------------------------------------------------
    def restore(self, step: Optional[int] = None, *, rng: bool = True) -> Optional[RestoreResult]:
        """Load the newest healthy committed version into the live objects; ``None`` if there is
        none. The next ``save`` must be a later step; versions newer than the restored one (which
        could not be read, or are unhealthy) are discarded before it is written. A version whose
        bytes fail their checksums, or whose state failed its health checks, is skipped (with a
        warning; :attr:`RestoreResult.skipped_reasons` says why) in favour of the next older one;
        a version whose structure does not match raises :class:`~gemini_ckpt.StructureMismatchError`
        naming the keys that differ.

        ``step``: load exactly that version (every rank must name the same one), even an
        unhealthy one (with a warning: for debugging); :class:`~gemini_ckpt.VersionNotFoundError`
        when no tier holds it, and no fallback to another version. ``rng=False``: leave this
        process's random number generators as they are, for a framework that puts the restored
        ones back at a point of its own (``result.apply_rng()``).
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"restore(step=...) needs a non-negative int step or None, got {step!r}")
        marks = [("called", time.time())]
        surveyed = self._start(restoring=(step,))
        self.wait()
        if self._warm is not None:
            self._warm.join(timeout=self.settings.timeout_s)
        marks.append(("connected", time.time()))
        with no_gc():
            result, restored_plan = restore_version(
                self.state,
                self._tiers(),
                self.settings.restore,
                self._lineage,
                rank=self.rank,
                world_size=self.world_size,
                group=self._bg_group,
                marks=marks,
                step=step,
                rng=rng,
                surveyed=surveyed,
            )
        if result is not None:
            self._snapshot.restored_plan = restored_plan  # the first save may take it over
            self._events.restored(result)
        attempts.restored(result.step if result is not None else None)
        return result

    def peek(self) -> Optional[Peeked]:
        """The step and this rank's ``extra`` values of the version :meth:`restore` would load,
        nothing else loaded; ``None`` when there is none. For a framework that needs its counters
        before its optimizer exists: peek, build it, ``restore(step=peeked.step)``. Every rank calls it."""
        self.start()
        self.wait()
        return peek_newest(
            self._tiers(),
            rank=self.rank,
            world_size=self.world_size,
            group=self._bg_group,
            settings=self.settings.restore,
        )
