"""The in-place controller's bound on recoveries that do not help (in Ray Train's controller):
every start of workers is accounted for, and the run ends when recoveries stopped making
progress, when a worker cannot come back, or when a replacement is started after other workers
finished. What it reads is the round store's (:mod:`._rounds`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._rounds import escaped, finished, formed, gave_up, progress


@dataclass
class Attempts:
    """The controller's count of recoveries that did not help: a start of workers after which no
    newer version was committed than before the previous one. ``max_stuck`` such starts in a row
    end the run; so do ``max_starts`` starts without a round forming (a worker that cannot come back)."""

    max_stuck: int
    max_starts: int
    stuck: int = 0
    starts_since_formed: int = 0
    seen_formed: Optional[int] = None
    seen_progress: int = -1

    def start(self, store, *, replacing: bool = False) -> Optional[str]:
        """Account for a start of workers (``replacing``: in place of failed ones, the others kept);
        returns why the run should end, or None."""
        if replacing and (done := finished(store)):
            last = escaped(store)
            return (
                f"{done} worker(s) of this run already finished their training function, so no process group "
                f"can form with a replacement again: the run ends with the failed worker's error"
                + (f"; {last}" if last else "")
            )
        now_formed, now_progress = formed(store), progress(store)
        if self.seen_formed is None:
            self.seen_formed, self.seen_progress = now_formed, now_progress
            return None
        if now_formed != self.seen_formed:  # a round formed since the last start: a new failure
            self.starts_since_formed = 0
            self.stuck = self.stuck + 1 if now_progress <= self.seen_progress else 0
            self.seen_formed, self.seen_progress = now_formed, now_progress
        self.starts_since_formed += 1
        last = escaped(store)
        because = f"; the last error that ended a worker: {last}" if last else ""
        if given := gave_up(store):  # the ranks stopped recovering in place: the same failure again and again
            # (a survivor's own error names the lost peer; the error that ended a worker names the cause)
            return given + (because if last and last not in given else "")
        if self.stuck >= self.max_stuck:
            return (
                f"{self.stuck} recoveries in a row ended without a newer version committed (the newest is "
                f"step {now_progress}): the failure repeats at the same place{because}"
            )
        if self.starts_since_formed > self.max_starts:
            return f"{self.starts_since_formed} workers were started without the process group forming again{because}"
        return None
