"""The second phase of a save: the background thread that tracks each version to its commit.

``save()`` queues a :class:`Job` (its handle, the memory tier's outcome future, whether it is
due for the durable tier); the thread waits for the outcome, resolves the handle's futures,
judges the verdict (an unhealthy version is never persisted) and queues a committed, healthy,
due version with the :class:`~gemini_ckpt.durable.writer.Persister`. What fails is stored in the
:class:`~.inflight.InFlight` errors and raised on the caller's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..settings import SaveSettings
from ..errors import BackgroundError, CheckpointError, UnhealthyVersionError
from ..faults import fire
from ..health import UNCHECKED_VERDICT, Health, no_verdict
from ..lineage import Lineage
from ..durable.writer import Persister
from ..results import CheckpointStats, SaveHandle
from ..stores.base import MemoryTier
from ..durable.tier import DurableTier
from .inflight import InFlight

log = logging.getLogger("gemini_ckpt")


@dataclass
class Job:
    handle: SaveHandle
    outcome: Any  # Future[Outcome] from the memory tier
    t0: float
    persist: bool
    slot: object  # the in-flight slot this version holds (InFlight.slots)


class Background:
    """The background thread and the versions queued for it (started by ``Checkpointer.start``)."""

    def __init__(
        self, inflight: InFlight, lineage: Lineage, stats: CheckpointStats, settings: SaveSettings, *, rank: int
    ) -> None:
        self.inflight = inflight
        self.lineage = lineage
        self.stats = stats
        self.settings = settings
        self.rank = rank
        self.jobs: queue.Queue = queue.Queue()
        self.thread: Optional[threading.Thread] = None
        self.store: Optional[MemoryTier] = None
        self.durable: Optional[DurableTier] = None
        self.persister: Optional[Persister] = None
        self.newest_committed: Optional[int] = None
        self.newest_healthy: Optional[int] = None  # what persist_on_close persists
        self.first_unhealthy: Optional[tuple[int, Health]] = None  # logged loudly; later ones quietly
        self.aborted = False  # abort(): the thread stops after its current job, which is not persisted
        self.on_commit: Optional[Callable[[int], None]] = None  # told of each version committed (attempts)

    @property
    def started(self) -> bool:
        return self.thread is not None

    def start(self, store: MemoryTier, durable: Optional[DurableTier], persister: Optional[Persister]) -> None:
        self.store, self.durable, self.persister = store, durable, persister
        self.thread = threading.Thread(target=self.run, name="gemini-ckpt-bg", daemon=True)
        self.thread.start()

    def queue(self, job: Job) -> None:
        """Queue a staged version, unless abort() from another thread stopped the thread meanwhile."""
        with self.inflight.lock:
            if self.inflight.stopped:
                raise CheckpointError(
                    f"save({job.handle.step}): this Checkpointer was aborted while the version "
                    f"was being staged; it may still commit in the store, but is not tracked"
                )
            self.jobs.put(job)

    def stop(self, timeout: float, *, drain: bool = True) -> None:
        """Tell the thread to stop and wait up to ``timeout`` for it: after every job queued so
        far (``close``), or after the one it is on (``drain=False``, ``abort``: the queued ones are
        left to :meth:`fail_unfinished`, and a version it commits from here on is not persisted)."""
        with self.inflight.lock:
            self.inflight.closing = self.inflight.stopped = True
            left = []
            if not drain:
                self.aborted = True
                while True:
                    try:
                        left.append(self.jobs.get_nowait())
                    except queue.Empty:
                        break
            self.jobs.put(None)  # after every job queued so far (abort: before them); none is queued after it
            for job in left:
                if job is not None:
                    self.jobs.put(job)
        if self.thread is not None:
            self.thread.join(timeout=timeout)
            self.thread = None

    def fail_unfinished(self) -> None:
        """Resolve the handles of versions the stopped background thread never took (abort, or a
        thread that did not stop in time): every handle a save() returned resolves."""
        stop = False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                if stop:  # a thread that did not stop in time still finds it
                    self.jobs.put(None)
                return
            if job is None:
                stop = True
                continue
            err = CheckpointError(
                f"rank {self.rank}: version {job.handle.step} was not tracked to its commit: "
                f"the Checkpointer was closed first"
            )
            for fut in (job.handle.health, job.handle.committed, job.handle.persisted):
                if not fut.done():
                    fut.set_exception(err)
            self.inflight.release(job.slot)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            handle = job.handle
            try:
                outcome = self._hand_off(job)
                health = outcome.health or (
                    UNCHECKED_VERDICT
                    if self.settings.health_check is None
                    else no_verdict(
                        "the host stores did not say that every shard carries a verdict, though health checks are on "
                        "(a store of another gemini_ckpt version?)"
                    )
                )
                self.stats.committed += 1
                self.stats.last_commit_s = time.perf_counter() - job.t0
                self.newest_committed = handle.step
                if not health.unhealthy:
                    self.newest_healthy = handle.step
                else:  # before ``committed`` resolves: a save() after it sees the error (on_unhealthy="raise")
                    self._unhealthy(handle.step, health, job.persist)
                handle.health.set_result(health)
                handle.committed.set_result(handle.step)
                fire("committed", step=handle.step, rank=self.rank)
                if self.on_commit is not None:
                    self.on_commit(handle.step)
                with self.inflight.lock:  # abort() stops the persister without waiting for this thread
                    persist = job.persist and not health.unhealthy and not self.aborted
                    if persist:
                        self.persister.queue(handle, pinned=True)
                if job.persist and not persist and not health.unhealthy:
                    handle.persisted.set_exception(
                        CheckpointError(
                            f"rank {self.rank}: version {handle.step} committed while the Checkpointer was aborted: "
                            f"it stays in memory and is not persisted"
                        )
                    )
                elif not persist:
                    handle.persisted.set_result(None)
            except BaseException as exc:  # DCP's CheckpointException derives from BaseException
                with self.inflight.lock:
                    self.lineage.failed(handle.step, self.newest_committed)
                err = BackgroundError(
                    f"rank {self.rank}: version {handle.step} was not committed: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
                self.stats.failed += 1
                # after abort() closed the store under it: expected, the job is going down
                log.log(logging.INFO if self.aborted else logging.ERROR, "%s", err)
                for fut in (handle.health, handle.committed, handle.persisted):
                    if not fut.done():
                        fut.set_exception(err)
                self.inflight.add_error(err)
            finally:
                self.inflight.release(job.slot)

    def _hand_off(self, job: Job):
        if self.lineage.discard_pending and self.rank == 0:
            self.lineage.discard_abandoned(self.store, self.durable)
        outcome = job.outcome.result(timeout=self.settings.timeout_s)
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
                self.store.unpin(step)
            except Exception as exc:  # noqa: BLE001 - retention catches up at the next commit
                log.warning("rank %d: could not release unhealthy step %d: %s", self.rank, step, exc)
        good = (
            f"the newest healthy version is step {self.newest_healthy}"
            if self.newest_healthy is not None
            else "no healthy version was saved by this run"
        )
        if self.first_unhealthy is None:
            self.first_unhealthy = (step, health)
            banner = "!" * 88
            log.error(
                "%s\nrank %d: step %d is UNHEALTHY: %s.\nIt is kept in memory for inspection only: it is never "
                "restored (unless named: restore(step=%d)), persisted, reported or counted by retention; %s. "
                "Later unhealthy versions are logged at INFO.\n%s",
                banner,
                self.rank,
                step,
                health.reason,
                step,
                good,
                banner,
            )
        else:
            log.info("rank %d: step %d is unhealthy too: %s", self.rank, step, health.reason)
        if self.settings.health_check is not None and self.settings.health_check.on_unhealthy == "raise":
            err = UnhealthyVersionError(
                f"rank {self.rank}: step {step} is unhealthy: {health.reason}; {good}. Stop and restart from it "
                f"(restore() skips unhealthy versions), or set HealthCheck(on_unhealthy='warn') to train on",
                step=step,
                health=health,
            )
            self.inflight.add_error(err)
