"""The sending side of the TCP backend: a channel of N authenticated streams to one peer.

``send_async`` splits a transfer into chunks on one queue; each stream has a sender thread
that takes the next chunk (so one transfer is spread over every stream, and the next transfer
starts as soon as a stream is free) and a reader thread for the peer's PROGRESS and DONE
frames. A transfer's future resolves on its DONE. Any stream failing fails the channel and
every pending transfer; the channel then stays failed.

Progress (when is the peer stalled?): the receiver reports, on each stream, how many bytes it
has read from that stream (every ~50 ms while bytes arrive, and once more when the stream goes
quiet). A stream with bytes written but not reported, or a transfer fully written whose DONE
has not come, that hears nothing from the peer for ``progress_timeout_s``, fails the channel.
Our own waits (the bandwidth cap, an empty queue, training's collectives: the interleaving gate,
:mod:`._interleave`) never count: only bytes the peer owes us.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import threading
import time
from concurrent.futures import Future
from typing import Optional

from . import _wire as wire
from ._base import Channel, Endpoint, Header
from ._errors import (
    ChannelClosedError,
    ChecksumMismatchError,
    PeerLostError,
    ProgressTimeoutError,
    ProtocolError,
    TransferRejectedError,
    TransportError,
)
from ._handshake import Parts
from ._tcp import TurnedAway, shutdown, tune

_RETRY_FIRST_S = 0.05  # a turned-away stream dials again after about this, doubling up to _RETRY_MAX_S
_RETRY_MAX_S = 0.4

_DONE_ERRORS = {
    wire.DONE_REJECTED: TransferRejectedError,
    wire.DONE_CHECKSUM: ChecksumMismatchError,
    wire.DONE_PROTOCOL: ProtocolError,
}


class _Outgoing:
    __slots__ = ("tid", "header", "header_bytes", "view", "future", "chunks_left", "written_at")

    def __init__(self, tid: int, header: Header, view: memoryview, chunks: int) -> None:
        self.tid = tid
        self.header = header
        self.header_bytes = wire.encode_header(header)
        self.view = view
        self.future: Future = Future()
        self.chunks_left = chunks
        self.written_at = 0.0  # when its last chunk was written (then only DONE is owed)


class _StreamState:
    """One connection's byte accounting: ``sent`` by its sender thread, ``acked`` (the peer's
    report of bytes read) by its reader thread."""

    __slots__ = ("sock", "sent", "acked", "unacked_at", "last_frame")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = 0
        self.acked = 0
        self.unacked_at = 0.0  # when it last went from all-acknowledged to owing
        self.last_frame = time.monotonic()


class TcpChannel(Channel):
    """Streams to one peer's listener (see :meth:`TcpTransport.connect`)."""

    def __init__(self, parts: Parts, endpoint: Endpoint) -> None:
        self._config = config = parts.config
        self._limiter = parts.limiter
        self._gate = parts.gate
        self._endpoint = endpoint
        self._label = endpoint.label()
        self._timeout = config.progress_timeout_s
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Optional[tuple[_Outgoing, int, int]]]" = queue.SimpleQueue()
        self._transfers: dict[int, _Outgoing] = {}
        self._next_tid = 1
        self._error: Optional[TransportError] = None
        self._closed = False
        self._last_frame = time.monotonic()  # from the peer, on any stream
        self._socks: list[socket.socket] = []
        session = os.urandom(wire.SESSION_BYTES)
        try:
            for stream in range(config.streams):
                sock, server_name = self._open_stream(parts, session, stream)
                self._socks.append(sock)
                if stream == 0 and server_name:
                    self._label = f"{server_name} at {endpoint.host}:{endpoint.port}"
                sock.settimeout(config.tick_s)
        except BaseException as exc:
            for sock in self._socks:
                sock.close()
            if isinstance(exc, OSError) and not isinstance(exc, TransportError):
                raise PeerLostError(f"the handshake with {self._label} broke: {exc}", self._label) from None
            raise
        self._threads = []
        self._streams = [_StreamState(sock) for sock in self._socks]
        for i, stream in enumerate(self._streams):
            for target, role in ((self._send_loop, "send"), (self._read_loop, "ack")):
                thread = threading.Thread(
                    target=self._run,
                    args=(target, stream),
                    daemon=True,
                    name=f"transport-{role}-{endpoint.host}:{endpoint.port}-{i}",
                )
                self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def _open_stream(self, parts: Parts, session: bytes, stream: int) -> tuple[socket.socket, str]:
        """Dial and authenticate one stream within ``connect_timeout_s``. A listener that turns
        the connection away before its greeting (at its cap of unauthenticated connections,
        which strangers may be filling) is dialled again after a short, jittered pause."""
        deadline = time.monotonic() + self._config.connect_timeout_s
        pause = _RETRY_FIRST_S
        while True:
            sock = self._dial()
            try:
                return sock, parts.handshake.client(sock, session, stream, self._label, deadline)
            except TurnedAway:
                sock.close()
                wait = pause * random.uniform(0.5, 1.5)
                if time.monotonic() + wait >= deadline:
                    raise PeerLostError(
                        f"{self._label} kept turning our connection away for "
                        f"{self._config.connect_timeout_s}s: it is at its cap of unauthenticated "
                        f"connections (something may be flooding it) or closing",
                        self._label,
                    ) from None
                time.sleep(wait)
                pause = min(2 * pause, _RETRY_MAX_S)
            except BaseException:
                sock.close()
                raise

    def _dial(self) -> socket.socket:
        try:
            sock = socket.create_connection(
                (self._endpoint.host, self._endpoint.port), timeout=self._config.connect_timeout_s
            )
        except socket.timeout:
            raise ProgressTimeoutError(
                f"{self._label} did not accept a connection within {self._config.connect_timeout_s}s", self._label
            ) from None
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {self._label}: {exc}", self._label) from None
        tune(sock, self._config)
        return sock

    @property
    def peer(self) -> str:
        return self._label

    def dscp(self) -> tuple[int, ...]:
        """The DSCP each of the channel's streams marks its packets with, read from its socket (0: the normal class)."""
        out = []
        for sock in self._socks:
            if sock.family == socket.AF_INET6:
                out.append(sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS) >> 2)
            else:
                out.append(sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) >> 2)
        return tuple(out)

    def send_async(self, header: Header, buffer) -> "Future[None]":
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("send_async needs a contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes != header.length:
            raise ValueError(f"the buffer holds {view.nbytes} bytes, the header says {header.length}")
        with self._lock:
            if self._error is not None:
                raise type(self._error)(f"channel to {self._label} is broken: {self._error}", self._label)
            if self._closed:
                raise ChannelClosedError(f"channel to {self._label} is closed", self._label)
            chunk = self._config.chunk_bytes
            outgoing = _Outgoing(self._next_tid, header, view, max(1, -(-header.length // chunk)))
            self._next_tid += 1
            self._transfers[outgoing.tid] = outgoing
        for offset in range(0, max(header.length, 1), chunk):
            self._queue.put((outgoing, offset, min(chunk, header.length - offset)))
        return outgoing.future

    def close(self) -> None:
        with self._lock:
            already = self._closed
            self._closed = True
        if already:
            return
        self._fail(ChannelClosedError(f"the channel to {self._label} was closed", self._label))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        for sock in self._socks:
            sock.close()

    # --- threads ----------------------------------------------------------------------------
    def _run(self, target, stream: _StreamState) -> None:
        try:
            target(stream)
        except TransportError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(
                PeerLostError(f"the connection to {self._label} broke: {exc} (the peer died or reset it)", self._label)
            )
        except Exception as exc:  # noqa: BLE001 - never let a stream thread die silently
            self._fail(ProtocolError(f"sending to {self._label} failed: {exc!r}", self._label))

    def _send_loop(self, stream: _StreamState) -> None:
        chunk = self._config.chunk_bytes
        while True:
            item = self._queue.get()
            if item is None:
                return
            outgoing, offset, n = item
            if outgoing.future.done() or self._error is not None:
                continue
            head = wire.CHUNK_HEAD.pack(outgoing.tid, offset, chunk) + outgoing.header_bytes
            self._write(stream, memoryview(wire.frame(wire.CHUNK, head, n)), payload=False)
            if n:
                self._write(stream, outgoing.view[offset : offset + n], payload=True)
            with self._lock:
                outgoing.chunks_left -= 1
                if not outgoing.chunks_left:
                    outgoing.written_at = time.monotonic()

    def _write(self, stream: _StreamState, view: memoryview, payload: bool) -> None:
        """Write all of ``view``; a payload under the bandwidth cap (``limiter.piece`` bytes at a
        time) and, once this host's training marks its collectives, through the gate (a piece
        at a time, only while they are idle)."""
        limiter = self._limiter if payload else None
        gate = self._gate if payload else None
        n = len(view)
        pos = 0
        while pos < n:
            if gate is not None and gate.engaged():
                end = pos + min(gate.piece(), n - pos)
                if limiter is not None:
                    limiter.acquire(end - pos)
                gate.send(
                    stream.sock,
                    view[pos:end],
                    lambda part: self._send_some(stream, part),
                    self._check_stall,
                    patience_s=min(gate.patience_s, self._timeout / 3),
                )
                pos = end
                continue
            end = n
            if limiter is not None:
                end = pos + min(limiter.piece, n - pos)
                limiter.acquire(end - pos)
            while pos < end:
                pos += self._send_some(stream, view[pos:end])

    def _send_some(self, stream: _StreamState, view: memoryview) -> int:
        if stream.sent == stream.acked:
            stream.unacked_at = time.monotonic()
        try:
            k = stream.sock.send(view)
        except socket.timeout:
            self._check_stall()
            return 0
        stream.sent += k
        return k

    def _read_loop(self, stream: _StreamState) -> None:
        sock = stream.sock
        prefix = bytearray(wire.PREFIX.size)
        while True:
            if not self._recv_into(sock, memoryview(prefix), idle_ok=True):
                if self._closed or self._error is not None:
                    return
                raise PeerLostError(
                    f"{self._label} closed the connection (it died, or its listener was closed)", self._label
                )
            kind, head_len, payload_len = wire.PREFIX.unpack(prefix)
            if payload_len or head_len > wire.MAX_FRAME_HEADER:
                raise ProtocolError(f"{self._label} sent a frame of type {kind} with a payload", self._label)
            head = bytearray(head_len)
            self._recv_into(sock, memoryview(head), idle_ok=False)
            stream.last_frame = self._last_frame = time.monotonic()
            if kind == wire.PROGRESS and head_len == wire.PROGRESS_HEAD.size:
                (stream.acked,) = wire.PROGRESS_HEAD.unpack(head)
            elif kind == wire.DONE and head_len >= wire.DONE_HEAD.size:
                tid, status = wire.DONE_HEAD.unpack_from(head)
                self._done(tid, status, bytes(head[wire.DONE_HEAD.size :]).decode(errors="replace"))
            else:
                raise ProtocolError(f"{self._label} sent a frame of unknown type {kind}", self._label)

    def _recv_into(self, sock: socket.socket, view: memoryview, idle_ok: bool) -> bool:
        n = len(view)
        pos = 0
        while pos < n:
            try:
                k = sock.recv_into(view[pos:], n - pos)
            except socket.timeout:
                self._check_stall()
                continue
            if not k:
                if idle_ok and pos == 0:
                    return False
                raise PeerLostError(f"{self._label} closed the connection mid-frame (it died)", self._label)
            pos += k
        return True

    def _check_stall(self) -> None:
        """Raise when the peer owes us progress (bytes written but not reported read, or the
        DONE of a fully written transfer) and has been silent for the progress timeout."""
        if self._error is not None:
            raise self._error
        now = time.monotonic()
        waited = max((now - max(s.last_frame, s.unacked_at) for s in self._streams if s.sent > s.acked), default=0.0)
        with self._lock:
            pending = len(self._transfers)
            for outgoing in self._transfers.values():
                if outgoing.written_at:
                    waited = max(waited, now - max(self._last_frame, outgoing.written_at))
        if waited > self._timeout:
            raise ProgressTimeoutError(
                f"{self._label} made no progress for {self._timeout:.1f}s with {pending} "
                f"transfer(s) pending (it stopped reading, hung or vanished)",
                self._label,
            )

    # --- outcomes ---------------------------------------------------------------------------
    def _done(self, tid: int, status: int, message: str) -> None:
        with self._lock:
            outgoing = self._transfers.pop(tid, None)
        if outgoing is None:
            return
        if status == wire.DONE_OK:
            outgoing.future.set_result(None)
            return
        error = _DONE_ERRORS.get(status, ProtocolError)
        outgoing.future.set_exception(
            error(f"{self._label} refused {outgoing.header.describe()}: {message}", self._label)
        )

    def _fail(self, error: TransportError) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending = list(self._transfers.values())
            self._transfers.clear()
        for sock in self._socks:
            shutdown(sock)
        for _ in self._socks:
            self._queue.put(None)
        for outgoing in pending:
            outgoing.future.set_exception(
                type(error)(f"sending {outgoing.header.describe()} to {self._label} failed: {error}", self._label)
            )
