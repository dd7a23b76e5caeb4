"""Reading a shard out of the host stores, for restore and persist: this node's copy mapped
(no transfer), or a peer's pushed over the data plane into buffers here, in blocks of
``READ_BLOCK_BYTES`` requested ``READ_AHEAD_BLOCKS`` ahead of the reader (the reader takes a
shard's items in offset order, so transfers overlap its checksums and copies).

:class:`LocalCopy` and :class:`PeerCopy` are the ``fetch`` of a
:class:`~gemini_ckpt.stores.views.ShardCopy`; :class:`ReadSink` is where the transport lands pushed
ranges. A :class:`LocalCopy` talks to this node's store through the reader's attach channel; a
:class:`PeerCopy` gets what it needs of the reader (:class:`~gemini_ckpt.hoststore.reads.TierReads`) as
one :class:`PeerReads`.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..format.kept import KEPT
from ..format.segments import Segment
from ..errors import AttachError
from .attach import close_all
from .attach_messages import MapShard, ShardMapped, Unmap
from ..dataplane import Endpoint, Header

READ_BLOCK_BYTES = 16 << 20
READ_AHEAD_BLOCKS = 4


@dataclass(frozen=True)
class PeerReads:
    """What reading from peers needs of the reader: where pushed ranges land (``sink``), this
    reader's endpoint (``endpoint()``; its listener starts on first use), how to give up on
    pushes (``cancel(tags)``: once it returns, nothing writes into their buffers any more), what
    to do when a holder dies (``lost(slot, why)``), how to name a holder in errors
    (``describe(slot)``), and how long to wait for one (``timeout_s``)."""

    sink: "ReadSink"
    endpoint: Callable[[], Endpoint]
    cancel: Callable[[tuple], None]
    lost: Callable[[int, str], None]
    describe: Callable[[int], str]
    timeout_s: float


class LocalCopy:
    """A shard held by this node's store, mapped read-only through the attach channel
    (``attach``: the reader's :class:`~gemini_ckpt.hoststore.attach_client.AttachClient`).

    Mapping a shard sets up a page-table entry per page (populated at once: a fault per page on
    first touch costs more) and unmapping tears them down, together about as long as copying
    the shard. So the shard a restore will read is mapped ahead (:meth:`prepare`, while the
    ranks plan and agree), and let go of behind (:meth:`release` returns at once); both release
    the GIL."""

    def __init__(self, attach, step: int, rank: int) -> None:
        self.attach, self.step, self.rank = attach, step, rank
        self.seg: Optional[Segment] = None
        self._lock = threading.Lock()
        self._mapping: Optional[Future] = None

    def prepare(self) -> None:
        """Map the shard on a thread of its own; :meth:`fetch` waits for it."""
        with self._lock:
            if self._mapping is not None:
                return
            self._mapping = Future()
        threading.Thread(target=self._map_into, args=(self._mapping,), name="gemini-ckpt-map", daemon=True).start()

    def _map_into(self, done: Future) -> None:
        try:
            done.set_result(self._map_now())
        except BaseException as exc:  # noqa: BLE001 - raised by the fetch that waits for it
            done.set_exception(exc)

    def _map_now(self) -> Segment:
        try:
            reply, fds = self.attach.request(MapShard(self.step, self.rank).to_wire())
        except (LookupError, AttachError) as exc:
            raise LookupError(f"this node's store has no copy of rank {self.rank}'s shard: {exc}") from None
        try:
            mapped = ShardMapped.from_wire(reply)
            if not fds:
                raise ValueError("no memory came with it")
        except ValueError as exc:
            close_all(fds)
            raise LookupError(f"this node's store mapped rank {self.rank}'s shard unreadably: {exc}") from None
        close_all(fds[1:])
        return KEPT.map(fds[0], mapped.nbytes, mapped.seg, writable=False, populate=True)

    def _map(self) -> Segment:
        if self.seg is None:
            self.prepare()
            self.seg = self._mapping.result(timeout=self.attach.timeout_s)
        return self.seg

    def fetch(self, offset: int, length: int):
        self._map()
        if offset < 0 or offset + length > self.seg.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside rank {self.rank}'s shard")
        return self.seg.array[offset : offset + length]

    def release(self) -> None:
        """Let go of the mapping (and the store's pin on the shard) on a thread of its own."""
        with self._lock:
            mapping, self._mapping, self.seg = self._mapping, None, None
        if mapping is not None:
            threading.Thread(target=self._unmap, args=(mapping,), name="gemini-ckpt-unmap", daemon=True).start()

    def _unmap(self, mapping: Future) -> None:
        try:
            seg = mapping.result(timeout=self.attach.timeout_s)
        except BaseException:  # noqa: BLE001 - never mapped: nothing to let go of
            return
        try:
            self.attach.request(Unmap(seg.id).to_wire())
        except (AttachError, OSError, LookupError, TimeoutError):
            pass
        KEPT.keep(seg)  # a survivor's next restore reads the same memory


class PeerCopy:
    """A shard held by a peer: ranges pushed into buffers here, in blocks read ahead."""

    def __init__(
        self,
        reads: PeerReads,
        slot: int,
        handle,
        step: int,
        rank: int,
        size: int,
        *,
        block_bytes: int = READ_BLOCK_BYTES,
    ) -> None:
        self.reads, self.slot, self.handle = reads, slot, handle
        self.step, self.rank, self.size, self.block = step, rank, size, block_bytes
        self.blocks: dict[int, Any] = {}

    def fetch(self, offset: int, length: int):
        if self.handle is None:
            raise LookupError(f"the host store of slot {self.slot} is gone")
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside rank {self.rank}'s shard")
        if length == 0:
            return np.empty(0, np.uint8)
        size = self.block
        if length >= size:
            return self._resolve(self._push(offset, length))
        first, last = offset // size, (offset + length - 1) // size
        for i in [i for i in self.blocks if i < first]:
            del self.blocks[i]
        n_blocks = -(-self.size // size)
        for i in range(first, min(last + 1 + READ_AHEAD_BLOCKS, n_blocks)):
            if i not in self.blocks:
                self.blocks[i] = self._push(i * size, min(size, self.size - i * size))
        parts = []
        for i in range(first, last + 1):
            block = self.blocks[i]
            if isinstance(block, _Pending):
                block = self.blocks[i] = self._resolve(block)
            lo = max(offset - i * size, 0)
            hi = min(offset + length - i * size, size)
            parts.append(block[lo:hi])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def receive_into(self, ranges: list) -> "_Received":
        """Have the peer push ranges ``[(offset, into), ...]`` of the shard straight into the
        reader's memory (``into``: a live tensor's bytes), one Ray call for all of them;
        ``result()`` waits until every one landed, ``cancel()`` gives up on them. After either
        returns or raises, nothing writes into ``into`` any more."""
        if self.handle is None:
            raise LookupError(f"the host store of slot {self.slot} is gone")
        for offset, into in ranges:
            if offset < 0 or offset + into.nbytes > self.size:
                raise ValueError(f"range [{offset}, {offset + into.nbytes}) is outside rank {self.rank}'s shard")
        endpoint = self.reads.endpoint()
        tags = []
        for _, into in ranges:
            tag = uuid.uuid4().hex
            self.reads.sink.expect(tag, into)
            tags.append(tag)
        try:
            ref = self.handle.push_ranges.remote(
                self.step, self.rank, [(o, into.nbytes, t) for (o, into), t in zip(ranges, tags)], endpoint
            )
        except BaseException:
            for tag in tags:
                self.reads.sink.forget(tag)
            raise
        return _Received(
            self, _Pending(ref, None, tuple(tags), sum(into.nbytes for _, into in ranges)), [into for _, into in ranges]
        )

    def _push(self, offset: int, length: int) -> "_Pending":
        endpoint = self.reads.endpoint()
        tag, into = uuid.uuid4().hex, np.empty(length, dtype=np.uint8)
        self.reads.sink.expect(tag, into)
        return _Pending(
            self.handle.push_range.remote(self.step, self.rank, offset, length, endpoint, tag), into, (tag,), length
        )

    def _resolve(self, pending: "_Pending") -> np.ndarray:
        """Wait for a push; on any failure it is cancelled first (see :meth:`_cancel`), so when
        this returns or raises, nothing writes into its buffers any more."""
        try:
            landed = ray.get(pending.ref, timeout=self.reads.timeout_s)
        except RayActorError:
            self.reads.lost(self.slot, "died")
            error = LookupError(f"the host store of slot {self.slot} died while sending")
        except RayTaskError as exc:
            error = LookupError(f"{self.reads.describe(self.slot)}: {getattr(exc, 'cause', exc)}")
        except GetTimeoutError:
            error = LookupError(
                f"{self.reads.describe(self.slot)} did not send in time "
                f"({self.reads.timeout_s:g}s, CheckpointConfig.timeout_s)"
            )
        except BaseException:
            self._cancel(pending)
            raise
        else:
            if landed == pending.nbytes:
                for tag in pending.tags:  # the store returned: every range landed, nothing writes any more
                    self.reads.sink.forget(tag)
                return pending.into
            # Refused here (a tag no longer expected): never read a buffer that was not filled.
            error = LookupError(
                f"{self.reads.describe(self.slot)} sent {landed} of the {pending.nbytes} bytes "
                f"asked for (this reader refused the rest)"
            )
        self._cancel(pending)
        raise error

    def _cancel(self, pending: "_Pending") -> None:
        """Give up on a push: the reader's data plane refuses its ranges from now on and stops
        those already arriving (their sender's connection is dropped, so the store stops
        sending); returns once no stream writes into their buffers, which may be live tensors."""
        self.reads.cancel(pending.tags)


@dataclass(frozen=True)
class _Pending:
    ref: Any
    into: Optional[np.ndarray]
    tags: tuple
    nbytes: int  # what the store sends when every range lands


@dataclass(frozen=True)
class _Received:
    copy: PeerCopy
    pending: _Pending
    buffers: list  # kept alive (the sink holds them weakly) until the ranges landed

    def result(self) -> None:
        """Wait until every range landed (or raise ``LookupError``); either way, nothing
        writes into the buffers once this returns or raises."""
        self.copy._resolve(self.pending)

    def cancel(self) -> None:
        """Give up on the ranges not landed yet; once this returns nothing writes into the
        buffers (a range may have landed whole, or in part: the caller reads them elsewhere)."""
        self.copy._cancel(self.pending)


class ReadSink:
    """Where peers push the ranges a reader asked for (one buffer per request tag)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: "weakref.WeakValueDictionary[str, np.ndarray]" = weakref.WeakValueDictionary()

    def expect(self, tag: str, into: np.ndarray) -> None:
        with self._lock:
            self._expected[tag] = into

    def forget(self, tag: str) -> None:
        with self._lock:
            self._expected.pop(tag, None)

    def buffer_for(self, header: Header) -> memoryview:
        with self._lock:
            into = self._expected.get(header.put_id)
        if into is None or into.nbytes != header.length:
            raise ValueError(f"no read of {header.length} bytes of {header.name} is expected under this tag")
        return memoryview(into)

    def received(self, header: Header) -> None:
        pass  # the push call's return says so

    def failed(self, header: Header, error: BaseException) -> None:
        pass  # the push call raises
