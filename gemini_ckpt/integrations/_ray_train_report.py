"""The thread that reports a Checkpointer's durable versions to Ray Train, and what it reports
(for :class:`~gemini_ckpt.integrations.ray_train.RayTrainReporting`, the listener that decides
what is reported): the order of reports and the agreement between ranks over a gloo group."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..collective import rank0s
from ..errors import CheckpointError

log = logging.getLogger("gemini_ckpt")


@dataclass(frozen=True)
class Reported:
    step: int
    path: Optional[str]  # None: not persisted (failed or skipped); dropped without a report
    metrics: dict = field(default_factory=dict)  # rank 0's, from save(step, metrics=...)


_STOP = "stop"


class Reporter:
    """The thread that reports durable versions to Ray Train (for
    :class:`~gemini_ckpt.integrations.ray_train.RayTrainReporting`, which hands it ``report``:
    report one version on this rank, and its gloo ``group``).

    Rank 0's thread takes the durable versions it is offered, in order, and hands each decision
    to the other ranks over the checkpointer's own gloo group; every rank's thread then calls
    ``ray.train.report``.
    The group is used by these threads only, so nothing else on it can interleave."""

    def __init__(self, *, rank: int, world_size: int, group: Any, timeout_s: float,
                 report: Callable[[Reported], None]) -> None:
        self.rank, self.world_size, self.group, self.timeout_s = rank, world_size, group, timeout_s
        self._report = report
        self.offered: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gemini-ckpt-ray-train-report", daemon=True)
        self._error: Optional[BaseException] = None
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def offer(self, item: Reported) -> None:
        """Rank 0: a durable version to report."""
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
                item = self._queue.get() if self.rank == 0 else None
                item = self._agree(item)
                if item == _STOP:
                    return
                self._report(item)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next save/close
            if not self._stopped:
                log.error("rank %d: reporting to Ray Train failed: %s: %s", self.rank, type(exc).__name__, exc)
                self._error = CheckpointError(f"rank {self.rank}: reporting to Ray Train failed: "
                                              f"{type(exc).__name__}: {exc}")

    def _agree(self, item):
        return rank0s(item, world_size=self.world_size, group=self.group)
