"""Which steps a run may write: steps only go forward, and versions an earlier run left behind
are either continued (``restore``), refused, or discarded (``overwrite=True``).

A :class:`Lineage` is the :class:`~gemini_ckpt.Checkpointer`'s admission rule, kept apart
from its threads: ``existing`` is what the tiers held when the run started (or restored),
``admit(step)`` refuses a step that would mix with what exists, and ``discards()`` names the
versions this run abandons (removed by rank 0 before its first version is committed).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from .errors import CheckpointError

log = logging.getLogger("gemini_ckpt")


def survey(memory, durable) -> tuple[int, ...]:
    """Steps the memory tier and the durable tier (or None) hold now. An unreachable durable
    tier is reported and left out (its steps are then not checked against this run's)."""
    steps = set(memory.committed_steps())
    if durable is not None:
        try:
            steps.update(durable.complete_steps())
        except OSError as exc:
            log.warning(
                "durable tier %s cannot be listed at start (%s); steps there are not checked against this run's",
                durable.uri,
                exc,
            )
    return tuple(sorted(steps))


class Lineage:
    def __init__(self, namespace: str, *, overwrite: bool, durable_uri: Optional[str] = None) -> None:
        self.namespace, self.overwrite, self.durable_uri = namespace, overwrite, durable_uri
        self.existing: tuple[int, ...] = ()  # steps the tiers held when this run started (or restored)
        self.restored: Optional[int] = None  # the step restore() loaded, if any
        self.last_saved: Optional[int] = None  # the newest step save() accepted in this run
        self.discard_pending = False  # versions an earlier run left that this run abandons ...
        self._floor = -1  # ... namely those of ``existing`` after this step

    def started(self, existing: Iterable[int]) -> None:
        self.existing = tuple(sorted(existing))

    def restored_to(self, step: int, existing: Iterable[int]) -> None:
        """``restore()`` loaded ``step``: continue from it (newer versions will be discarded)."""
        self.restored, self.last_saved = step, None
        self.existing = tuple(sorted(existing))

    def admit(self, step: int) -> None:
        """Raise unless ``step`` may be saved now: a later step than this run's last, than the
        restored one, and (in a run that did not restore) than every existing one unless
        ``overwrite``. Decides what :meth:`discards` returns."""
        if self.last_saved is not None:
            if step <= self.last_saved:
                raise ValueError(
                    f"save({step}): this run already saved step {self.last_saved}; steps only go "
                    f"forward. To go back, restore() an older version first (in a new Checkpointer)"
                )
            return
        floor = self.restored
        if floor is not None:
            if step <= floor:
                raise ValueError(f"save({step}): step {floor} was restored; the next save must be a later step")
            self.discard_pending, self._floor = any(s > floor for s in self.existing), floor
            return
        clash = [s for s in self.existing if s >= step]
        if clash and not self.overwrite:
            where = f"namespace {self.namespace!r}" + (
                f" and the durable tier {self.durable_uri}" if self.durable_uri else ""
            )
            raise CheckpointError(
                f"save({step}): {where} already hold(s) step(s) {clash[:5]}{' ...' if len(clash) > 5 else ''} "
                f"from an earlier run, and this run did not restore. Call restore() first to continue that run, "
                f"use another CheckpointConfig.namespace/durable_uri for a new run, or set "
                f"CheckpointConfig(overwrite=True) to discard those versions"
            )
        self.discard_pending, self._floor = bool(clash), step - 1

    def saved(self, step: int) -> None:
        self.last_saved = step

    def failed(self, step: int, newest_committed: Optional[int]) -> None:
        """Version ``step`` did not commit: it does not hold the step."""
        if self.last_saved == step:
            self.last_saved = newest_committed

    def discards(self) -> list[int]:
        """The versions this run abandons, once (call :meth:`retry_discards` if removing them failed)."""
        self.discard_pending = False
        return [s for s in self.existing if s > self._floor]

    def retry_discards(self) -> None:
        self.discard_pending = True

    def why_discarded(self) -> str:
        return f"newer than the restored step {self.restored}" if self.restored is not None else "overwrite=True"

    def discard_abandoned(self, memory, durable) -> None:
        """Rank 0, before its first version of a run: remove the versions this run abandons
        (newer than the restored step, or at/after its first step with overwrite). Memory
        tiers discard only versions written before this run attached, so a peer's new version
        of the same step is never touched. A failure is retried at the next version."""
        doomed = self.discards()
        if not doomed:
            return
        log.warning(
            "rank 0: discarding steps %s of namespace %r (%s); they will never be restored",
            doomed,
            self.namespace,
            self.why_discarded(),
        )
        try:
            for old in doomed:
                memory.discard(old)
            if durable is not None:
                durable.discard(doomed)
        except Exception as exc:  # noqa: BLE001 - never fail this version over it: retried at the next one
            self.retry_discards()
            log.error(
                "rank 0: could not discard steps %s yet (%s: %s); trying again at the next save",
                doomed,
                type(exc).__name__,
                exc,
            )
