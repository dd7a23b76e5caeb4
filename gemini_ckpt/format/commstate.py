"""The comm state: a small shared-memory page in which a host's training processes say when they
are inside a collective, so that its host store replicates only while they are not
(docs/interleave.md).

The host store owns the segment (a memfd, like the data segments of :mod:`.segments`) and lends
it to each of its ranks over the attach socket, with the rank's slot. A rank writes only its own
slot (one writer per slot; several threads of that process serialize on a lock); the store only
reads, and clears the slot of a rank whose attach socket closed. No message per step: marking is
a few stores into mapped memory.

Layout (little-endian): a 64-byte header (``magic``, ``slots``), then ``slots`` slots of 64
bytes, each::

    depth     i64  collectives in flight now (DDP overlaps its buckets' all-reduces)
    entered   f64  CLOCK_MONOTONIC when depth last went from 0 to 1 (the same clock in every
                   process of the machine)
    count     u64  collectives completed
    mean_s    f64  running mean of their durations (exponentially weighted, seconds)
    busy_s    f64  total seconds with depth > 0
    changed   f64  CLOCK_MONOTONIC of the last change

Standard library only (the host store's process never imports torch).

Example::

    state = CommState.create(slots=8)              # the store
    marker = CommState.open(fd, nbytes).marker(3)  # a trainer, slot 3, fd from the attach socket
    with marker:
        dist.all_reduce(t)
    state.busy(stale_s=30.0)                       # False again
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time
from typing import Optional

from gemini_ckpt.format.segments import MEMFD_PREFIX, not_inherited

MAGIC = b"GEMCOMM1"
HEADER = struct.Struct("<8sI")
HEADER_BYTES = 64
SLOT = struct.Struct("<qdQddd")
SLOT_BYTES = 64
MAX_SLOTS = 256
MEAN_WEIGHT = 0.2  # the weight of the newest duration in the running mean
_DEPTH = struct.Struct("<q")
_ENTERED = struct.Struct("<d")


def segment_bytes(slots: int) -> int:
    return HEADER_BYTES + SLOT_BYTES * slots


class CommState:
    """The mapped comm-state page (see the module docstring): :meth:`create` in the store,
    :meth:`open` in a trainer."""

    def __init__(self, fd: int, nbytes: int, *, owner: bool) -> None:
        if nbytes < HEADER_BYTES or nbytes > segment_bytes(MAX_SLOTS):
            raise ValueError(
                f"a comm-state segment of {nbytes} bytes (expected {HEADER_BYTES} to {segment_bytes(MAX_SLOTS)})"
            )
        self.fd: Optional[int] = fd
        self.nbytes = nbytes
        self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        not_inherited(self._mm)
        if owner:
            HEADER.pack_into(self._mm, 0, MAGIC, (nbytes - HEADER_BYTES) // SLOT_BYTES)
        magic, slots = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or segment_bytes(slots) > nbytes:
            self.close()
            raise ValueError("not a comm-state segment (bad magic or slot count)")
        self.slots = slots
        self._assigned: dict[int, int] = {}  # store side: rank -> slot
        self._lock = threading.Lock()

    @classmethod
    def create(cls, slots: int = 64) -> "CommState":
        """A new, zeroed segment of ``slots`` slots (the host store's)."""
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {slots}")
        nbytes = segment_bytes(slots)
        fd = os.memfd_create(f"{MEMFD_PREFIX}comm", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, nbytes: int) -> "CommState":
        """Map a segment whose fd came over the attach socket (the fd is owned from here on)."""
        return cls(fd, nbytes, owner=False)

    # --- the store's side ----------------------------------------------------------------------
    def slot_for(self, rank: int) -> int:
        """The slot of ``rank`` (the same one again if it attaches again); LookupError when full."""
        with self._lock:
            slot = self._assigned.get(rank)
            if slot is None:
                free = sorted(set(range(self.slots)) - set(self._assigned.values()))
                if not free:
                    raise LookupError(f"the comm state has no free slot for rank {rank} ({self.slots} slots)")
                slot = self._assigned[rank] = free[0]
            return slot

    def clear(self, rank: int) -> None:
        """Forget whatever ``rank`` marked (its process detached or died, maybe mid-collective)
        and free its slot for the next rank that attaches; the measured durations stay (they
        are this host's collectives)."""
        with self._lock:
            slot = self._assigned.pop(rank, None)
        if slot is not None:
            _DEPTH.pack_into(self._mm, self._at(slot), 0)

    def read(self, slot: int) -> tuple:
        """``(depth, entered, count, mean_s, busy_s, changed)`` of one slot."""
        return SLOT.unpack_from(self._mm, self._at(slot))

    def busy(self, *, stale_s: float, now: Optional[float] = None) -> bool:
        """Whether any rank is inside a collective now. A mark older than ``stale_s`` is
        ignored: a process stopped (or hung) inside a collective must not hold replication back."""
        return self.busy_since(stale_s=stale_s, now=now) is not None

    def busy_since(self, *, stale_s: float, now: Optional[float] = None) -> Optional[float]:
        """When the collectives in flight now began (the latest start over the ranks inside one;
        a mark older than ``stale_s`` ignored); None when none is."""
        now = time.monotonic() if now is None else now
        latest = None
        for slot in range(self.slots):
            at = self._at(slot)
            if _DEPTH.unpack_from(self._mm, at)[0] > 0:
                entered = _ENTERED.unpack_from(self._mm, at + 8)[0]
                # A mark from the future (a writer with a bad clock, or a hostile one) is stale
                # too; 1 s of slack covers a mark made between reading ``now`` and this slot.
                if -1.0 <= now - entered < stale_s and (latest is None or entered > latest):
                    latest = entered
        return latest

    def collective_s(self) -> Optional[float]:
        """The shortest running mean of collective durations over the ranks that measured one
        (the collective a chunk in flight would delay most, relatively); None before any."""
        means = [row[3] for row in (self.read(s) for s in range(self.slots)) if row[2] > 0]
        return min(means) if means else None

    def active(self) -> bool:
        """Whether any rank ever marked a collective here (else replication does not wait at all)."""
        return any(row[2] > 0 or row[0] > 0 for row in (self.read(s) for s in range(self.slots)))

    def stats(self) -> dict:
        rows = [self.read(s) for s in range(self.slots)]
        return {
            "collectives": sum(r[2] for r in rows),
            "busy_s": round(sum(r[4] for r in rows), 6),
            "collective_s": self.collective_s(),
            "marked_now": sum(1 for r in rows if r[0] > 0),
        }

    # --- the trainer's side --------------------------------------------------------------------
    def marker(self, slot: int) -> "Marker":
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in this comm state's {self.slots}")
        return Marker(self, self._at(slot))

    def _at(self, slot: int) -> int:
        return HEADER_BYTES + SLOT_BYTES * slot

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


@contextlib.contextmanager
def _unmapped_ok():
    # a collective that completes after the checkpointer closed (the page unmapped): nobody reads it
    try:
        yield
    except ValueError:
        pass


class Marker:
    """One rank's slot: :meth:`enter` when a collective starts, :meth:`exit` when it completes
    (from any thread; nested and overlapping collectives count). A context manager too."""

    def __init__(self, state: CommState, at: int) -> None:
        self._state, self._at = state, at
        self._lock = threading.Lock()
        self._started: list[float] = []  # start times of the collectives in flight

    def enter(self) -> None:
        now = time.monotonic()
        with self._lock, _unmapped_ok():
            depth, entered, count, mean_s, busy_s, _ = SLOT.unpack_from(self._state._mm, self._at)
            if depth <= 0:
                depth, entered = 0, now
            self._started.append(now)
            SLOT.pack_into(self._state._mm, self._at, depth + 1, entered, count, mean_s, busy_s, now)

    def exit(self) -> None:
        now = time.monotonic()
        with self._lock, _unmapped_ok():
            depth, entered, count, mean_s, busy_s, _ = SLOT.unpack_from(self._state._mm, self._at)
            took = now - self._started.pop(0) if self._started else 0.0
            mean_s = took if count == 0 else (1 - MEAN_WEIGHT) * mean_s + MEAN_WEIGHT * took
            depth = max(0, depth - 1)
            if depth == 0:
                busy_s += now - entered
            SLOT.pack_into(self._state._mm, self._at, depth, entered, count + 1, mean_s, busy_s, now)

    def __enter__(self) -> "Marker":
        self.enter()
        return self

    def __exit__(self, *exc) -> None:
        self.exit()
