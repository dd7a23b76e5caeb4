"""The worker side of an in-place recovery: run the training function, and when a peer fails,
run it again in this same process with the peer's replacement, from the version every rank
agrees on.

:func:`recoverable` wraps the user's ``train_loop_per_worker``. Each run of it is an *attempt*
(:mod:`gemini_ckpt.attempts`) over one round of the process group (:mod:`._rounds`). A failure
that a peer caused (a collective that lost its peer, a connection reset, a store that cannot
reach its partner) ends the attempt: every Checkpointer it built is aborted, every process
group is destroyed, the ranks form the next round with the newcomer, and the training function
starts again. It rebuilds its model and optimizer as on a fresh start (cheap next to the
newcomer's process start, which runs meanwhile), and its ``restore()`` rolls every rank back to
the newest committed version, survivors from their own host's memory. What the process keeps:
itself, its imports, the CUDA context and allocator, compiled kernels, and its host store.

Why run the function again rather than repair the live objects: FSDP2 keeps the process group
objects it was built with (``FSDPMeshInfo``), DDP's reducer is bound to its group in C++, and
user code holds iterators over data loaders positioned past the version restored. Re-running
the function replaces all of them the way a fresh start does, so the continuation is the one a
full restart would give, bit for bit, without internal APIs.

An error that is not a peer's failure (the user's code raising) is not caught: it ends this
worker, Ray Train replaces it in place, and the others recover from its loss. Ray Train's
controller ends the run when recoveries stop making progress (:class:`._bounds.Attempts`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable, Optional

from .. import attempts
from . import _rounds, _sever
from ._failures import AFTERMATH, chain, peer_failure
from ._members import Told

__all__ = ["Session", "peer_failure", "recoverable", "recovery_info"]

log = logging.getLogger("gemini_ckpt")

WATCH_S = 0.2  # how often a rank asks the round store whether a newer round was asked for
PUBLISH_EVERY = 5  # polls between two looks at the listeners this process opened (see _sever)


class Session:
    """This worker's place in the job's rounds (one per process)."""

    _current: Optional["Session"] = None

    def __init__(self, told: Told) -> None:
        self.told = told
        self.store = None
        self.round: Optional[int] = None  # the round whose process group is up now
        self.wanted = told.round
        self.recoveries = 0
        self.stuck = 0  # recoveries in a row after which no newer version was committed
        self._progress_seen: Optional[int] = None  # the newest committed version at the last recovery
        self.stages: list[tuple[str, float]] = []  # (what, unix time) of the newest recovery
        # the TCP listeners this process held before any process group: the ones opened since
        # are the groups' (see :mod:`._sever`)
        self.baseline = set(_sever.listeners())
        self._opened: Optional[_sever.NewListeners] = None  # the listeners opened since (the watch's)
        self.entered = time.time()  # this process reached the training function
        self._cut_round: Optional[int] = None
        self._watcher_store = None
        self._cut_lock = threading.Lock()
        self._store_lock = threading.Lock()
        # called with (rank, world size) when a round gives this process another place (an
        # elastic resize renumbered the ranks): the Ray adapter updates Ray Train's context
        self.on_placed: list[Callable[[int, int], None]] = []

    @classmethod
    def current(cls) -> Optional["Session"]:
        if cls._current is None:
            told = Told.from_env()
            if told is None:
                return None
            cls._current = Session(told)
        return cls._current

    def _store(self):
        if self.store is None:
            self.store = _rounds.client(
                self.told.host, self.told.port, timeout_s=self.told.reform_timeout_s, secret=self.told.secret
            )
        return self.store

    def ensure_formed(self) -> int:
        import torch.distributed as dist

        if self.round is not None and dist.is_initialized():
            return self.round
        if self._progress_seen is None:  # where the run stands as this process first joins
            self._progress_seen = _rounds.progress(self._store())
        t = self.told
        try:
            self.round, members = _rounds.form(
                self._store(),
                self.wanted,
                token=t.token,
                backend=t.backend,
                timeout_s=t.timeout_s,
                patience_s=t.reform_timeout_s,
            )
        except _rounds.SupersededError as exc:
            _superseded(t, exc)
        me = members.of(t.token)
        self.told = t.placed(me, members.world_size)
        if (me.rank, members.world_size) != (t.rank, t.world_size):
            log.warning(
                "rank %d: round %d renumbered the ranks: this process is rank %d of %d now (was %d of %d)",
                me.rank,
                self.round,
                me.rank,
                members.world_size,
                t.rank,
                t.world_size,
            )
            for placed in self.on_placed:
                placed(me.rank, members.world_size)
        self.stages.append(("formed", time.time()))
        log.info("rank %d: process group round %d formed (%d ranks)", me.rank, self.round, members.world_size)
        return self.round

    def _progress(self, step: int) -> None:
        if self.told.rank == 0:
            _rounds.note_progress(self._store(), step)

    def cut(self, round_: int) -> None:
        """End round ``round_``'s connections here (once): every peer still blocked on this rank
        in a collective of that round wakes with an error."""
        with self._cut_lock:
            if self._cut_round is not None and self._cut_round >= round_:
                return
            self._cut_round = round_
        if "nccl" in self.told.backend:
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception as exc:  # noqa: BLE001 - the groups are destroyed right after anyway
                log.debug("aborting the NCCL groups of round %d: %s", round_, exc)
        try:
            peers = _rounds.peer_listeners(
                self._watch_store(), round_, rank=self.told.rank, world_size=self.told.world_size
            )
        except Exception as exc:  # noqa: BLE001 - cut what this side accepted, at least
            log.debug("rank %d: the peers' listeners of round %d: %s", self.told.rank, round_, exc)
            peers = []
        cut = _sever.sever(self.baseline, peers)
        log.info("rank %d: cut %d connection(s) of round %d", self.told.rank, cut, round_)

    def _watch_store(self):
        """A second client of the round store, for the watching thread."""
        with self._store_lock:
            if self._watcher_store is None:
                self._watcher_store = _rounds.client(
                    self.told.host, self.told.port, timeout_s=self.told.reform_timeout_s, secret=self.told.secret
                )
            return self._watcher_store

    def _publish(self, round_: int, published: list) -> list:
        if self._opened is None:
            self._opened = _sever.NewListeners(self.baseline)
        now = self._opened()
        if now != published:
            _rounds.publish_listeners(self._watch_store(), round_, self.told.rank, now)
        return now

    def _watch(self, round_: int, stop: threading.Event, attempt: attempts.Attempt) -> None:
        """While an attempt runs: once a newer round is asked for (a peer failed, or Ray Train
        started a replacement), end the attempt's waits and cut this round's connections, whatever
        the training thread is blocked in."""
        published: list = []
        ticks = 0
        while True:
            try:
                if ticks % PUBLISH_EVERY == 0:  # the groups the training function made meanwhile
                    published = self._publish(round_, published)
                ticks += 1
                if _rounds.latest(self._watch_store()) > round_:
                    attempt.interrupted.set()
                    self.cut(round_)
                    return
            except Exception as exc:  # noqa: BLE001 - the round store is gone: the run is ending
                log.debug("rank %d: watching round %d: %s", self.told.rank, round_, exc)
            if stop.wait(WATCH_S):
                return

    def run(self, fn: Callable, args: tuple):
        while True:
            round_ = self.ensure_formed()
            stop = threading.Event()
            with attempts.attempt(on_commit=self._progress, generation=round_) as attempt:
                watcher = threading.Thread(
                    target=self._watch, args=(round_, stop, attempt), name="gemini-ckpt-round-watch", daemon=True
                )
                watcher.start()
                try:
                    result = fn(*args)
                    self._finished()
                    return result
                except BaseException as exc:
                    if not isinstance(exc, Exception) or not self._recoverable(exc):
                        self._escaped(exc)  # the cause, which the controller's error quotes
                        raise
                    if self._stuck(exc):  # its reason is in the store (gave_up); the cause stays
                        raise
                    noticed = time.time()
                    log.warning(
                        "rank %d: a peer failed in round %d (%s: %s); forming the process group again "
                        "with its replacement and restarting the training function in this process",
                        self.told.rank,
                        round_,
                        type(exc).__name__,
                        _short(exc),
                    )
                    try:  # every other rank's watcher cuts its connections of this round now
                        _rounds.raise_latest(self._store(), round_ + 1)
                    except Exception:  # noqa: BLE001 - the run is ending: the error below says why
                        pass
                    self.cut(round_)
                    attempt.abort_all()
                finally:
                    stop.set()
            watcher.join(timeout=2 * WATCH_S + 1)
            _rounds.destroy()
            self.recoveries += 1
            self.stages = [("noticed", noticed), ("torn down", time.time())]
            self.wanted, self.round = self.round + 1, None

    def _recoverable(self, exc: BaseException) -> bool:
        if peer_failure(exc):
            return True
        try:
            # Another error while a new round is already asked for: a peer's failure reached this
            # rank in a form we do not recognise (a library thread's error, say); still a peer's.
            if self._newer_round_asked():
                return True
            # This library's error that a lost peer causes first: wait (bounded) for the
            # controller to find the failed worker and ask for a round (``worker_failed``).
            # Raising it at once would end every survivor with it, and Ray Train would replace
            # the survivors (and fail the run on the dead worker it had not found yet).
            if any(isinstance(e, AFTERMATH) for e in chain(exc)):
                return self._await_newer_round(self.told.grace_s)
        except Exception:  # noqa: BLE001 - the round store is gone: the run is ending
            return False
        return False

    def _stuck(self, exc: BaseException) -> bool:
        """Whether in-place recovery stopped helping: ``max_stuck`` recoveries in a row after which no
        newer version was committed (an error that reads like a peer's failure but repeats at the
        same place, say a user's ``TimeoutError``). Every rank counts the same (the progress is the
        round store's), gives up at the same recovery, and the controller then ends the run."""
        try:
            progress = _rounds.progress(self._store())
        except Exception:  # noqa: BLE001 - the round store is gone: the run is ending anyway
            return False
        if self._progress_seen is not None:
            self.stuck = self.stuck + 1 if progress <= self._progress_seen else 0
        self._progress_seen = progress
        if self.stuck < self.told.max_stuck:
            return False
        why = (
            f"{self.stuck} in-place recoveries in a row ended without a newer version committed (the newest is "
            f"step {progress}): the failure repeats at the same place; the last one on rank {self.told.rank}: "
            f"{type(exc).__name__}: {_short(exc)}"
        )
        log.error("rank %d: %s; not recovering again", self.told.rank, why)
        try:
            _rounds.note_gave_up(self._store(), why)  # encrypted: the store is open to its network
        except Exception:  # noqa: BLE001 - best effort: the error itself ends this worker
            pass
        return True

    def _newer_round_asked(self) -> bool:
        return self.round is not None and _rounds.latest(self._store()) > self.round

    def _await_newer_round(self, patience_s: float) -> bool:
        deadline = time.monotonic() + patience_s
        log.info(
            "rank %d: checkpointing failed in round %d; waiting up to %.0fs for a failed peer to be found",
            self.told.rank,
            self.round if self.round is not None else -1,
            patience_s,
        )
        while time.monotonic() < deadline:
            if self._newer_round_asked():
                return True
            time.sleep(WATCH_S)
        return self._newer_round_asked()

    def _finished(self) -> None:
        """Tell the controller this worker is done: a replacement of a peer that fails from now on
        ends the run (no round can form with this worker again) rather than being started again."""
        try:
            _rounds.note_finished(self._store())
        except Exception as exc:  # noqa: BLE001 - best effort: the run is ending anyway
            log.debug("rank %d: noting the end: %s", self.told.rank, exc)

    def _escaped(self, exc: BaseException) -> None:
        try:
            _rounds.note_escaped(self._store(), f"rank {self.told.rank}: {type(exc).__name__}: {_short(exc)}")
        except Exception:  # noqa: BLE001 - best effort: the error itself is what Ray reports
            pass


SUPERSEDED_EXIT = 75  # the exit status of a process whose rank a newer process took


def _superseded(told: Told, exc: BaseException) -> None:
    """A replaced worker's zombie reached a round it is no member of: it must not train, and
    nothing waits for it. End the process (its Ray actor is already gone)."""
    log.error("rank %d (incarnation %s): %s; this process ends", told.rank, told.token, exc)
    logging.shutdown()
    os._exit(SUPERSEDED_EXIT)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


def recoverable(train_fn: Callable) -> Callable:
    """Wrap ``train_loop_per_worker`` so that, under :func:`torch_config`, a peer's failure is
    recovered in place: this process stays, the training function runs again with the failed
    worker's replacement, and restores the newest committed version.

    Example::

        trainer = TorchTrainer(gray.recoverable(train_loop_per_worker),
                               torch_config=gray.torch_config(), ...)

    The training function needs no change: it builds its state, calls ``restore()`` and trains,
    exactly as it does for a full restart. Outside :func:`torch_config` (or on a Ray without the
    in-place path) it runs once, as if unwrapped.
    """

    @functools.wraps(train_fn)
    def run(*args):
        session = Session.current()
        if session is None:
            return train_fn(*args)
        return session.run(train_fn, args)

    run.__gemini_recoverable__ = True
    return run


def recovery_info() -> Optional[dict]:
    """This worker's place in an in-place job (None outside one): ``round`` (of the process
    group), ``recoveries`` (in this process), ``entered`` (when this process reached the
    training function, unix time) and ``stages`` of the newest recovery, ``[(what, unix time)]``:
    ``noticed`` (a peer's failure reached this rank), ``torn down`` (its attempt's checkpointers
    aborted, connections cut), ``formed`` (the next round's process group is up)."""
    session = Session.current()
    if session is None:
        return None
    return {
        "round": session.round,
        "recoveries": session.recoveries,
        "entered": session.entered,
        "stages": list(session.stages),
    }


def in_place_job() -> bool:
    """Whether this process was started by the in-place backend (:func:`torch_config`)."""
    return "GEMINI_ROUNDS_ADDR" in os.environ
