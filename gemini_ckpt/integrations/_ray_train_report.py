"""Reporting a Checkpointer's durable versions to Ray Train: :class:`RayTrainReporting`, the
listener that decides what is reported, and :class:`Reporter`, the thread that reports it (the
order of reports and the agreement between ranks over a gloo group)."""

from __future__ import annotations

import logging
import posixpath
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..checkpointer import Checkpointer
from ..collective import rank0s
from ..durable.layout import parse_step_dir, step_dir_name
from ..events import CheckpointListener
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

    def __init__(
        self, *, rank: int, world_size: int, group: Any, timeout_s: float, report: Callable[[Reported], None]
    ) -> None:
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
                f"(CheckpointConfig.timeout_s)"
            )

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
                self._error = CheckpointError(
                    f"rank {self.rank}: reporting to Ray Train failed: {type(exc).__name__}: {exc}"
                )

    def _agree(self, item):
        return rank0s(item, world_size=self.world_size, group=self.group)


class RayTrainReporting(CheckpointListener):
    """The listener that reports a Checkpointer's durable versions to Ray Train (see
    :class:`RayTrainCheckpointer`): rank 0 decides what is reported (each persisted version,
    in step order; at ``restore`` and at ``close``, durable versions Ray does not know of yet)
    and its :class:`Reporter` thread tells every rank's over the
    checkpointer's own gloo group, where each calls ``ray.train.report``."""

    def __init__(self, *, storage, report_root: str, timeout_s: float) -> None:
        self._storage, self._report_root, self._timeout_s = storage, report_root, timeout_s
        self._ckpt: Optional[Checkpointer] = None
        self._reporter: Optional[Reporter] = None
        self.reported_steps: list[int] = []

    def on_start(self, ckpt: Checkpointer) -> None:
        self._ckpt = ckpt
        # every rank starts at its first save/restore, so the groups are created in one order
        group = dist.new_group(backend="gloo") if ckpt.world_size > 1 else None
        self._reporter = Reporter(
            rank=ckpt.rank, world_size=ckpt.world_size, group=group, timeout_s=self._timeout_s, report=self._report_one
        )
        self._reporter.start()

    def on_committed(self, event) -> None:
        self._reporter.raise_error()  # a failed report surfaces on the training thread

    def on_persisted(self, event) -> None:
        if event.rank == 0:  # an unhealthy version is never persisted, so never reported
            self._reporter.offer(Reported(event.step, self._path(event.step), dict(event.metrics)))

    def on_restored(self, event) -> None:
        if event.rank == 0:
            for item in self._unreported():
                self._reporter.offer(item)

    def on_close(self, ckpt: Checkpointer, *, aborted: bool) -> None:
        if self._reporter is None:
            return
        if aborted:
            self._reporter.stop()
            return
        if ckpt.rank == 0:
            seen = set(self._reporter.offered)
            for item in self._unreported():
                if item.step not in seen:
                    self._reporter.offer(item)
        self._reporter.finish(self._timeout_s)
        self._reporter.raise_error()

    # --- which versions are reported (rank 0 decides) ------------------------------------------------
    def _unreported(self) -> list[Reported]:
        """Complete durable versions newer than the last one Ray knows of (rank 0)."""
        import ray.train

        last = max(self.reported_steps, default=-1)
        known = ray.train.get_checkpoint()
        if known is not None and posixpath.dirname(known.path.rstrip("/")) == self._report_root:
            name = posixpath.basename(known.path.rstrip("/"))
            step = parse_step_dir(name)
            if step is not None:
                last = max(last, step)
        return [Reported(s, self._path(s)) for s in self._ckpt.durable.complete_steps() if s > last]

    def _path(self, step: int) -> str:
        return posixpath.join(self._report_root, step_dir_name(step))

    def _report_one(self, item: Reported) -> None:
        """Report one version to Ray Train (on the reporter thread of every rank, with rank 0's metrics)."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        if item.path is None or (self.reported_steps and item.step <= self.reported_steps[-1]):
            return
        checkpoint = Checkpoint(item.path, filesystem=self._storage.storage_filesystem)
        ray.train.report(
            {**item.metrics, "step": item.step},
            checkpoint=checkpoint,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
        known = ray.train.get_checkpoint()
        if known is None or known.path.rstrip("/") != item.path.rstrip("/"):
            # Ray Train skips a report whose barrier a worker's replacement reset (in-place
            # recovery): not reported, so the next restore() offers it again
            log.info(
                "rank %d: Ray Train skipped the report of durable version %d (a worker was replaced)",
                self._ckpt.rank,
                item.step,
            )
            return
        self.reported_steps.append(item.step)
        log.info("rank %d: reported durable version %d to Ray Train (%s)", self._ckpt.rank, item.step, item.path)
