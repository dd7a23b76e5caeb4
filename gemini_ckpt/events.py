"""Checkpoint events: what an integration listens to instead of overriding the
:class:`~gemini_ckpt.Checkpointer`'s lifecycle.

A listener subclasses :class:`CheckpointListener` and overrides the methods it needs. Events of
a version (``committed``, ``unhealthy``, ``persisted``, ``failed``) and of a restore
(``restored``) are delivered on this rank, in the order they happened, by one thread of the
Checkpointer's own (``gemini-ckpt-events``), never by the training thread: a listener may block
(report to a service, wait for a barrier) without stalling a step. What a listener raises is
logged and raised on the training thread at the next ``save``/``wait``/``close``, as a failed
background write is. ``on_start`` and ``on_close`` run on the training thread, on every rank in
the same order, so they may create process groups or wait for their own threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .errors import CheckpointError
from .health import Health
from .results import RestoreResult, SaveHandle, StageInfo

log = logging.getLogger("gemini_ckpt")

COMMITTED, UNHEALTHY, PERSISTED, FAILED, RESTORED = "committed", "unhealthy", "persisted", "failed", "restored"


@dataclass(frozen=True)
class CheckpointEvent:
    """One thing that happened to a version on this rank.

    ``kind``: ``committed`` (every copy acknowledged; ``health`` is its verdict), ``unhealthy``
    (committed, but its state failed its health checks: never restored, persisted or reported;
    delivered before its ``committed``), ``persisted`` (its durable copy is committed at
    ``location``), ``failed`` (not committed, or, with ``stage="persist"``, its persist failed;
    ``error`` says why) or ``restored`` (``restore()`` loaded it; ``result`` is what it returned).
    ``metrics`` are what ``save(step, metrics=...)`` was given. ``staged``: what ``save()`` paid
    (its stall and bytes; on ``committed``). ``seconds``: on ``committed``, from the ``save()`` call
    to every copy acknowledged; on ``persisted``, from the commit to the durable commit."""

    kind: str
    step: int
    rank: int
    metrics: Mapping[str, Any] = field(default_factory=dict)
    health: Optional[Health] = None
    location: Optional[str] = None
    error: Optional[BaseException] = None
    stage: str = ""
    result: Optional[RestoreResult] = None
    staged: Optional[StageInfo] = None
    seconds: Optional[float] = None


class CheckpointListener:
    """Told what happens to this rank's versions; override the methods you need.

    Example::

        class LogCommits(CheckpointListener):
            def on_committed(self, event):
                print(f"step {event.step} is safe in peer memory")

        ckpt = Checkpointer(state, config, listeners=[LogCommits()])
    """

    def on_start(self, ckpt: Any) -> None:
        """The Checkpointer started (training thread, every rank in the same order)."""

    def on_committed(self, event: CheckpointEvent) -> None:
        """A version is committed (events thread)."""

    def on_unhealthy(self, event: CheckpointEvent) -> None:
        """A committed version failed its health checks (events thread)."""

    def on_persisted(self, event: CheckpointEvent) -> None:
        """A version's durable copy is committed (events thread)."""

    def on_failed(self, event: CheckpointEvent) -> None:
        """A version was not committed, or its persist failed (events thread)."""

    def on_restored(self, event: CheckpointEvent) -> None:
        """``restore()`` loaded a version (events thread)."""

    def on_close(self, ckpt: Any, *, aborted: bool) -> None:
        """The Checkpointer is closing, every event before it delivered (training thread;
        ``aborted``: by ``abort()``, nothing is waited for and what this raises is logged only)."""


class Events:
    """The listeners of one Checkpointer and the thread that tells them."""

    def __init__(self, *, rank: int, on_error: Callable[[BaseException], None]) -> None:
        self.rank = rank
        self.listeners: list[CheckpointListener] = []
        self._on_error = on_error
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def add(self, listener: CheckpointListener) -> None:
        if not isinstance(listener, CheckpointListener):
            raise TypeError(
                f"a checkpoint listener must subclass gemini_ckpt.CheckpointListener, got {type(listener).__name__}"
            )
        self.listeners.append(listener)

    # --- training thread ----------------------------------------------------------------------------
    def started(self, ckpt: Any) -> None:
        for listener in self.listeners:
            listener.on_start(ckpt)

    def watch(self, handle: SaveHandle, metrics: Optional[Mapping[str, Any]], t0: float) -> None:
        """Emit this version's events as its futures resolve (from whichever thread resolves them).
        ``t0``: when ``save()`` was called (``time.perf_counter()``)."""
        if not self.listeners or handle.skipped:
            return
        step, metrics = handle.step, dict(metrics or {})
        committed_at: list[float] = []

        def health(fut) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result().unhealthy:
                self.emit(CheckpointEvent(UNHEALTHY, step, self.rank, metrics, health=fut.result()))

        def committed(fut) -> None:
            if fut.cancelled():
                return
            if fut.exception() is not None:
                self.emit(CheckpointEvent(FAILED, step, self.rank, metrics, error=fut.exception(), stage="commit"))
            else:
                verdict = handle.health.result() if handle.health.done() and not handle.health.exception() else None
                staged = handle.staged.result() if handle.staged.done() and not handle.staged.exception() else None
                committed_at.append(time.perf_counter())
                self.emit(
                    CheckpointEvent(
                        COMMITTED, step, self.rank, metrics, health=verdict, staged=staged, seconds=committed_at[0] - t0
                    )
                )

        def persisted(fut) -> None:
            if fut.cancelled() or not handle.committed.done() or handle.committed.exception() is not None:
                return  # a version that was not committed is told once, as such
            if fut.exception() is not None:
                self.emit(CheckpointEvent(FAILED, step, self.rank, metrics, error=fut.exception(), stage="persist"))
            elif fut.result() is not None:
                since = time.perf_counter() - committed_at[0] if committed_at else None
                self.emit(CheckpointEvent(PERSISTED, step, self.rank, metrics, location=fut.result(), seconds=since))

        handle.health.add_done_callback(health)
        handle.committed.add_done_callback(committed)
        handle.persisted.add_done_callback(persisted)

    def restored(self, result: RestoreResult) -> None:
        if self.listeners:
            self.emit(CheckpointEvent(RESTORED, result.step, self.rank, result=result))

    def close(self, ckpt: Any, *, timeout: float) -> None:
        """Deliver what is queued (up to ``timeout``), stop the thread, then ``on_close`` each."""
        if not self.listeners:
            return
        self.flush(timeout)
        self._stop()
        for listener in self.listeners:
            listener.on_close(ckpt, aborted=False)

    def abort(self, ckpt: Any) -> None:
        self._stop()
        for listener in self.listeners:
            try:
                listener.on_close(ckpt, aborted=True)
            except Exception as exc:  # noqa: BLE001 - the job is going down; it must not hide why
                log.warning(
                    "rank %d: checkpoint listener %s failed at abort: %s: %s",
                    self.rank,
                    type(listener).__name__,
                    type(exc).__name__,
                    exc,
                )

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._on_error(
                        CheckpointError(
                            f"rank {self.rank}: checkpoint listeners did not take {self._pending} event(s) within "
                            f"{timeout}s (CheckpointConfig.timeout_s); a listener is blocked"
                        )
                    )
                    return
                self._lock.wait(min(left, 0.5))

    # --- any thread -----------------------------------------------------------------------------------
    def emit(self, event: CheckpointEvent) -> None:
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gemini-ckpt-events", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put(event)

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            for listener in self.listeners:
                try:
                    getattr(listener, "on_" + event.kind)(event)
                except Exception as exc:  # noqa: BLE001 - raised on the training thread at the next call
                    log.error(
                        "rank %d: checkpoint listener %s failed on %s step %d: %s: %s",
                        self.rank,
                        type(listener).__name__,
                        event.kind,
                        event.step,
                        type(exc).__name__,
                        exc,
                    )
                    err = CheckpointError(
                        f"rank {self.rank}: checkpoint listener {type(listener).__name__} failed "
                        f"on {event.kind} step {event.step}: {type(exc).__name__}: {exc}"
                    )
                    err.__cause__ = exc
                    self._on_error(err)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()
