"""The receiving side of the TCP backend: a listener, a session per sending channel, one thread
per stream reading chunks straight into the sink's buffers.

A *session* is one sender's channel: its streams share the transfers in flight (a transfer's
chunks arrive on any of them). When any stream of a session breaks (EOF or reset mid-transfer,
a protocol violation, no progress), the whole session fails: every incomplete transfer gets
``sink.failed`` exactly once, after the last stream still writing into its buffer has stopped,
and the other streams are shut down so the sender hears of it at once.

Before its proof checks, a connection is a stranger's and holds little: one deadline for the
whole handshake (:data:`PREAUTH_DEADLINE_S`, however the bytes trickle in), at most
:data:`MAX_PREAUTH` such connections per listener (a thread and an fd each), and at most the
hello's few KiB read. At the cap, a newcomer takes the place of the oldest stranger that has had
:data:`PREAUTH_GRACE_S` (a real peer proves itself in one round trip) or, when none has, is
closed at once; a sender turned away dials again (see :meth:`TcpChannel._open_stream`). So slow
clients cannot starve a real peer; a flood of fresh connections faster than ``MAX_PREAUTH /
PREAUTH_GRACE_S`` a second still can, which is the network's to stop.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

from ._base import Endpoint, Listener, Sink
from ._errors import ChannelClosedError, PeerLostError, ProgressTimeoutError, ProtocolError, TransportError
from ._tcp import LogThrottle, shutdown, tune
from ._handshake import Parts
from ._tcp_stream import Session, Stream

log = logging.getLogger("gemini_ckpt.transport")

PREAUTH_DEADLINE_S = 5.0
"""Seconds from accept to a verified proof, for the whole handshake of a connection; past it the
connection is closed. A real peer needs one round trip; this is generous for a loaded host. A
module constant for now (a ``TcpConfig`` field once a deployment needs to tune it)."""

MAX_PREAUTH = 64
"""Connections one listener holds before their proof checks (each a thread and an fd): far below
a host store's fd limit, far above what its real peers open at once (``streams`` per peer
connecting). A module constant for now."""

PREAUTH_GRACE_S = 1.0
"""At the cap, an unauthenticated connection younger than this is never dropped for a newcomer
(a real peer in its handshake); an older one is, oldest first. A module constant for now."""

_LOG_EVERY_S = 10.0  # refusals a stranger can repeat at will are logged at most this often


class TcpListener(Listener):
    """Accepts authenticated senders into a sink (see :meth:`TcpTransport.listen`)."""

    def __init__(self, parts: Parts, sink: Sink, bind_host: str, port: int, advertise_host: Optional[str]) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink must implement buffer_for, received and failed, got {type(sink).__name__}")
        if advertise_host is None and bind_host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"listening on the wildcard address {bind_host!r} needs advertise_host (the node "
                f"address peers should dial; Ray's node IP)"
            )
        self._parts = parts
        self._config = parts.config
        self._sink = sink
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.create_server((bind_host, port), family=family, backlog=128)
        self._sock.settimeout(self._config.tick_s)
        self._endpoint = Endpoint("tcp", advertise_host or bind_host, self._sock.getsockname()[1], parts.host_name)
        self._lock = threading.Lock()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._preauth: dict[socket.socket, float] = {}  # accepted, proof not yet checked -> since (oldest first)
        self._preauth_deadline_s = PREAUTH_DEADLINE_S
        self._max_preauth = MAX_PREAUTH
        self._preauth_grace_s = PREAUTH_GRACE_S
        self._busy_log = LogThrottle(_LOG_EVERY_S)
        self._refused_log = LogThrottle(_LOG_EVERY_S)
        self._accept_log = LogThrottle(_LOG_EVERY_S)
        self._sessions: dict[bytes, Session] = {}
        self._threads: set[threading.Thread] = set()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"transport-accept-{self._endpoint.port}", daemon=True
        )
        self._accept_thread.start()

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    def abort(self, put_ids, *, timeout: float) -> None:
        wanted = set(put_ids)
        with self._lock:
            sessions = list(self._sessions.values())
        deadline = time.monotonic() + timeout
        for session in [s for s in sessions if s.holds(wanted)]:
            session.fail(
                ChannelClosedError(
                    f"the receiver at {self._endpoint.host}:{self._endpoint.port} gave up "
                    f"on transfers from {session.label}",
                    session.label,
                )
            )
            if not session.wait_quiet(deadline):
                raise ProgressTimeoutError(
                    f"a stream from {session.label} still wrote into a transfer given up on {timeout:.1f}s later",
                    session.label,
                )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions.values())
            conns = list(self._conns)
        self._accept_thread.join(timeout=5)
        self._sock.close()
        for session in sessions:
            session.fail(
                ChannelClosedError(
                    f"the listener at {self._endpoint.host}:{self._endpoint.port} was closed", session.label
                )
            )
        for conn in conns:
            shutdown(conn)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    # --- accepting --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self._closed:
                    return
                if (n := self._accept_log.due()) is not None:
                    log.warning(
                        "transport listener %s: accept failed: %s (%d failures since the last line)",
                        self._endpoint.label(),
                        exc,
                        n,
                    )
                time.sleep(self._config.tick_s)
                continue
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr) -> None:
        """Start serving ``conn``, within the cap of unauthenticated connections (see the module
        docstring): the oldest past its grace makes room, else ``conn`` is closed at once."""
        now = time.monotonic()
        evicted = None
        with self._lock:
            if self._closed:
                conn.close()
                return
            full = len(self._preauth) >= self._max_preauth
            if full:
                oldest, since = next(iter(self._preauth.items()))
                if now - since < self._preauth_grace_s:
                    conn.close()
                else:
                    evicted = oldest
                    del self._preauth[oldest]
            admitted = not full or evicted is not None
            if admitted:
                self._preauth[conn] = now
                self._conns.add(conn)
                thread = threading.Thread(
                    target=self._serve, args=(conn, addr, now), daemon=True, name=f"transport-recv-{addr[0]}:{addr[1]}"
                )
                self._threads.add(thread)
        if full and (n := self._busy_log.due()) is not None:
            log.warning(
                "transport listener %s: %d connections at once have not proved namespace %r's secret "
                "(the cap): %s (a flood of strangers? %d such events since the last line)",
                self._endpoint.label(),
                self._max_preauth,
                self._parts.namespace,
                "dropped the oldest for a newcomer"
                if evicted is not None
                else f"closed a newcomer from {addr[0]}:{addr[1]} at once",
                n,
            )
        if not admitted:
            return
        if evicted is not None:
            shutdown(evicted)  # its thread sees EOF at once and closes it
        thread.start()

    def _serve(self, conn: socket.socket, addr, accepted_at: float) -> None:
        session: Optional[Session] = None
        label = f"sender at {addr[0]}:{addr[1]}"
        try:
            tune(conn, self._config, sending=False)  # it only receives: its frames go unmarked
            hello = self._parts.handshake.server(conn, label, accepted_at + self._preauth_deadline_s)
            with self._lock:
                self._preauth.pop(conn, None)
            if hello is None:
                if (n := self._refused_log.due()) is not None:
                    log.warning(
                        "transport listener %s: refused %s: it could not prove namespace %r's secret "
                        "(%d refused since the last line)",
                        self._endpoint.label(),
                        label,
                        self._parts.namespace,
                        n,
                    )
                return
            key, _stream, client_name = hello
            label = f"{client_name or 'sender'} at {addr[0]}:{addr[1]}"
            conn.settimeout(self._config.tick_s)
            session = self._join(key, label, conn)
            if session is None:
                return
            Stream(self._parts, session, conn).run()
        except TransportError as exc:
            if session is not None:
                session.fail(exc)
            elif (n := self._refused_log.due()) is not None:
                log.info(
                    "transport listener %s: handshake with %s failed: %s (%d refused since the last line)",
                    self._endpoint.label(),
                    label,
                    exc,
                    n,
                )
        except OSError as exc:
            if session is not None:
                session.fail(PeerLostError(f"the connection from {label} broke: {exc}", label))
        except Exception as exc:  # noqa: BLE001 - never let a stream thread die silently
            log.exception("transport listener %s: stream from %s failed", self._endpoint.label(), label)
            if session is not None:
                session.fail(ProtocolError(f"receiving from {label} failed: {exc!r}", label))
        finally:
            self._leave(session, conn)

    def _join(self, key: bytes, label: str, conn: socket.socket) -> Optional[Session]:
        with self._lock:
            if self._closed:
                return None
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = Session(key, label, self._sink)
        with session.lock:
            if session.error is not None:
                return None
            session.conns.add(conn)
        return session

    def _leave(self, session: Optional[Session], conn: socket.socket) -> None:
        if session is not None:
            with session.lock:
                session.conns.discard(conn)
                last = not session.conns
            if last and session.transfers:
                session.fail(PeerLostError(f"{session.label} closed the connection mid-transfer", session.label))
            with self._lock:
                if last and self._sessions.get(session.key) is session:
                    del self._sessions[session.key]
        try:
            conn.close()
        finally:
            with self._lock:
                self._preauth.pop(conn, None)
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
