"""The receiving side of the TCP backend: a listener, a session per sending channel, one thread
per stream reading chunks straight into the sink's buffers.

A *session* is one sender's channel: its streams share the transfers in flight (a transfer's
chunks arrive on any of them). When any stream of a session breaks (EOF or reset mid-transfer,
a protocol violation, no progress), the whole session fails: every incomplete transfer gets
``sink.failed`` exactly once, after the last stream still writing into its buffer has stopped,
and the other streams are shut down so the sender hears of it at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Optional

from ._base import Endpoint, Listener, Sink
from ._errors import ChannelClosedError, PeerLostError, ProtocolError, TransportError
from ._tcp import shutdown, tune
from ._tcp_stream import Session, Stream

if TYPE_CHECKING:  # the transport imports this module, not the reverse
    from ._tcp_transport import TcpTransport

log = logging.getLogger("gemini_ckpt.transport")

_HANDSHAKE_TIMEOUT_S = 5.0


class TcpListener(Listener):
    """Accepts authenticated senders into a sink (see :meth:`TcpTransport.listen`)."""

    def __init__(self, transport: TcpTransport, sink: Sink, bind_host: str, port: int,
                 advertise_host: Optional[str]) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink must implement buffer_for, received and failed, got {type(sink).__name__}")
        if advertise_host is None and bind_host in ("", "0.0.0.0", "::"):
            raise ValueError(f"listening on the wildcard address {bind_host!r} needs advertise_host (the node "
                             f"address peers should dial; Ray's node IP)")
        self._transport = transport
        self._config = transport.config
        self._sink = sink
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.create_server((bind_host, port), family=family, backlog=128)
        self._sock.settimeout(self._config.tick_s)
        self._endpoint = Endpoint("tcp", advertise_host or bind_host, self._sock.getsockname()[1],
                                  transport.host_name)
        self._lock = threading.Lock()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._sessions: dict[bytes, Session] = {}
        self._threads: set[threading.Thread] = set()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"transport-accept-{self._endpoint.port}",
                                               daemon=True)
        self._accept_thread.start()

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

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
            session.fail(ChannelClosedError(f"the listener at {self._endpoint.host}:{self._endpoint.port} was closed",
                                            session.label))
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
            except OSError:
                if self._closed:
                    return
                log.exception("transport listener %s: accept failed", self._endpoint.label())
                time.sleep(self._config.tick_s)
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                          name=f"transport-recv-{addr[0]}:{addr[1]}")
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, addr) -> None:
        session: Optional[Session] = None
        label = f"sender at {addr[0]}:{addr[1]}"
        try:
            tune(conn, self._config)
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            hello = self._transport._server_handshake(conn, label)
            if hello is None:
                log.warning("transport listener %s: refused %s: it could not prove namespace %r's secret",
                            self._endpoint.label(), label, self._transport.namespace)
                return
            key, _stream, client_name = hello
            label = f"{client_name or 'sender'} at {addr[0]}:{addr[1]}"
            conn.settimeout(self._config.tick_s)
            session = self._join(key, label, conn)
            if session is None:
                return
            Stream(self, session, conn).run()
        except TransportError as exc:
            if session is not None:
                session.fail(exc)
            else:
                log.info("transport listener %s: handshake with %s failed: %s", self._endpoint.label(), label, exc)
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
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
