"""One session's streams on the receiving side of the TCP backend: the transfers in flight
(:class:`Incoming`), the session they share (:class:`Session`), and the frame loop of one
stream (:class:`Stream`) reading chunks straight into the sink's buffers, verifying each
transfer's checksum and acknowledging it. The listener (:mod:`._tcp_recv`) accepts the
connections and hands each to a stream.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

from . import _wire as wire
from ._base import Header, Sink
from ._errors import (
    ChecksumMismatchError,
    PeerLostError,
    ProgressTimeoutError,
    ProtocolError,
    TransportError,
)
from ._handshake import Parts
from ._tcp import shutdown


log = logging.getLogger("gemini_ckpt.transport")

_PROGRESS_EVERY_S = 0.05
_VERIFY_BLOCK = 16 << 20
_DRAIN_BLOCK = 1 << 20

_OPEN, _COMPLETING, _FAILED = 0, 1, 2


class Incoming:
    __slots__ = (
        "tid",
        "header",
        "header_bytes",
        "view",
        "chunk",
        "offsets",
        "got",
        "writers",
        "state",
        "error",
        "notified",
    )

    def __init__(self, tid: int, header: Header, header_bytes: bytes, view: memoryview, chunk: int) -> None:
        self.tid = tid
        self.header = header
        self.header_bytes = header_bytes
        self.view = view
        self.chunk = chunk
        self.offsets: set[int] = set()
        self.got = 0
        self.writers = 0
        self.state = _OPEN
        self.error: Optional[BaseException] = None
        self.notified = False


class Session:
    """One sending channel's streams and the transfers they carry."""

    def __init__(self, key: bytes, label: str, sink: Sink) -> None:
        self.key = key
        self.label = label
        self.sink = sink
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.transfers: dict[int, Incoming] = {}
        self.rejected: set[int] = set()
        self.error: Optional[TransportError] = None
        self.last_rx = time.monotonic()
        self.draining: set[Incoming] = set()  # failed, with a stream still inside one of its chunks
        self.quiet = threading.Condition(self.lock)  # notified when the last of those stops writing

    def fail(self, error: TransportError) -> None:
        notify = []
        with self.lock:
            if self.error is None:
                self.error = error
            for incoming in self.transfers.values():
                if incoming.state == _OPEN:
                    incoming.state = _FAILED
                    incoming.error = _for_transfer(error, incoming.header, incoming.got)
                    if incoming.writers == 0:
                        incoming.notified = True
                        notify.append(incoming)
                    else:
                        self.draining.add(incoming)
            self.transfers.clear()
            conns = list(self.conns)
        for conn in conns:
            shutdown(conn)
        for incoming in notify:
            _notify_failed(self.sink, incoming)

    def busy(self) -> bool:
        return bool(self.transfers)

    def holds(self, put_ids: set) -> bool:
        """Whether a transfer of this session that a stream may still write into carries one of
        ``put_ids`` (incomplete, or failed with a stream still inside one of its chunks: bytes
        already in the socket's buffer are read after it is shut down)."""
        with self.lock:
            return any(i.header.put_id in put_ids for i in (*self.transfers.values(), *self.draining))

    def wait_quiet(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) until no stream writes into a failed transfer's
        view; False if one still did then."""
        with self.quiet:
            while self.draining:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.quiet.wait(left)
        return True


def _for_transfer(error: TransportError, header: Header, got: int) -> TransportError:
    return type(error)(
        f"{header.describe()} arrived incomplete ({got:,} of {header.length:,} bytes in whole chunks): {error}",
        error.peer,
    )


def _notify_failed(sink: Sink, incoming: Incoming) -> None:
    try:
        sink.failed(incoming.header, incoming.error)
    except Exception:  # noqa: BLE001 - a sink's bug must not kill the stream thread
        log.exception("sink.failed raised for %s", incoming.header.describe())


class Stream:
    """One connection's receive loop (the hot path: ``recv_into`` the sink's view)."""

    def __init__(self, parts: Parts, session: Session, conn: socket.socket) -> None:
        self.session = session
        self.sink = session.sink
        self.conn = conn
        self.label = session.label
        self.namespace = parts.namespace
        self.timeout = parts.config.progress_timeout_s
        self.verify_fn = parts.config.verify_checksum
        self.rx_total = 0  # every byte read from this stream after the handshake
        self.reported = 0  # what the last PROGRESS frame told the sender
        self.last_progress_sent = time.monotonic()
        self.prefix = bytearray(wire.PREFIX.size)

    def run(self) -> None:
        prefix_view = memoryview(self.prefix)
        while True:
            if not self._recv_into(prefix_view, idle_ok=True):
                if self.session.busy():
                    raise PeerLostError(f"{self.label} closed the connection mid-transfer", self.label)
                return
            kind, head_len, payload_len = wire.PREFIX.unpack(self.prefix)
            if kind != wire.CHUNK or not wire.CHUNK_HEAD.size <= head_len <= wire.MAX_FRAME_HEADER:
                raise ProtocolError(
                    f"{self.label} sent a frame of type {kind} with a {head_len}-byte header", self.label
                )
            head = bytearray(head_len)
            self._recv_into(memoryview(head), idle_ok=False)
            tid, chunk_offset, chunk_size = wire.CHUNK_HEAD.unpack_from(head)
            incoming = self._begin(tid, bytes(head[wire.CHUNK_HEAD.size :]), chunk_offset, chunk_size, payload_len)
            if incoming is None:
                self._drain(payload_len)
                continue
            ok = False
            try:
                if payload_len:
                    self._recv_into(incoming.view[chunk_offset : chunk_offset + payload_len], idle_ok=False)
                ok = True
            finally:
                complete = self._end(incoming, ok, payload_len)
            if complete:
                self._complete(incoming)

    # --- transfers --------------------------------------------------------------------------
    def _begin(self, tid: int, header_bytes: bytes, offset: int, chunk: int, n: int) -> Optional[Incoming]:
        """Find or open the transfer this chunk belongs to; None: drain the payload (the
        transfer was refused). Raises ProtocolError on a chunk the transfer cannot hold."""
        session = self.session
        with session.lock:
            if session.error is not None:
                raise session.error
            if tid in session.rejected:
                return None
            incoming = session.transfers.get(tid)
            if incoming is None:
                incoming = self._open(tid, header_bytes, chunk)
                if incoming is None:
                    return None
                session.transfers[tid] = incoming
            elif header_bytes != incoming.header_bytes or chunk != incoming.chunk:
                raise ProtocolError(f"{self.label} changed the header of transfer {tid} mid-way", self.label)
            length = incoming.header.length
            if (
                offset % chunk
                or n != min(chunk, length - offset)
                or offset in incoming.offsets
                or (offset >= length and not (offset == 0 and length == 0))
            ):
                raise ProtocolError(
                    f"{self.label} sent chunk [{offset}, {offset + n}) (chunk size {chunk}) "
                    f"of {incoming.header.describe()}: out of range or repeated",
                    self.label,
                )
            incoming.offsets.add(offset)
            incoming.writers += 1
            return incoming

    def _open(self, tid: int, header_bytes: bytes, chunk: int) -> Optional[Incoming]:
        """Ask the sink for the transfer's buffer (session lock held). None: refused, and the
        sender told so."""
        try:
            header = wire.decode_header(header_bytes)
        except ValueError as exc:
            raise ProtocolError(f"{self.label} sent a bad header: {exc}", self.label) from None
        if chunk <= 0:
            raise ProtocolError(f"{self.label} sent a chunk size of {chunk}", self.label)
        try:
            if header.namespace != self.namespace:
                raise ValueError(f"this host store serves namespace {self.namespace!r}, not {header.namespace!r}")
            view = _writable_view(self.sink.buffer_for(header), header.length)
        except Exception as exc:  # noqa: BLE001 - whatever the sink raises goes back to the sender
            self.session.rejected.add(tid)
            self._send_done(tid, wire.DONE_REJECTED, f"{type(exc).__name__}: {exc}")
            return None
        return Incoming(tid, header, header_bytes, view, chunk)

    def _end(self, incoming: Incoming, ok: bool, n: int) -> bool:
        """Account a chunk; True when it completed the transfer (this thread finishes it)."""
        notify = False
        with self.session.lock:
            incoming.writers -= 1
            if ok and incoming.state == _OPEN:
                incoming.got += n
                if incoming.got == incoming.header.length:
                    incoming.state = _COMPLETING
                    self.session.transfers.pop(incoming.tid, None)
                    return True
            elif incoming.state == _FAILED and incoming.writers == 0 and not incoming.notified:
                incoming.notified = notify = True
                self.session.draining.discard(incoming)
                self.session.quiet.notify_all()
        if notify:
            _notify_failed(self.sink, incoming)
        return False

    def _complete(self, incoming: Incoming) -> None:
        header = incoming.header
        status, message = wire.DONE_OK, ""
        if self.verify_fn is not None and header.checksum is not None:
            actual = self._checksum(incoming.view)
            if actual != header.checksum:
                status = wire.DONE_CHECKSUM
                message = (
                    f"{header.describe()} failed verification: checksum {actual:#x}, the sender "
                    f"computed {header.checksum:#x} ({header.checksum_algo or 'unnamed algorithm'})"
                )
                incoming.error = ChecksumMismatchError(message, self.label)
                _notify_failed(self.sink, incoming)
        if status == wire.DONE_OK:
            try:
                self.sink.received(header)
            except Exception as exc:  # noqa: BLE001 - the sink refused it after all; tell the sender
                status, message = wire.DONE_REJECTED, f"{type(exc).__name__}: {exc}"
        self._send_done(incoming.tid, status, message)

    def _checksum(self, view: memoryview) -> int:
        value = 0
        for start in range(0, len(view), _VERIFY_BLOCK):
            value = self.verify_fn(view[start : start + _VERIFY_BLOCK], value)
            self._maybe_progress(time.monotonic())  # the sender waits on DONE meanwhile
        return value & 0xFFFFFFFFFFFFFFFF

    # --- the socket -------------------------------------------------------------------------
    def _recv_into(self, view: memoryview, idle_ok: bool) -> bool:
        """Fill ``view``. Returns False on a clean EOF before its first byte when ``idle_ok``
        (a frame boundary); raises on EOF elsewhere, and when the session stalls."""
        conn, session = self.conn, self.session
        n = len(view)
        pos = 0
        while pos < n:
            try:
                k = conn.recv_into(view[pos:], n - pos)
            except socket.timeout:
                self._check_stall(mid_frame=pos > 0 or not idle_ok)
                if self.reported != self.rx_total:  # gone quiet: report the last bytes now
                    self._maybe_progress(time.monotonic(), force=True)
                continue
            if not k:
                if idle_ok and pos == 0:
                    return False
                raise PeerLostError(f"{self.label} closed the connection mid-frame (it died or gave up)", self.label)
            pos += k
            if session.error is not None:  # failed (or given up on) meanwhile: write no more into the view
                raise session.error
            now = time.monotonic()
            session.last_rx = now
            self.rx_total += k
            if now - self.last_progress_sent >= _PROGRESS_EVERY_S:
                self._maybe_progress(now)
        return True

    def _check_stall(self, mid_frame: bool) -> None:
        session = self.session
        if session.error is not None:
            raise session.error
        if (mid_frame or session.busy()) and time.monotonic() - session.last_rx > self.timeout:
            raise ProgressTimeoutError(
                f"{self.label} sent nothing for {self.timeout:.1f}s in the middle of a "
                f"transfer (it stopped, hung or vanished)",
                self.label,
            )

    def _maybe_progress(self, now: float, force: bool = False) -> None:
        if force or now - self.last_progress_sent >= _PROGRESS_EVERY_S:
            self.last_progress_sent = now
            self.reported = self.rx_total
            self._send(wire.frame(wire.PROGRESS, wire.PROGRESS_HEAD.pack(self.rx_total)))

    def _send_done(self, tid: int, status: int, message: str) -> None:
        self._send(wire.frame(wire.DONE, wire.DONE_HEAD.pack(tid, status) + message.encode()[:4096]))

    def _send(self, data: bytes) -> None:
        try:
            self.conn.sendall(data)
        except socket.timeout:
            raise ProgressTimeoutError(f"{self.label} stopped reading our acknowledgements", self.label) from None

    def _drain(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _DRAIN_BLOCK)))
        while n > 0:
            k = min(n, len(scratch))
            self._recv_into(scratch[:k], idle_ok=False)
            n -= k


def _writable_view(buffer, length: int) -> memoryview:
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("Sink.buffer_for returned a read-only buffer")
    if not view.c_contiguous:
        raise ValueError("Sink.buffer_for returned a non-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes < length:
        raise ValueError(f"Sink.buffer_for returned {view.nbytes} bytes for a transfer of {length}")
    return view[:length]
