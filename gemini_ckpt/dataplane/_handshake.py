"""The handshake of a TCP stream (see :mod:`._wire`): each side proves it knows the namespace's
secret, without sending it. One :class:`Handshake` per transport; its listeners and channels use
it (they get it, with the transport's settings, as a :class:`Parts`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

from . import _wire as wire
from ._errors import AuthenticationError, PeerLostError, ProtocolError
from ._tcp import TcpConfig, TurnedAway, recv_exact, recv_str, wait_until


class Handshake:
    """Proves this host to a peer, and the peer to this host, for one namespace."""

    def __init__(self, secret: bytes, namespace: str, host_name: str) -> None:
        self._secret, self.namespace, self.host_name = bytes(secret), namespace, host_name

    def client(
        self, sock: socket.socket, session: bytes, stream: int, label: str, deadline: Optional[float] = None
    ) -> str:
        """Prove ourselves, then make the server prove itself, all by ``deadline`` (monotonic;
        None: the socket's timeout per call); returns the server's name. Raises
        :class:`~._tcp.TurnedAway` when the server closed the connection without a greeting."""
        try:
            greeting = recv_exact(sock, wire.HELLO_S.size, label, deadline)
        except (PeerLostError, ConnectionResetError):
            raise TurnedAway(
                f"{label} closed the connection before its greeting (at its cap of unauthenticated "
                f"connections, or closing)",
                label,
            ) from None
        magic, version, nonce_s = wire.HELLO_S.unpack(greeting)
        if magic != wire.MAGIC or version != wire.VERSION:
            raise ProtocolError(f"{label} is not a gemini_ckpt transport endpoint (or speaks another version)", label)
        nonce_c = os.urandom(wire.NONCE_BYTES)
        proof = wire.client_proof(self._secret, self.namespace, session, stream, self.host_name, nonce_s, nonce_c)
        wait_until(sock, deadline, label)
        sock.sendall(
            wire.HELLO_C_FIXED.pack(wire.MAGIC, wire.VERSION, nonce_c, session, stream)
            + wire.pack_str(self.namespace)
            + wire.pack_str(self.host_name)
            + proof
        )
        try:
            (status,) = wire.VERDICT_STATUS.unpack(recv_exact(sock, 1, label, deadline))
        except PeerLostError:
            raise AuthenticationError(
                f"{label} closed the connection during the handshake (namespace "
                f"{self.namespace!r}): is it a host store of this namespace?",
                label,
            ) from None
        if status != wire.ACCEPTED:
            raise AuthenticationError(
                f"{label} refused our proof for namespace {self.namespace!r}: the two hosts "
                f"do not share the namespace's secret",
                label,
            )
        server_name = recv_str(sock, label, deadline)
        expected = wire.server_proof(
            self._secret, self.namespace, session, stream, self.host_name, server_name, nonce_s, nonce_c
        )
        if not wire.verify(expected, recv_exact(sock, wire.PROOF_BYTES, label, deadline)):
            raise AuthenticationError(
                f"{label} could not prove it knows namespace {self.namespace!r}'s secret; no data was sent to it", label
            )
        return server_name

    def server(
        self, sock: socket.socket, label: str, deadline: Optional[float] = None
    ) -> Optional[tuple[bytes, int, str]]:
        """Check the client's proof, then prove ourselves, all by ``deadline`` (monotonic; the
        listener's pre-auth deadline); returns (session, stream, client name), or None when the
        client was refused (nothing of its was read beyond the hello, at most a few KiB)."""
        nonce_s = os.urandom(wire.NONCE_BYTES)
        wait_until(sock, deadline, label)
        sock.sendall(wire.HELLO_S.pack(wire.MAGIC, wire.VERSION, nonce_s))
        magic, version, nonce_c, session, stream = wire.HELLO_C_FIXED.unpack(
            recv_exact(sock, wire.HELLO_C_FIXED.size, label, deadline)
        )
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
        sock.sendall(
            wire.VERDICT_STATUS.pack(wire.ACCEPTED)
            + wire.pack_str(self.host_name)
            + wire.server_proof(
                self._secret, self.namespace, session, stream, client_name, self.host_name, nonce_s, nonce_c
            )
        )
        return session, stream, client_name


@dataclass(frozen=True)
class Parts:
    """What a transport's listeners and channels share: its namespace and host name, settings,
    bandwidth cap (``limiter``, a :class:`~._ratelimit.TokenBucket` or None), handshake, and the
    gate that holds sends back while training communicates (``gate``, an
    :class:`~._interleave.IdleGate` or None)."""

    namespace: str
    host_name: str
    config: TcpConfig
    limiter: Any
    handshake: Handshake
    gate: Any = None
