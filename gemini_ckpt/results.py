"""What ``save`` and ``restore`` give back (``SaveHandle``, ``RestoreResult``) and the counters a
Checkpointer keeps (``CheckpointStats``)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

from .health import Health


class Phases:
    """Wall time of the phases of one save(), as :attr:`StageInfo.phases` holds them."""

    def __init__(self, t0: float) -> None:
        self._last, self._marks = t0, []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._marks.append((name, now - self._last))
        self._last = now

    def done(self) -> tuple:
        return tuple(self._marks)


@dataclass(frozen=True)
class StageInfo:
    """Result of ``SaveHandle.staged``: what the training thread paid for this save."""

    step: int
    stall_s: float
    staged_bytes: int
    phases: tuple = ()
    """Where ``stall_s`` went, as ``(name, seconds)`` in order: ``plan`` (planning the snapshot
    with every rank: the first save, and the first after a restore or a change of the state's
    structure; a collective, so it includes waiting for the slowest rank), ``check`` (the
    trainer's health predicates), ``segment`` (a staging segment from the store), ``copy``
    (the one copy of the state) and ``hand_off`` (telling the store). With
    ``staging="overlap"``, ``copy`` is the part ``save()`` copied itself (buffers, gradients)."""
    behind_s: float = 0.0
    """``staging="overlap"``: the copying thread's copy of the parameters and optimizer state
    (while the next step ran; not a stall unless ``optimizer.step()`` had to wait for it,
    counted in ``CheckpointStats.overlap_wait_s``)."""


class SaveHandle:
    """One version's progress.

    ``staged`` is already resolved when ``save`` returns (the snapshot aliases nothing live;
    with ``staging="overlap"`` it resolves when the copying thread is done, and fails, as
    ``committed`` does, when a source changed in place before it was copied);
    ``committed`` resolves to the step once every copy is acknowledged; ``health`` resolves,
    just before ``committed``, to the version's :class:`~gemini_ckpt.health.Health` (``healthy``,
    ``unhealthy`` with the tensor and check that failed, or ``unchecked`` with
    ``health_check=None``); ``persisted`` resolves to the durable location once the durable
    commit is done, or to ``None`` when this version is not persisted (by policy, or because
    it is unhealthy). A failure sets the exception on the futures and is re-raised on the
    training thread at the next ``save``/``wait``/``close``.

    Example::

        handle = ckpt.save(step, metrics={"loss": loss.item()})
        ...
        if handle.health.result().unhealthy:
            print(handle.health.result().reason)
    """

    def __init__(self, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self.staged: Future[StageInfo] = Future()
        self.committed: Future[int] = Future()
        self.health: Future[Health] = Future()
        self.persisted: Future[Optional[str]] = Future()
        if skipped:
            for fut in (self.staged, self.health, self.committed, self.persisted):
                fut.cancel()

    def __repr__(self) -> str:
        def state(f: Future) -> str:
            if f.cancelled():
                return "skipped"
            if not f.done():
                return "pending"
            return "failed" if f.exception() is not None else "done"

        health = (
            self.health.result().status
            if self.health.done() and not self.health.cancelled() and self.health.exception() is None
            else state(self.health)
        )
        return (
            f"SaveHandle(step={self.step}, staged={state(self.staged)}, "
            f"committed={state(self.committed)}, health={health}, persisted={state(self.persisted)})"
        )


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore`` loaded.

    ``source`` is ``"memory"`` or ``"durable"``; ``sources`` maps each rank to where its bytes
    came from (``local``, ``peer``, ``durable``); ``bytes_read`` counts bytes per source tier.
    ``skipped_steps`` are the newer versions passed over, newest first, and ``skipped_reasons``
    why (``unhealthy: ...`` for a version that failed its health checks, else what made it
    unreadable); ``health`` is the loaded version's verdict (``unhealthy`` only when
    ``restore(step=...)`` asked for such a version).
    """

    step: int
    source: str
    sources: dict[int, str]
    bytes_read: dict[str, int]
    seconds: float
    world_size: int
    saved_world_size: int
    skipped_steps: tuple[int, ...] = field(default=())
    skipped_reasons: dict[int, str] = field(default_factory=dict)
    health: Optional[Health] = None
    timeline: tuple[tuple[str, float], ...] = field(default=())
    """This rank's stages of the restore, in order, as ``(stage, unix time)``: ``called``
    (``restore()`` entered), ``connected`` (rendezvous with the other ranks and the stores),
    ``surveyed`` (every rank agreed on the candidates), ``fetched`` (a candidate's plans and
    records read and verified), ``targeted`` (the live state's load target built and checked
    against the saved structure), ``planned`` (this rank's direct plan made, or the reason it
    takes DCP's planner logged; same world size memory versions only), ``opened`` (every rank agreed to load it; ``fetched`` and
    ``targeted`` repeat for each candidate tried), ``loaded`` (its bytes in the live
    tensors), ``done`` (applied, every rank agreed). ``path`` says how it was loaded:
    ``direct`` (each item copied straight into its live tensor) or ``dcp`` (DCP's load planner:
    resharding, or the durable tier)."""
    path: str = "dcp"
    recovery: tuple[dict, ...] = field(default=())
    """What the host stores did about host losses since the job last ran (empty otherwise):
    per lost host, unix times ``noticed`` (by the stores), ``node_dead`` (declared by Ray),
    ``rereplicated`` (the newest committed version back to ``replicas`` copies; the older kept
    versions follow 10 s after the loss), and, when a replacement joined, ``replacement_joined``
    and ``replacement_seeded`` (its store holds the lost host's copies of the newest version)."""

    rng_state: Optional[Any] = field(default=None, repr=False)
    """With ``restore(rng=False)``: the restored random number generators' states, not yet
    applied (:meth:`apply_rng` applies them); None otherwise (they were applied)."""

    def apply_rng(self) -> None:
        """Put the restored random number generators in place (after ``restore(rng=False)``)."""
        if self.rng_state is None:
            raise ValueError(
                "apply_rng(): this restore applied its random number generators already "
                "(restore(rng=False) keeps them for later)"
            )
        self.rng_state.apply()

    def stage_seconds(self) -> dict[str, float]:
        """Seconds each stage took (from the previous stage's end)."""
        out = {}
        for (_, a), (name, b) in zip(self.timeline, self.timeline[1:]):
            out[name] = b - a
        return out

    def summary(self) -> str:
        tiers = ", ".join(f"{k}={v / 1e6:.1f} MB" for k, v in sorted(self.bytes_read.items()) if v)
        extra = f"; skipped steps {list(self.skipped_steps)}" if self.skipped_steps else ""
        if self.skipped_reasons:
            extra += " (" + "; ".join(f"{s}: {why}" for s, why in self.skipped_reasons.items()) + ")"
        if self.health is not None and self.health.unhealthy:
            extra += f"; its state is UNHEALTHY ({self.health.reason})"
        ws = (
            f"; world size {self.saved_world_size} -> {self.world_size}"
            if self.world_size != self.saved_world_size
            else ""
        )
        return f"restored step {self.step} from {self.source} in {self.seconds:.3f}s ({tiers}){ws}{extra}"


@dataclass
class CheckpointStats:
    """Counters a training loop (or a dashboard) can read at any time."""

    saves: int = 0
    skipped: int = 0
    committed: int = 0
    failed: int = 0
    last_stall_s: float = 0.0
    total_stall_s: float = 0.0  # save() calls plus overlap_wait_s
    overlap_wait_s: float = 0.0  # staging="overlap": optimizer.step() waiting for the copying thread
    last_phases: tuple = ()  # where the newest save()'s stall went (StageInfo.phases)
    staging_bytes: int = 0  # bytes of the newest version's shard (this rank)
    staging_allocations: int = 0  # segments the memory tier created for this rank (not reused ones)
    plans: int = 0  # snapshot plans made (the first version, and every change of structure)
    footprint: dict = field(default_factory=dict)  # host -> bytes the plan will take there (computed at plan time)
    state_dicts: int = 0  # full state dicts built (the first version; then only when the cached items may not fit)
    last_commit_s: float = 0.0  # save() start -> committed, of the newest committed version
    unhealthy: int = 0  # committed versions whose state failed the health checks
    last_unhealthy_step: Optional[int] = None
    persisted: int = 0
    persist_failed: int = 0
    last_persisted_step: Optional[int] = None
    last_persist_error: Optional[str] = None
