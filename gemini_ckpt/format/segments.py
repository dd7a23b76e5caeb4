"""The memory shards live in: a :class:`Segment` (a memfd mapped here and, by a local trainer,
there too; or anonymous memory) and the :class:`SegmentPool` a store reuses them from, within
its byte budget. No torch: host-store actors use it (beside the format, as the memory it describes)."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Optional

import numpy as np

_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def _next_id() -> int:
    with _ids_lock:
        return next(_ids)


MEMFD_PREFIX = "gemini-ckpt-"
_files_mapped = False  # a segment of a memfd was made here: a forked child closes what it inherits


def not_inherited(mm: mmap.mmap) -> None:
    """A process forked from this one (a DataLoader worker, alive for an epoch or more) does not
    get the mapping, so it holds none of a store's memory after this process lets go of it; it
    never reads there."""
    try:
        mm.madvise(mmap.MADV_DONTFORK)
    except (AttributeError, OSError):
        pass  # not Linux: a forked child keeps the mapping as before


def _close_inherited_memfds() -> None:
    """In a forked child: close the fds of store memory it inherited (each mapping of a memfd
    holds one: Python's mmap keeps a duplicate of its fd), which would hold the memory as a
    mapping does. The child's segment objects are never used (their mappings are not there)."""
    if not _files_mapped:
        return
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in fds:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{MEMFD_PREFIX}"):
                os.close(int(name))
        except (OSError, ValueError):
            pass  # the listing's own fd, gone by now


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_memfds)


class Segment:
    """``nbytes`` of memory a store owns and lends: a memfd mapped here (``shared=True``: a
    local training process maps the same pages through the fd, which the store passes over
    its attach socket), or anonymous memory. The memory lives while any process maps it, so a
    store that dies leaves nothing behind in ``/dev/shm``."""

    def __init__(
        self,
        nbytes: int,
        *,
        shared: bool = False,
        fd: Optional[int] = None,
        seg_id: Optional[int] = None,
        writable: bool = True,
        populate: bool = False,
    ) -> None:
        self.nbytes = int(nbytes)
        self.id = seg_id if seg_id is not None else _next_id()
        self.writable = writable
        self.name: Optional[tuple] = None  # the memory's file, when kept mappings track it (format.kept)
        length = max(self.nbytes, 1)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        if fd is not None:
            self.fd: Optional[int] = fd
            # populate: map every page now (one pass in the kernel) instead of a fault per page
            # on first touch, which costs more than the copy of the page (a restore reads it all)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(fd, length, flags, prot)
        elif shared and hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(f"{MEMFD_PREFIX}{self.id}", getattr(os, "MFD_CLOEXEC", 0))
            try:
                os.ftruncate(self.fd, length)
                self._mm = mmap.mmap(self.fd, length, mmap.MAP_SHARED, prot)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            self.fd = None
            self._mm = mmap.mmap(-1, length, mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20), prot)
        not_inherited(self._mm)
        if self.fd is not None:
            global _files_mapped
            _files_mapped = True
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)

    @property
    def closed(self) -> bool:
        return self._mm.closed

    def close(self) -> None:
        """Unmap (views of :attr:`array` must be gone) and close the fd; idempotent."""
        self.array = np.empty(0, np.uint8)
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a view still exists: the mapping goes when it does
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


class SegmentPool:
    """Segments reused from version to version within a byte budget.

    A fresh segment costs a page fault per page on first touch, slower than the copy itself,
    so released segments are kept and handed out again for a request of about their size.
    Kept segments count against the budget and are the first to go when a request needs the
    room. Not thread-safe: the owner holds its lock around calls."""

    def __init__(self, budget_bytes: int, *, shared: bool, max_free: int = 4) -> None:
        self.budget_bytes = int(budget_bytes)
        self.shared = shared
        self.max_free = max_free  # free segments kept; the oldest beyond go (a burst of copies let go)
        self.held = 0  # bytes of segments handed out and not released
        self.created = 0  # segments made (not reused) over the pool's life
        self._free: list[Segment] = []

    @property
    def pooled(self) -> int:
        return sum(s.nbytes for s in self._free)

    def fits(self, nbytes: int, replaced: int = 0) -> bool:
        return self.held - replaced + nbytes <= self.budget_bytes

    def reserve(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` (MemoryError over budget)."""
        if not self.fits(nbytes):
            raise MemoryError(
                f"{nbytes:,} bytes more would exceed the budget of {self.budget_bytes:,} bytes ({self.held:,} held)"
            )
        slack = max(1 << 20, nbytes // 8)
        fits = [
            s for s in self._free if nbytes <= s.nbytes <= nbytes + slack and self.held + s.nbytes <= self.budget_bytes
        ]
        if fits:
            seg = min(fits, key=lambda s: s.nbytes)
            self._free = [s for s in self._free if s is not seg]
        else:
            while self._free and self.held + self.pooled + nbytes > self.budget_bytes:
                self._free.pop(0).close()
            seg = Segment(nbytes, shared=self.shared)
            self.created += 1
        self.held += seg.nbytes
        return seg

    def release(self, seg: Segment) -> None:
        self.held -= seg.nbytes
        self._free.append(seg)
        while len(self._free) > self.max_free:  # every version needs one or two again, not a pile
            self._free.pop(0).close()

    def close(self) -> None:
        for seg in self._free:
            seg.close()
        self._free = []
