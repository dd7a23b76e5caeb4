"""The thread that reports a :class:`~gemini_ckpt.integrations.ray_train.RayTrainCheckpointer`'s
durable versions to Ray Train, and what it reports: kept apart from the checkpointer so the
training thread's side (save, restore, close) and the reporting side (the order of reports, the
agreement between ranks over a gloo group) each read on their own."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..collective import rank0s
from ..errors import CheckpointError
from ..results import SaveHandle

log = logging.getLogger("gemini_ckpt")


@dataclass(frozen=True)
class Reported:
    step: int
    path: Optional[str]  # None: not persisted (failed or skipped); dropped without a report


_STOP = "stop"


class Reporter:
    """The thread that reports durable versions to Ray Train (for
    :class:`~gemini_ckpt.integrations.ray_train.RayTrainCheckpointer`, which hands it ``report``:
    report one version on this rank, ``path_of``: where a step's durable version is, and its
    gloo ``group``).

    Rank 0's thread takes the versions the persist policy chose, in step order, waits until
    each is durable (or failed: then it is dropped), and hands the decision to the other ranks
    over the checkpointer's own gloo group; every rank's thread then calls ``ray.train.report``.
    The group is used by these threads only, so nothing else on it can interleave."""

    def __init__(self, *, rank: int, world_size: int, group: Any, timeout_s: float,
                 report: Callable[[Reported], None], path_of: Callable[[int], str]) -> None:
        self.rank, self.world_size, self.group, self.timeout_s = rank, world_size, group, timeout_s
        self._report, self._path_of = report, path_of
        self.offered: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gemini-ckpt-ray-train-report", daemon=True)
        self._error: Optional[BaseException] = None
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def offer(self, step: int, handle: SaveHandle) -> None:
        """Rank 0: ``step`` will be persisted; report it once it is."""
        self.offered.append(step)
        self._queue.put((step, handle))

    def offer_ready(self, item: Reported) -> None:
        """Rank 0: a version that is durable already."""
        self.offered.append(item.step)
        self._queue.put(item)

    def finish(self, timeout: float) -> None:
        """Report what was offered, then stop the thread (every rank)."""
        if self.rank == 0:
            self._queue.put(_STOP)
        self._thread.join(timeout=timeout + 5)
        if self._thread.is_alive() and self._error is None:
            self._error = CheckpointError(
                f"rank {self.rank}: the last reports to Ray Train did not finish within {timeout}s "
                f"(CheckpointConfig.timeout_s)")

    def stop(self) -> None:
        """Stop without reporting the rest (abort): the thread ends at its next wait."""
        self._stopped = True
        self._queue.put(_STOP)

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        try:
            while not self._stopped:
                item = self._next() if self.rank == 0 else None
                item = self._agree(item)
                if item == _STOP:
                    return
                self._report(item)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next save/close
            if not self._stopped:
                log.error("rank %d: reporting to Ray Train failed: %s: %s", self.rank, type(exc).__name__, exc)
                self._error = CheckpointError(f"rank {self.rank}: reporting to Ray Train failed: "
                                              f"{type(exc).__name__}: {exc}")

    def _next(self):
        got = self._queue.get()
        if got == _STOP or isinstance(got, Reported):
            return got
        step, handle = got
        if handle.skipped:
            return Reported(step, None)
        try:
            location = handle.persisted.result(timeout=self.timeout_s)
        except BaseException:  # noqa: BLE001 - a failed persist is not reported (the Checkpointer raises it)
            return Reported(step, None)
        return Reported(step, self._path_of(step) if location is not None else None)

    def _agree(self, item):
        return rank0s(item, world_size=self.world_size, group=self.group)
