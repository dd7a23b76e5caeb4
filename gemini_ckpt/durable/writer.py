"""Persisting committed versions to the durable tier, on a thread of its own.

Rank 0 coordinates each persist (the other ranks only learn its outcome):

1. ``durable.begin(step)``: the version's directory gets its in-progress marker;
2. the non-tensor items of every rank are ``torch.save``-d here (they are small, and the host
   stores have no torch) into each rank's *value section*;
3. each rank's data file is written in DCP's ``FileSystemWriter`` layout, the value section
   first: by the host stores from their memory when the memory tier persists by itself
   (each host writes its own ranks' files, in parallel), else here from the tier's copy;
4. ``durable.commit(step, manifest)``: ``.metadata`` (the plan's metadata skeleton with every
   item's place in the files), the completion marker (CRC32C of every item, signed with a
   key), ``latest``, then durable retention.

A failure anywhere leaves the previous durable version as it was: the partial directory is
removed, ``handle.persisted`` raises, the failure is counted and logged (and with
``persist_errors="raise"`` raised on the training thread), and the next due version tries
again. The other ranks wait until the tier lists the step, or until rank 0 publishes the
failure in ``torch.distributed``'s rendezvous store (so they never wait for a timeout).
The memory tier keeps a version handed off with ``persist=True`` until :meth:`Persister.run`
is done with it (``unpin``).
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

from ..checksum import checksum
from ..errors import BackgroundError, CheckpointError, CheckpointTimeoutError
from ..faults import fire
from ..results import CheckpointStats, SaveHandle
from ..format.framing import FileItem, value_section, write_tensors
from ..save.plan import DCP_VERSION
from ..save.templates import torch_save_bytes
from ..state.torch_private import default_store
from ..stores.base import MemoryTier
from .tier import DurableTier
from .layout import data_file_name
from ..format.manifest import ItemChecksum, VersionManifest
from ..trust.manifest import sign
from ..trust.metadata import metadata_loads
from ..trust.values import value_loads

log = logging.getLogger("gemini_ckpt")


@dataclass
class _Job:
    handle: SaveHandle
    pinned: bool


class Persister:
    """Persists the versions it is given, one at a time (see the module docstring)."""

    def __init__(
        self,
        durable: DurableTier,
        tier: MemoryTier,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        key: Optional[bytes],
        run_id: str,
        job: dict,
        stats: CheckpointStats,
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Versions go to ``durable``, whose retention runs after each commit. ``stats``: the
        Checkpointer's counters (``persisted``, ``persist_failed``, ...), updated here;
        ``on_error``: called with each failure (on the persist thread). ``key``: the signing key,
        resolved once with the rest of the settings (``DurableSettings.key``)."""
        self.durable, self.tier = durable, tier
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.key = key
        self.run_id, self.job = run_id, job
        self.stats = stats
        self._on_error = on_error
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._queued: set[int] = set()
        self._thread: Optional[threading.Thread] = None
        # set by an abort: a rank other than 0 stops waiting for rank 0's outcome (rank 0 may be
        # the process whose loss ended the attempt: its outcome would never come)
        self._abandoned = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gemini-ckpt-persist", daemon=True)
            self._thread.start()

    def stop(self, timeout: float, *, abandon: bool = False) -> None:
        """Persist what is queued, then end the thread (joined up to ``timeout``). ``abandon``
        (an abort): ranks other than 0 stop waiting for rank 0's outcomes at once; rank 0 still
        finishes (or fails) the version it is writing, so nothing half-written is left behind."""
        if abandon:
            self._abandoned.set()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=timeout)
            self._thread = None

    def queue(self, handle: SaveHandle, *, pinned: bool) -> None:
        with self._lock:
            self._queued.add(handle.step)
        self._jobs.put(_Job(handle, pinned))

    def queued(self, step: int) -> bool:
        with self._lock:
            return step in self._queued

    def persist_on_close(self, step: Optional[int]) -> None:
        """``close()``: queue ``step`` (the newest committed version) unless it is durable or
        queued already, so a run's last version is durable once the job ends."""
        if step is None or self.queued(step):
            return
        try:
            if step in self.durable.complete_steps():
                return
        except OSError as exc:
            log.warning("rank %d: cannot list the durable tier on close (%s); trying to persist anyway", self.rank, exc)
        log.info("rank %d: persisting step %d on close", self.rank, step)
        self.queue(SaveHandle(step), pinned=False)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queued:
                left = deadline - time.monotonic()
                if left <= 0 or not self._lock.wait(timeout=left):
                    raise CheckpointTimeoutError(f"persist did not finish within {timeout}s")

    # --- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step = job.handle.step
            try:
                location = self.persist(step)
                self.stats.persisted += 1
                self.stats.last_persisted_step = step
                job.handle.persisted.set_result(location)
            except _Abandoned as exc:  # an abort: nobody waits for the outcome any more
                log.info("rank %d: %s", self.rank, exc)
                job.handle.persisted.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive any failure
                err = BackgroundError(
                    f"rank {self.rank}: version {step} was not persisted to {self.durable.uri}: "
                    f"{type(exc).__name__}: {exc}; the memory tier is unaffected and the next "
                    f"persist retries"
                )
                err.__cause__ = exc
                self.stats.persist_failed += 1
                self.stats.last_persist_error = str(err)
                log.error("%s", err)
                job.handle.persisted.set_exception(err)
                self._on_error(err)
            finally:
                if job.pinned:
                    try:
                        self.tier.unpin(step)
                    except Exception as exc:  # noqa: BLE001 - retention catches up at the next commit
                        log.warning("rank %d: could not release step %d after persisting it: %s", self.rank, step, exc)
                with self._lock:
                    self._queued.discard(step)
                    self._lock.notify_all()

    def persist(self, step: int) -> str:
        """Write one committed version (rank 0 writes; the others wait for its outcome)."""
        if self.rank != 0:
            return self._await(step)
        try:
            return self._write(step)
        except BaseException as exc:
            self._publish(step, f"{type(exc).__name__}: {exc}")
            try:
                if self.durable.abandon(step):
                    log.info("rank 0: removed the partial directory of step %d", step)
            except Exception as cleanup:  # noqa: BLE001 - the next job's start removes it instead
                log.warning("rank 0: could not remove the partial directory of step %d: %s", step, cleanup)
            raise

    def _write(self, step: int) -> str:
        durable = self.durable
        self._publish(step, None)  # an earlier failure of this step is history
        fire("persist", step=step, rank=self.rank)
        durable.begin(step)
        view = self.tier.open(step)
        try:
            if view.health.unhealthy:  # the Checkpointer never asks; the last line of defence (persist() cleans up)
                raise CheckpointError(
                    f"step {step} is unhealthy ({view.health.reason}); an unhealthy version is "
                    f"never persisted over healthy ones"
                )
            return self._write_version(step, view)
        finally:
            view.close()

    def _write_version(self, step: int, view) -> str:
        durable = self.durable
        sections, value_items = {}, {}
        for rank, plan in sorted(view.plans.items()):
            record = view.records[rank]
            archives = [torch_save_bytes(_value(v.kind, blob, v.fqn)) for v, blob in zip(plan.values, record.values)]
            sections[rank], value_items[rank] = value_section(archives)
        if self.tier.capabilities.persists_itself and durable.uri_resolvable:
            placed = self.tier.persist_files(step, durable.uri, durable.directory(step), sections, durable.opener)
        else:
            placed = {rank: self._write_file(step, view, rank, sections[rank]) for rank in sorted(view.plans)}
        fire("persist_commit", step=step, rank=self.rank)
        manifest = self._manifest(step, view, value_items, placed, sections)
        location = durable.commit(step, manifest)
        try:
            durable.apply_retention()
        except OSError as exc:  # the version is durable; old ones go at the next commit instead
            log.error(
                "durable tier %s: step %d is committed, but removing older versions failed (%s: %s)",
                durable.uri,
                step,
                type(exc).__name__,
                exc,
            )
        return location

    def _write_file(self, step: int, view, rank: int, section: bytes) -> list[FileItem]:
        plan = view.plans[rank]
        region = _whole_region(view, rank, plan.region_bytes)
        with self.durable.open_output(step, data_file_name(rank)) as out:
            out.write(section)
            return write_tensors(
                out, region, [(t.at, t.nbytes, plan.templates[t.template]) for t in plan.tensors], start=len(section)
            )

    def _manifest(self, step: int, view, value_items: dict, placed: dict, sections: dict) -> VersionManifest:
        metadata = metadata_loads(view.plans[0].metadata)
        storage: dict[MetadataIndex, _StorageInfo] = {}
        checksums, sizes = [], {}
        for rank, plan in sorted(view.plans.items()):
            name = data_file_name(rank)
            tensors = [FileItem(*p) if not isinstance(p, FileItem) else p for p in placed[rank]]
            if len(tensors) != len(plan.tensors):
                raise CheckpointError(
                    f"step {step}: rank {rank}'s file holds {len(tensors)} tensor items, its plan {len(plan.tensors)}"
                )
            for v, item in zip(plan.values, value_items[rank]):
                storage[MetadataIndex(v.fqn, None, v.index)] = _StorageInfo(name, item.offset, item.length)
                checksums.append(ItemChecksum(name, item.offset, item.length, item.crc))
            for t, item in zip(plan.tensors, tensors):
                chunk = None if t.chunk is None else _size(t.chunk)
                storage[MetadataIndex(t.fqn, chunk, t.index)] = _StorageInfo(name, item.offset, item.length)
                checksums.append(ItemChecksum(name, item.offset, item.length, item.crc))
            end = len(sections[rank]) + sum(i.length for i in tensors)
            sizes[name] = end
        metadata.version = DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta(checkpoint_id=f"gemini-step-{step}", save_id=f"{view.epoch}-{step}")
        metadata_bytes = pickle.dumps(metadata)
        return sign(
            VersionManifest(
                step=step,
                world_size=view.world_size,
                metadata=metadata_bytes,
                checksums=tuple(sorted(checksums, key=lambda c: (c.file, c.offset))),
                file_sizes=sizes,
                # memory_fingerprint: which version of this step it is, so that a restore falls back
                # to this copy only for the memory version it was written from (never mixes two)
                job={
                    **self.job,
                    **view.plans[0].job,
                    "created_unix": time.time(),
                    "memory_fingerprint": view.fingerprint,
                },
                metadata_crc=checksum(metadata_bytes),
                health=view.health.to_json(),
            ),
            self.key,
        )

    # --- telling the other ranks ------------------------------------------------------------------
    def _key(self, step: int) -> str:
        return f"gemini_ckpt/{self.run_id}/persist_failed/{step}"

    def _publish(self, step: int, error: Optional[str]) -> None:
        """Rank 0 tells the other ranks (through torch.distributed's rendezvous store) that
        persisting ``step`` failed, so they stop waiting for it at once; ``None`` clears it."""
        store = rendezvous_store() if self.world_size > 1 else None
        if store is None:
            return
        try:
            if error is None:
                store.delete_key(self._key(step))
            else:
                store.set(self._key(step), error)
        except Exception as exc:  # noqa: BLE001 - the others then find out by their timeout
            log.warning("rank 0: could not publish the persist outcome of step %d: %s", step, exc)

    def _await(self, step: int) -> str:
        """Ranks other than 0: the version is durable when the tier lists it complete; rank 0
        publishes a failure in the rendezvous store (else the wait ends at ``timeout_s``)."""
        store, key = rendezvous_store(), self._key(step)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if step in self.durable.complete_steps():
                    return self.durable.location(step)
            except OSError as exc:
                log.debug("rank %d: cannot list the durable tier yet: %s", self.rank, exc)
            if store is not None and store.check([key]):
                raise CheckpointError(f"rank 0 could not persist step {step}: {store.get(key).decode()}")
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(f"step {step} did not become durable within {self.timeout_s}s")
            if self._abandoned.wait(0.2):
                raise _Abandoned(f"stopped waiting for step {step} to become durable: this Checkpointer was aborted")


class _Abandoned(CheckpointError):
    """A rank other than 0 stopped waiting for a persist's outcome (an abort)."""


def _value(kind: str, blob: bytes, fqn: str):
    """The value DCP would have saved for a non-tensor item (its blob was made by our trainer;
    it is still decoded through the value allow-list)."""
    return blob if kind == "bytes" else value_loads(blob, fqn)


def _size(chunk):
    import torch

    return torch.Size(chunk)


def _whole_region(view, rank: int, nbytes: int):
    """The region of ``rank``'s shard from the first copy whose items pass their checksums."""
    import numpy as np

    plan, record = view.plans[rank], view.records[rank]
    problems = []
    for copy in view.copies.get(rank, []):
        try:
            region = np.asarray(copy.fetch(0, nbytes)).reshape(-1).view(np.uint8) if nbytes else np.empty(0, np.uint8)
        except (LookupError, OSError, ValueError, CheckpointError) as exc:
            problems.append(f"{copy.source}: {exc}")
            continue
        bad = [t.fqn for t, crc in zip(plan.tensors, record.crcs) if checksum(region[t.at : t.at + t.nbytes]) != crc]
        if not bad:
            return region
        problems.append(f"{copy.source} {copy.label}: {len(bad)} item(s) fail their checksums, e.g. {bad[0]}")
    raise CheckpointError(f"no copy of rank {rank}'s shard is intact: " + "; ".join(problems))


def rendezvous_store():
    """The key-value store every rank of the default process group shares, if any."""
    return default_store()
