"""The current *attempt* of this process's training function, when something can run it again.

An in-place recovery (:func:`gemini_ckpt.integrations.ray_train.recoverable`) runs the training
function again in the same process after a peer failed. Whatever the failed attempt started
must end first: every :class:`~gemini_ckpt.Checkpointer` built during it is aborted (its
threads stop, its in-flight versions fail, its host-store connection closes), so the next
attempt starts from the same clean slate a new process would. Checkpointers register here
when they start; outside such a runner :func:`current` is None and nothing is recorded.

The runner is also told of progress (the newest version committed in memory), which is how
Ray Train's controller tells a recovery that helped from one that fails at the same place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Callable, Iterator, Optional

log = logging.getLogger("gemini_ckpt")


class Attempt:
    """One run of the training function: what it started, and where it got to."""

    def __init__(self, on_commit: Optional[Callable[[int], None]] = None, generation: Optional[int] = None) -> None:
        self._members: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._on_commit = on_commit
        self.newest_committed: Optional[int] = None
        self.restored: Optional[int] = None  # the step the attempt restored (None: a fresh start)
        # The runner's number for this attempt (an in-place round): every rank of one attempt has
        # the same, a later attempt a larger one; the host stores' rendezvous refuses an older
        # attempt's ranks once a newer one's join (see hoststore.actors.rendezvous).
        self.generation = generation
        # Set (from another thread) once the runner knows the attempt is over, a newer one being
        # asked for: a wait this attempt's code is in that no connection cut ends (a Ray call, say)
        # stops at it (:class:`~gemini_ckpt.errors.AttemptInterruptedError`).
        self.interrupted = threading.Event()

    def adopt(self, member) -> None:
        """Record something with an ``abort()`` to call when the attempt ends by a failure."""
        with self._lock:
            self._members.add(member)

    def committed(self, step: int) -> None:
        with self._lock:
            if self.newest_committed is not None and step <= self.newest_committed:
                return
            self.newest_committed = step
        if self._on_commit is not None:
            try:
                self._on_commit(step)
            except Exception as exc:  # noqa: BLE001 - progress is advisory; never fail a commit over it
                log.debug("could not record progress at step %d: %s", step, exc)

    def abort_all(self) -> int:
        """Abort every member (the attempt failed); returns how many there were."""
        with self._lock:
            members = list(self._members)
            self._members = weakref.WeakSet()
        for member in members:
            try:
                member.abort()
            except Exception as exc:  # noqa: BLE001 - the next attempt must start regardless
                log.warning(
                    "aborting %s after a failed attempt: %s: %s", type(member).__name__, type(exc).__name__, exc
                )
        return len(members)


_current: Optional[Attempt] = None


def current() -> Optional[Attempt]:
    return _current


@contextlib.contextmanager
def attempt(on_commit: Optional[Callable[[int], None]] = None, generation: Optional[int] = None) -> Iterator[Attempt]:
    """Make a new attempt current for the block."""
    global _current
    previous, _current = _current, Attempt(on_commit, generation)
    try:
        yield _current
    finally:
        _current = previous


def adopt(member) -> None:
    """Register ``member`` with the current attempt (no-op outside one)."""
    a = _current
    if a is not None:
        a.adopt(member)


def committed(step: int) -> None:
    a = _current
    if a is not None:
        a.committed(step)


def restored(step: Optional[int]) -> None:
    a = _current
    if a is not None:
        a.restored = step
