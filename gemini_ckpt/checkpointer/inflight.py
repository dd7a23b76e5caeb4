"""The versions in flight between ``save()`` and their commit, and what failed meanwhile.

One lock guards the in-flight slots, the errors the background raises on the caller's thread
and the closing/stopped flags: ``save()`` takes a slot here (admission: ``max_inflight``,
``inflight_policy``), the background thread gives it back, ``wait()`` waits for none left.
"""

from __future__ import annotations

import logging
import threading
import time

from ..settings import SaveSettings
from ..errors import CheckpointError, CheckpointTimeoutError
from ..results import CheckpointStats

log = logging.getLogger("gemini_ckpt")


class InFlight:
    """The in-flight slots, the background errors and the closing flags, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        # One token per save() holding an in-flight slot, added and discarded in single calls: a
        # KeyboardInterrupt anywhere in save() leaves the set telling whether the slot was taken.
        self.slots: set[object] = set()
        self.errors: list[BaseException] = []
        self.closing = False  # close()/abort() began: no save() takes a slot from here on
        self.stopped = False  # the background thread was told to stop: nothing more is queued

    @property
    def count(self) -> int:
        return len(self.slots)

    def take(self, slot: object, step: int, settings: SaveSettings, stats: CheckpointStats) -> bool:
        """Admit ``save(step)``: wait for a free slot and hold it as ``slot``; False when the
        save is skipped instead (``inflight_policy="skip"``)."""
        with self.lock:
            while True:
                if self.closing:
                    raise CheckpointError(
                        f"save({step}): this Checkpointer is closing (close() or abort() "
                        f"was called from another thread); build a new one"
                    )
                if self.count < settings.max_inflight:
                    break
                if settings.skip_when_busy:
                    stats.skipped += 1
                    log.warning(
                        "skipped save of step %d: %d version(s) still in flight (skipped %d so far)",
                        step,
                        self.count,
                        stats.skipped,
                    )
                    return False
                if not self.lock.wait(timeout=settings.timeout_s):
                    raise CheckpointTimeoutError(
                        f"save({step}) waited {settings.timeout_s}s for the previous version's "
                        f"background work; raise CheckpointConfig.timeout_s or look at the store"
                    )
            self.slots.add(slot)
        return True

    def release(self, slot: object) -> None:
        with self.lock:
            self.slots.discard(slot)
            self.lock.notify_all()

    def begin_closing(self) -> None:
        with self.lock:
            self.closing = True

    def wait(self, limit: float) -> None:
        """Block until no version is in flight, at most ``limit`` seconds."""
        deadline = time.monotonic() + limit
        with self.lock:
            while self.count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.lock.wait(timeout=left):
                    raise CheckpointTimeoutError(f"wait() timed out after {limit}s with {self.count} in flight")

    def add_error(self, err: BaseException) -> None:
        with self.lock:
            self.errors.append(err)

    def raise_errors(self) -> None:
        """Raise the first error stored since the last call (and forget the others)."""
        with self.lock:
            if not self.errors:
                return
            first, self.errors = self.errors[0], []
        raise first
