"""``store="local"``: versions kept in this process's memory (single-process jobs, rollback).

A :class:`LocalStore` per namespace lives as long as the process, so a new ``Checkpointer``
over rebuilt training objects finds the versions an earlier one kept. Each ``Checkpointer``
opens it through :meth:`LocalStore.attach`, which takes a fencing epoch: the tier it gets
refuses writes once a newer one was attached (:class:`~gemini_ckpt.FencedError`).

A version here is one shard (the world is one rank): committed as soon as the store has
checksummed it and checked its health, on the tier's own thread (the tensor check on a second
one beside it: here the record is the version's whole time-to-safe, see
:mod:`gemini_ckpt.format.finite`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointError, FencedError, MemoryBudgetError, VersionNotFoundError
from ..health import Health
from ..retention import Retention, as_retention
from .base import Capabilities, MemoryTier, Outcome
from ..format.segments import Segment, SegmentPool
from ..format.shards import ShardPlan, ShardRecord, make_record

DEFAULT_LOCAL_BUDGET = 1 << 62  # a process's own memory: the OS is the limit


@dataclass
class _Version:
    epoch: int
    plan: ShardPlan
    record: ShardRecord
    segment: Segment
    pinned: bool = False

    @property
    def unhealthy(self) -> bool:
        return self.record.health is not None and self.record.health.unhealthy


class LocalStore:
    """The process-wide versions of one namespace (see the module docstring)."""

    def __init__(self, namespace: str, budget_bytes: int = DEFAULT_LOCAL_BUDGET) -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._versions: dict[int, _Version] = {}
        self._pool = SegmentPool(budget_bytes, shared=False)
        self._retired: list[_Version] = []  # let go of while a persist still reads them
        self._epoch = 0

    def attach(self, *, keep: "int | Retention") -> "LocalTier":
        """Take the namespace over: a tier whose writes succeed until the next ``attach``.
        ``keep``: committed versions kept, or a :mod:`~gemini_ckpt.retention` policy."""
        with self._lock:
            self._epoch += 1
            return LocalTier(self, self._epoch, as_retention(keep))

    # --- called through a LocalTier, with its epoch ----------------------------------------
    def _check(self, epoch: int) -> None:
        if epoch != self._epoch:
            raise FencedError(
                f"a newer Checkpointer opened namespace {self.namespace!r} in this process (epoch {self._epoch}, "
                f"this one has {epoch}); this one's writes are refused. Two Checkpointers that live at the "
                f"same time (a GAN's G and D) need their own CheckpointConfig.namespace"
            )

    def _segment(self, epoch: int, plan: ShardPlan) -> Segment:
        with self._lock:  # not a write: a fenced tier is refused at hand-off, in the background
            try:
                return self._pool.reserve(plan.region_bytes)
            except MemoryError as exc:
                raise MemoryBudgetError(f"namespace {self.namespace!r}: {exc}") from None

    @property
    def budget_bytes(self) -> int:
        return self._pool.budget_bytes

    @property
    def allocations(self) -> int:
        """Segments created (not reused) over the store's life."""
        return self._pool.created

    def _give_back(self, seg: Segment) -> None:
        with self._lock:
            self._pool.release(seg)

    def _commit(
        self,
        epoch: int,
        step: int,
        plan: ShardPlan,
        seg: Segment,
        blobs: list[bytes],
        persist: bool,
        keep: Retention,
        verdict: Optional[Health] = None,
        beside=None,
    ) -> ShardRecord:
        record = make_record(plan, seg.array, blobs, epoch=epoch, step=step, verdict=verdict, beside=beside)
        with self._lock:
            self._check(epoch)
            old = self._versions.pop(step, None)
            if old is not None:
                self._release(old)
            self._versions[step] = _Version(epoch, plan, record, seg, pinned=persist)
            self._retain(keep)
        return record

    def _retain(self, keep: Retention) -> None:
        """Call with the lock held: let go of what ``keep`` dooms (never a pinned version;
        unhealthy ones do not count, see :mod:`gemini_ckpt.retention`)."""
        pinned = [s for s, v in self._versions.items() if v.pinned]
        unhealthy = [s for s, v in self._versions.items() if v.unhealthy]
        for s in keep.doomed(list(self._versions), protected=pinned, unhealthy=unhealthy):
            self._release(self._versions.pop(s))

    def _release(self, v: _Version) -> None:
        """Call with the lock held: free ``v``'s segment, or once its persist is done."""
        if v.pinned:
            self._retired.append(v)
        else:
            self._pool.release(v.segment)

    def _unpin(self, step: int, keep: Retention) -> None:
        with self._lock:
            v = self._versions.get(step)
            if v is not None:
                v.pinned = False
            for old in [r for r in self._retired if r.record.step == step]:
                self._retired.remove(old)
                old.pinned = False
                self._pool.release(old.segment)
            self._retain(keep)

    def _discard(self, epoch: int, step: int) -> None:
        with self._lock:
            self._check(epoch)
            v = self._versions.get(step)
            if v is not None and v.epoch < epoch:
                self._release(self._versions.pop(step))

    def committed_steps(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def _get(self, step: int) -> _Version:
        with self._lock:
            v = self._versions.get(step)
            if v is None:
                raise VersionNotFoundError(
                    f"step {step} is not committed in this process's memory (namespace {self.namespace!r})"
                )
            return v

    def held_bytes(self) -> int:
        with self._lock:
            return sum(v.segment.nbytes for v in self._versions.values())

    def kept_bytes(self, step: int, rank: int = 0):
        """The bytes of the kept shard of ``step`` as they are held (a uint8 view, not a copy): for
        inspection, and for the chaos harness's faults (:func:`gemini_ckpt.chaos.damage_copy`)."""
        return self._get(step).segment.array


class LocalTier(MemoryTier):
    """One Checkpointer's view of its namespace's :class:`LocalStore`."""

    capabilities = Capabilities(persists_itself=False)

    def __init__(self, store: LocalStore, epoch: int, keep: Retention) -> None:
        self.store, self.epoch, self.keep = store, epoch, keep
        self._pool: Optional[ThreadPoolExecutor] = None
        self._beside: Optional[ThreadPoolExecutor] = None  # the tensor check, beside the checksums
        # step -> the trainer's verdict, until the commit thread takes it (not an argument of
        # _commit: its signature is the seam tests use to fail or hold a commit)
        self._verdicts: dict[int, Optional[Health]] = {}
        self._closed = False

    def segment(self, plan: ShardPlan) -> Segment:
        return self.store._segment(self.epoch, plan)

    def footprint(self, sizes: dict[int, int], versions: int) -> dict[str, int]:
        need = versions * sum(sizes.values())
        budget = self.store.budget_bytes
        if need > budget:
            raise MemoryBudgetError(
                f"namespace {self.store.namespace!r}: {versions} versions (keep_in_memory + max_inflight) of a "
                f"{sum(sizes.values()):,}-byte shard need {need:,} bytes, over this process's store budget of "
                f"{budget:,} bytes; lower CheckpointConfig.keep_in_memory or max_inflight"
            )
        return {"this process": need}

    def hand_off(
        self,
        step: int,
        plan: ShardPlan,
        segment: Segment,
        blobs: list[bytes],
        *,
        persist: bool = False,
        verdict: Optional[Health] = None,
    ) -> "Future[Outcome]":
        """Checksums, health check and commit run on the tier's own threads, not the caller's."""
        self._verdicts[step] = verdict
        return self._worker().submit(self._commit, step, plan, segment, blobs, persist)

    def _commit(self, step, plan, segment, blobs, persist) -> Outcome:
        verdict = self._verdicts.pop(step, None)
        try:
            record = self.store._commit(
                self.epoch,
                step,
                plan,
                segment,
                blobs,
                persist,
                self.keep,
                verdict,
                self._check_thread() if plan.checked else None,
            )
        except BaseException:
            self.store._give_back(segment)
            raise
        return Outcome(step, True, health=record.health)

    def _worker(self) -> ThreadPoolExecutor:
        if self._closed:  # not a new pool that nobody shuts down
            raise CheckpointError("this process's local store tier is closed (its Checkpointer was closed)")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-ckpt-local")
        return self._pool

    def _check_thread(self) -> ThreadPoolExecutor:
        # Its own executor: a check queued behind the commit that waits for it would deadlock.
        if self._beside is None:
            self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-ckpt-local-check")
        return self._beside

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._beside is not None:
            self._beside.shutdown(wait=True)
            self._beside = None

    def unpin(self, step: int) -> None:
        self.store._unpin(step, self.keep)

    def committed_steps(self) -> list[int]:
        return self.store.committed_steps()

    def give_back(self, segment: Segment) -> None:
        self.store._give_back(segment)

    def open(self, step: int, *, key: Optional[bytes] = None):
        from .views import MemoryVersion, ShardCopy  # torch: only a reader needs it

        v = self.store._get(step)
        array = v.segment.array

        def fetch(offset: int, length: int, array=array):
            return array[offset : offset + length]

        return MemoryVersion(step, {0: v.plan}, {0: v.record}, {0: [ShardCopy("local", fetch, "this process")]})

    def discard(self, step: int) -> None:
        self.store._discard(self.epoch, step)

    @property
    def allocations(self) -> int:
        return self.store.allocations

    def held_bytes(self) -> int:
        return self.store.held_bytes()


_registry_lock = threading.Lock()
_registry: dict[str, LocalStore] = {}


def local_store(namespace: str) -> LocalStore:
    """The process-wide :class:`LocalStore` of ``namespace`` (created on first use)."""
    with _registry_lock:
        store = _registry.get(namespace)
        if store is None:
            store = _registry[namespace] = LocalStore(namespace)
        return store


def drop_local_store(namespace: str) -> None:
    """Forget the process-wide store of ``namespace`` and what it holds, as a restart of the
    process does (for tests and tools that restart a job inside one process). A Checkpointer
    still attached keeps the store it has; the next one gets an empty store."""
    with _registry_lock:
        _registry.pop(namespace, None)
