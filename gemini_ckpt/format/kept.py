"""Mappings of a host store's segments kept in a training process for the next reader.

Mapping a segment costs a page-table entry per page, and unmapping it tears them down: together
a large part of a copy of its bytes (docs/recovery.md). A process that
goes on after a failure (a survivor of an in-place recovery) restores the version it staged
itself, or one it read a moment ago, from segments it had mapped. So a :class:`Segment` that a
reader lets go of is kept here, and the next request for the same memory gets it back instead
of mapping it again.

The memory is named by its file (the memfd's device and inode, which stay the same while any
mapping holds the file open), never by the store's segment id alone: a store that is replaced
numbers its segments anew. What is kept is only a mapping: the store lends the memory for each
read as before (and is told when the read is over), so a kept mapping of a segment the store has
since reused shows the new bytes, which every reader checks against the record it reads.

A kept mapping holds its memory until it expires (:data:`KEEP_S` after it was let go of), or
more than :data:`MAX_KEPT` are kept: that long, a segment the store freed still occupies memory
outside its budget. No torch: host-store clients use it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from .segments import Segment

KEEP_S = 30.0
"""Seconds a mapping is kept after its last reader let go: a recovery's new Checkpointer restores
within seconds of the old one's end."""
MAX_KEPT = 8
"""Mappings kept at most (the oldest go first)."""


class KeptMappings:
    """Segments mapped in this process, by the memory they map; thread-safe."""

    def __init__(self, *, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT) -> None:
        self.keep_s, self.max_kept = keep_s, max_kept
        self._lock = threading.Lock()
        self._kept: dict[tuple, tuple[Segment, float]] = {}  # file -> (segment, when it expires)
        self._timer: Optional[threading.Timer] = None
        self.reused = 0  # mappings handed out again instead of made (tests, status)

    def map(self, fd: int, nbytes: int, seg_id: int, *, writable: bool = True, populate: bool = False) -> Segment:
        """A mapping of ``nbytes`` of the memfd ``fd`` (which this call owns from now on): a kept
        one of the same file when there is one (``fd`` is then closed), else a new one."""
        try:
            st = os.fstat(fd)
            name = (st.st_dev, st.st_ino)
        except OSError:
            name = None
        if name is not None:
            with self._lock:
                kept = self._kept.get(name)
                if kept is not None and kept[0].nbytes == nbytes and (kept[0].writable or not writable):
                    del self._kept[name]
                    self.reused += 1
                    seg = kept[0]
                else:
                    seg = None
            if seg is not None:
                os.close(fd)
                seg.id = seg_id
                return seg
        seg = Segment(nbytes, fd=fd, seg_id=seg_id, writable=writable, populate=populate)
        # The mapping holds the memory; an open fd would hold it too in a forked child (a
        # DataLoader worker) for as long as that lives, and fds can't be kept from a fork.
        os.close(fd)
        seg.fd = None
        seg.name = name
        return seg

    def keep(self, seg: Segment) -> None:
        """Let go of ``seg``: kept for the next :meth:`map` of its memory, or closed."""
        name = getattr(seg, "name", None)
        if name is None:
            seg.close()
            return
        gone: list[Segment] = []
        with self._lock:
            old = self._kept.pop(name, None)
            if old is not None and old[0] is not seg:
                gone.append(old[0])
            self._kept[name] = (seg, time.monotonic() + self.keep_s)
            while len(self._kept) > self.max_kept:
                gone.append(self._kept.pop(next(iter(self._kept)))[0])
            self._arm()
        for s in gone:
            s.close()

    def drop(self, seg: Segment) -> None:
        """Let go of ``seg`` for good (its store freed it)."""
        name = getattr(seg, "name", None)
        with self._lock:
            if name is not None and self._kept.get(name, (None,))[0] is seg:
                del self._kept[name]
        seg.close()

    def clear(self) -> None:
        with self._lock:
            gone = [s for s, _ in self._kept.values()]
            self._kept.clear()
        for s in gone:
            s.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def _arm(self) -> None:
        if self._timer is not None or not self._kept:
            return
        due = min(t for _, t in self._kept.values())
        self._timer = threading.Timer(max(due - time.monotonic(), 0.0) + 0.01, self._expire)
        self._timer.daemon = True
        self._timer.name = "gemini-ckpt-kept-maps"
        self._timer.start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._timer = None
            gone = [name for name, (_, t) in self._kept.items() if t <= now]
            segs = [self._kept.pop(name)[0] for name in gone]
            self._arm()
        for s in segs:
            s.close()


KEPT = KeptMappings()
"""This process's kept mappings."""
