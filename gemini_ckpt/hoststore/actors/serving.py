"""The host store serving what it holds: the index and shard records readers survey, bytes
pushed to a restoring reader, data files written to the durable tier, versions let go.

One of the host store's collaborators (:mod:`.host_store`); the state they share is :class:`.state.StoreState`.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from typing import Any

from ...format.framing import write_tensors
from ...timeouts import TIMEOUTS
from ...commit import VersionId, VersionState
from ...dataplane import ChecksumMismatchError, Endpoint, Header, TransferRejectedError, TransportError
from .sink import verify_copies
from .state import StoreState

log = logging.getLogger("gemini_ckpt")


class ShardServer:
    """Reads, persists and releases (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        self.s = state
        self.readers: dict[tuple, Any] = {}  # (host, port) of a restoring reader -> channel (the store's lock)
        self._connecting: dict[tuple, threading.Lock] = {}  # reader -> its one connect, however many pushes want it
        self._pushing: dict[tuple, int] = {}  # reader -> pushes using its channel now
        self._last_push: dict[tuple, float] = {}  # reader -> when a push to it last ended (monotonic)

    # --- reading ------------------------------------------------------------------------------------
    def index(self) -> dict[int, dict]:
        """Per step: epoch, state (``committed``, ``prepared``, ``pending``, ``aborted``; copies
        of a version this store takes no part in stay ``pending``), world size, and the shards
        held here (owner slot, complete, plan id, bytes)."""
        with self.s.lock:
            out = self.s.table.index()
            if self.s.commit is not None:
                for step, entry in out.items():
                    if entry["epoch"] == self.s.epoch and entry["state"] == VersionState.PENDING:
                        prepared = self.s.commit.state(VersionId(self.s.epoch, step)) == VersionState.PREPARED
                        entry["state"] = VersionState.PREPARED if prepared else VersionState.PENDING
            return out

    def survey(self) -> dict:
        """:meth:`index` and, read with it, :meth:`shard_info` of the shards held here of the
        newest step this store holds committed (``newest``; None: none): a restore opens the
        newest committed version, so its survey asks each store once instead of twice."""
        with self.s.lock:
            index = self.index()
            newest = max((step for step, e in index.items() if e["state"] == VersionState.COMMITTED), default=None)
            infos = {} if newest is None else self.shard_info(newest, sorted(index[newest]["shards"]))
            return {"index": index, "newest": newest, "infos": infos}

    def shard_info(self, step: int, ranks: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """``rank -> (encoded plan, encoded record)`` of the complete shards of ``step`` held here."""
        with self.s.lock:
            out = {}
            for rank in ranks:
                try:
                    shard = self.s.complete_shard(step, rank)
                    _, plan = self.s.table.plans[(shard.plan_id, rank)]
                except (LookupError, KeyError):
                    continue
                out[rank] = (plan, shard.record_bytes)
            return out

    def push_range(self, step: int, rank: int, offset: int, length: int, reader: Endpoint, tag: str) -> int:
        """Send bytes ``[offset, offset + length)`` of a shard's region to a reader's
        data-plane listener; returns once the reader has them (``length``), or 0 when it
        refused them."""
        return self.push_ranges(step, rank, [(offset, length, tag)], reader)

    def push_ranges(self, step: int, rank: int, ranges: list, reader: Endpoint) -> int:
        """Send several ranges ``[(offset, length, tag), ...]`` of a shard's region to a reader's
        data-plane listener, one transfer each, all in flight at once; returns once each has
        landed or been refused, with the bytes that landed (the direct restore: each range lands
        in its own live tensor).

        A reader refuses a range it no longer wants (its tag is no longer expected: a read-ahead
        block it skipped). That is the reader's answer for that range alone: the channel to it
        stays open, because the reader's other pushes share it, and the reader counts the bytes
        it was sent. A reader that drops the connection has given up on this store: the channel
        is closed at once, so nothing more of these ranges (or of any other push to that reader)
        is sent."""
        with self.s.lock:
            shard = self.s.complete_shard(step, rank)
            for offset, length, _ in ranges:
                if offset < 0 or length <= 0 or offset + length > shard.seg.nbytes:
                    raise ValueError(
                        f"range [{offset}, {offset + length}) is outside rank {rank}'s shard ({shard.seg.nbytes} bytes)"
                    )
            self.s.table.use(shard)
        channel = None
        key = (reader.host, reader.port)
        try:
            channel = self._reader_channel(reader)
            sent = [
                (
                    channel.send_async(
                        Header(
                            self.s.namespace, step, f"region/{rank}", offset, length, total=shard.seg.nbytes, put_id=tag
                        ),
                        shard.seg.array[offset : offset + length],
                    ),
                    length,
                )
                for offset, length, tag in ranges
            ]
            deadline = time.monotonic() + TIMEOUTS.serve_s
            landed = 0
            for fut, length in sent:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except TransferRejectedError as exc:
                    if isinstance(exc, ChecksumMismatchError):
                        raise
                    continue  # the reader no longer wants this range
                landed += length
            return landed
        except (TransportError, TimeoutError) as exc:
            with self.s.lock:
                if channel is not None and self.readers.get(key) is channel:
                    del self.readers[key]
                    self._pushing.pop(key, None)
                    self._last_push.pop(key, None)
            if channel is not None:
                channel.close()
            raise ConnectionError(f"node {self.s.node_id[:12]} could not send to the reader: {exc}") from None
        finally:
            with self.s.lock:
                self.s.table.done_with(shard)
                if channel is not None and self.readers.get(key) is channel:  # else closed: nothing to count
                    self._pushing[key] -= 1
                    self._last_push[key] = time.monotonic()

    def forget_readers(self) -> None:
        """The data plane started again: the channels to readers went with the old one."""
        with self.s.lock:
            self.readers, self._connecting, self._pushing, self._last_push = {}, {}, {}, {}

    def close_idle_readers(self, idle_s: float) -> int:
        """Close the channels to readers that no push has used for ``idle_s``: a reader reads for
        a restore and goes away (its listener closes with its Checkpointer), and nothing else would
        close the store's end. A later read connects again. Returns how many were closed."""
        now = time.monotonic()
        with self.s.lock:
            idle = [
                key
                for key in self.readers
                if not self._pushing.get(key) and now - self._last_push.get(key, now) >= idle_s
            ]
            channels = [self.readers.pop(key) for key in idle]
            for key in idle:
                self._pushing.pop(key, None)
                self._last_push.pop(key, None)
        for channel in channels:
            channel.close()
        return len(channels)

    def _reader_channel(self, reader: Endpoint):
        """The one channel to a reader's listener, shared by every push to it (the pushes of one
        read run at once, on the actor's threads: the first connects, the others to that reader
        wait for it; pushes to other readers do not)."""
        key = (reader.host, reader.port)
        with self.s.lock:
            channel = self.readers.get(key)
            if channel is not None:
                self._pushing[key] = self._pushing.get(key, 0) + 1  # not closed as idle while it pushes
                return channel
            connecting = self._connecting.setdefault(key, threading.Lock())
        with connecting:
            with self.s.lock:
                channel = self.readers.get(key)
                if channel is not None:
                    self._pushing[key] = self._pushing.get(key, 0) + 1
                    return channel
            channel = self.s.transport.connect(reader, marked=False)  # a restore waits on it: never lower-effort
            with self.s.lock:
                self.readers[key] = channel
                self._pushing[key] = self._pushing.get(key, 0) + 1
            return channel

    # --- the durable tier ----------------------------------------------------------------------------
    def persist_shard(
        self, step: int, rank: int, uri: str, directory: str, name: str, section: bytes, opener=None
    ) -> list:
        """Write rank ``rank``'s data file of ``step`` to ``uri``/``directory``/``name`` in DCP's
        ``FileSystemWriter`` layout: ``section`` (its non-tensor items, ``torch.save``-d by the
        persister), then every tensor item framed as ``torch.save`` frames it. The copy is
        checked against its record first; ``uri`` is opened with ``opener`` when the trainer sent one
        (its backend, :mod:`gemini_ckpt.durable.backends`). Returns ``[offset, length, crc32c]`` per
        tensor item."""
        from ...durable.files import files_for
        from ...durable.backends import open_uri

        with self.s.lock:
            shard = self.s.complete_shard(step, rank)
            plan = self.s.table.plan(shard.plan_id, rank)
            self.s.table.use(shard)
        try:
            problem = verify_copies(self.s, [shard])
            if problem:
                raise ValueError(f"node {self.s.node_id[:12]}: {problem}; not persisted from this copy")
            fs, root = open_uri(uri, opener)
            target = posixpath.join(root, directory)
            fs.create_dir(target, recursive=True)
            # Created exclusively and never through a link planted in the version's directory
            # (durable/files.py): a writer of the durable root cannot aim this write elsewhere.
            with files_for(fs, root).create(posixpath.join(directory, name)) as out:
                out.write(section)
                placed = write_tensors(
                    out,
                    shard.seg.array,
                    [(t.at, t.nbytes, plan.templates[t.template]) for t in plan.tensors],
                    start=len(section),
                )
            return [[p.offset, p.length, p.crc] for p in placed]
        finally:
            with self.s.lock:
                self.s.table.done_with(shard)

    def unpin(self, step: int) -> None:
        with self.s.lock:
            self.s.table.unpin(step)

    def discard(self, step: int, epoch: int) -> int:
        """Forget the version of ``step`` if it is of an epoch before ``epoch``; bytes freed."""
        with self.s.lock:
            v = self.s.table.versions.get(step)
            if v is None or v.epoch >= epoch:
                return 0
            return self.s.table.release(v, force=True)
