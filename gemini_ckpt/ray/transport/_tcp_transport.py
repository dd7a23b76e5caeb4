"""The TCP transport object: holds the namespace's secret, the host's bandwidth cap, and the
handshake (see :mod:`._wire`); opens listeners (:mod:`._tcp_recv`, streams in :mod:`._tcp_stream`) and channels
(:mod:`._tcp_send`).

Every import here is at module level, never inside a function: this package is shipped to Ray
by value, and a deferred relative import would make the actor import ``gemini_ckpt`` (and
torch) the first time it ran.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from typing import Any, Optional

from . import _wire as wire
from ._base import Endpoint, Sink, Transport
from ._errors import AuthenticationError, PeerLostError, ProtocolError
from ._ratelimit import TokenBucket
from ._tcp import MAX_NAME_BYTES, TcpConfig, TurnedAway, recv_exact, recv_str, wait_until
from ._tcp_recv import TcpListener
from ._tcp_send import TcpChannel


class TcpTransport(Transport):
    """Authenticated, chunked, multi-stream TCP between the host stores of one namespace.

    ``secret`` (at least 16 bytes) is the namespace's; ``host_name`` names this host in the
    peer's errors (a Ray node id). All channels share one bandwidth cap (``limiter``, or one
    built from ``config.max_send_bytes_per_s``); pass the same :class:`TokenBucket` to several
    transports to cap a host that serves several namespaces.

    Example::

        transport = TcpTransport(secret, "run-7", host_name=node_id)
        listener = transport.listen(node_ip, sink)          # publish listener.endpoint
        with transport.connect(peer_endpoint) as channel:
            channel.send(Header("run-7", 3, "__0_0.distcp", 0, n, total=n), array)
    """

    name = "tcp"

    def __init__(self, secret: bytes, namespace: str, *, host_name: str = "",
                 config: Optional[TcpConfig] = None, limiter: Optional[TokenBucket] = None) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("TcpTransport secret must be at least 16 bytes (the namespace's secret)")
        if not namespace or len(namespace.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"TcpTransport namespace must be 1 to {MAX_NAME_BYTES} bytes, got {namespace!r}")
        if len(host_name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"TcpTransport host_name is longer than {MAX_NAME_BYTES} bytes")
        self.namespace = namespace
        self.host_name = host_name
        self.config = config or TcpConfig()
        self.limiter = limiter if limiter is not None else (
            TokenBucket(self.config.max_send_bytes_per_s) if self.config.max_send_bytes_per_s else None)
        self._secret = bytes(secret)
        self._lock = threading.Lock()
        self._opened: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"TcpTransport(namespace={self.namespace!r}, host_name={self.host_name!r}, config={self.config!r})"

    def listen(self, bind_host: str, sink: Sink, *, port: int = 0, advertise_host: Optional[str] = None):
        """Accept peers on ``bind_host:port`` (0: any free port) into ``sink``; returns a started
        :class:`~._tcp_recv.TcpListener` whose ``endpoint`` names ``advertise_host`` (default
        ``bind_host``; required when binding a wildcard address)."""
        listener = TcpListener(self, sink, bind_host, port, advertise_host)
        with self._lock:
            self._opened.add(listener)
        return listener

    def connect(self, endpoint: Endpoint):
        """Open ``config.streams`` authenticated streams to ``endpoint``; returns a
        :class:`~._tcp_send.TcpChannel`. Raises :class:`AuthenticationError` when either side
        cannot prove the secret, :class:`PeerLostError` when the peer is unreachable."""
        if endpoint.transport != self.name:
            raise ValueError(f"endpoint {endpoint.label()} is for transport {endpoint.transport!r}, not tcp")
        channel = TcpChannel(self, endpoint)
        with self._lock:
            self._opened.add(channel)
        return channel

    def close(self) -> None:
        with self._lock:
            opened = list(self._opened)
        for thing in opened:
            thing.close()

    # --- the handshake (see _wire) ---------------------------------------------------------
    def _client_handshake(self, sock: socket.socket, session: bytes, stream: int, label: str,
                          deadline: Optional[float] = None) -> str:
        """Prove ourselves, then make the server prove itself, all by ``deadline`` (monotonic;
        None: the socket's timeout per call); returns the server's name. Raises
        :class:`~._tcp.TurnedAway` when the server closed the connection without a greeting."""
        try:
            greeting = recv_exact(sock, wire.HELLO_S.size, label, deadline)
        except (PeerLostError, ConnectionResetError):
            raise TurnedAway(f"{label} closed the connection before its greeting (at its cap of unauthenticated "
                             f"connections, or closing)", label) from None
        magic, version, nonce_s = wire.HELLO_S.unpack(greeting)
        if magic != wire.MAGIC or version != wire.VERSION:
            raise ProtocolError(f"{label} is not a gemini_ckpt transport endpoint (or speaks another version)", label)
        nonce_c = os.urandom(wire.NONCE_BYTES)
        proof = wire.client_proof(self._secret, self.namespace, session, stream, self.host_name, nonce_s, nonce_c)
        wait_until(sock, deadline, label)
        sock.sendall(wire.HELLO_C_FIXED.pack(wire.MAGIC, wire.VERSION, nonce_c, session, stream)
                     + wire.pack_str(self.namespace) + wire.pack_str(self.host_name) + proof)
        try:
            (status,) = wire.VERDICT_STATUS.unpack(recv_exact(sock, 1, label, deadline))
        except PeerLostError:
            raise AuthenticationError(f"{label} closed the connection during the handshake (namespace "
                                      f"{self.namespace!r}): is it a host store of this namespace?", label) from None
        if status != wire.ACCEPTED:
            raise AuthenticationError(f"{label} refused our proof for namespace {self.namespace!r}: the two hosts "
                                      f"do not share the namespace's secret", label)
        server_name = recv_str(sock, label, deadline)
        expected = wire.server_proof(self._secret, self.namespace, session, stream, self.host_name, server_name,
                                     nonce_s, nonce_c)
        if not wire.verify(expected, recv_exact(sock, wire.PROOF_BYTES, label, deadline)):
            raise AuthenticationError(f"{label} could not prove it knows namespace {self.namespace!r}'s secret; "
                                      f"no data was sent to it", label)
        return server_name

    def _server_handshake(self, sock: socket.socket, label: str,
                          deadline: Optional[float] = None) -> Optional[tuple[bytes, int, str]]:
        """Check the client's proof, then prove ourselves, all by ``deadline`` (monotonic; the
        listener's pre-auth deadline); returns (session, stream, client name), or None when the
        client was refused (nothing of its was read beyond the hello, at most a few KiB)."""
        nonce_s = os.urandom(wire.NONCE_BYTES)
        wait_until(sock, deadline, label)
        sock.sendall(wire.HELLO_S.pack(wire.MAGIC, wire.VERSION, nonce_s))
        magic, version, nonce_c, session, stream = wire.HELLO_C_FIXED.unpack(
            recv_exact(sock, wire.HELLO_C_FIXED.size, label, deadline))
        if magic != wire.MAGIC or version != wire.VERSION:
            wait_until(sock, deadline, label)
            sock.sendall(wire.VERDICT_STATUS.pack(wire.REFUSED))
            return None
        namespace = recv_str(sock, label, deadline)
        client_name = recv_str(sock, label, deadline)
        proof = recv_exact(sock, wire.PROOF_BYTES, label, deadline)
        expected = wire.client_proof(self._secret, self.namespace, session, stream, client_name, nonce_s, nonce_c)
        wait_until(sock, deadline, label)
        if not wire.verify(expected, proof) or namespace != self.namespace:
            sock.sendall(wire.VERDICT_STATUS.pack(wire.REFUSED))
            return None
        sock.sendall(wire.VERDICT_STATUS.pack(wire.ACCEPTED) + wire.pack_str(self.host_name)
                     + wire.server_proof(self._secret, self.namespace, session, stream, client_name, self.host_name,
                                         nonce_s, nonce_c))
        return session, stream, client_name
