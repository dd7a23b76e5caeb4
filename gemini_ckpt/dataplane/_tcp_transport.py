"""The TCP transport object: holds the namespace's secret, the host's bandwidth cap, and the
handshake (see :mod:`._wire`); opens listeners (:mod:`._tcp_recv`, streams in :mod:`._tcp_stream`) and channels
(:mod:`._tcp_send`).

Every import here is at module level, never inside a function: this package is shipped to Ray
by value, and a deferred relative import would make the actor import ``gemini_ckpt`` (and
torch) the first time it ran.
"""

from __future__ import annotations

import dataclasses

import threading
import weakref
from typing import Any, Optional

from ._base import Endpoint, Sink, Transport
from ._handshake import Handshake, Parts
from ._interleave import IdleGate
from ._ratelimit import TokenBucket
from ._tcp import MAX_NAME_BYTES, TcpConfig
from ._tcp_recv import TcpListener
from ._tcp_send import TcpChannel


class TcpTransport(Transport):
    """Authenticated, chunked, multi-stream TCP between the host stores of one namespace.

    ``secret`` (at least 16 bytes) is the namespace's; ``host_name`` names this host in the
    peer's errors (a Ray node id). All channels share one bandwidth cap (``limiter``, or one
    built from ``config.max_send_bytes_per_s``); pass the same :class:`TokenBucket` to several
    transports to cap a host that serves several namespaces. ``gate`` (an
    :class:`~._interleave.IdleGate`): sends yield to this host's training collectives
    (docs/interleave.md); the cap still applies.

    Example::

        transport = TcpTransport(secret, "run-7", host_name=node_id)
        listener = transport.listen(node_ip, sink)          # publish listener.endpoint
        with transport.connect(peer_endpoint) as channel:
            channel.send(Header("run-7", 3, "__0_0.distcp", 0, n, total=n), array)
    """

    name = "tcp"

    def __init__(
        self,
        secret: bytes,
        namespace: str,
        *,
        host_name: str = "",
        config: Optional[TcpConfig] = None,
        limiter: Optional[TokenBucket] = None,
        gate: Optional[IdleGate] = None,
    ) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("TcpTransport secret must be at least 16 bytes (the namespace's secret)")
        if not namespace or len(namespace.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"TcpTransport namespace must be 1 to {MAX_NAME_BYTES} bytes, got {namespace!r}")
        if len(host_name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"TcpTransport host_name is longer than {MAX_NAME_BYTES} bytes")
        self.namespace = namespace
        self.host_name = host_name
        self.config = config or TcpConfig()
        self.limiter = (
            limiter
            if limiter is not None
            else (TokenBucket(self.config.max_send_bytes_per_s) if self.config.max_send_bytes_per_s else None)
        )
        self.handshake = Handshake(secret, namespace, host_name)
        self.gate = gate
        self._lock = threading.Lock()
        self._opened: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"TcpTransport(namespace={self.namespace!r}, host_name={self.host_name!r}, config={self.config!r})"

    def listen(self, bind_host: str, sink: Sink, *, port: int = 0, advertise_host: Optional[str] = None):
        """Accept peers on ``bind_host:port`` (0: any free port) into ``sink``; returns a started
        :class:`~._tcp_recv.TcpListener` whose ``endpoint`` names ``advertise_host`` (default
        ``bind_host``; required when binding a wildcard address)."""
        listener = TcpListener(self.parts(), sink, bind_host, port, advertise_host)
        with self._lock:
            self._opened.add(listener)
        return listener

    def connect(self, endpoint: Endpoint, *, marked: bool = True):
        """Open ``config.streams`` authenticated streams to ``endpoint``; returns a
        :class:`~._tcp_send.TcpChannel`. Raises :class:`AuthenticationError` when either side
        cannot prove the secret, :class:`PeerLostError` when the peer is unreachable.
        ``marked=False``: its packets are not marked with ``config.dscp``."""
        if endpoint.transport != self.name:
            raise ValueError(f"endpoint {endpoint.label()} is for transport {endpoint.transport!r}, not tcp")
        parts = self.parts()
        if not marked and parts.config.dscp is not None:
            parts = dataclasses.replace(parts, config=dataclasses.replace(parts.config, dscp=None))
        channel = TcpChannel(parts, endpoint)
        with self._lock:
            self._opened.add(channel)
        return channel

    def parts(self) -> Parts:
        """What this transport's listeners and channels share (the cap and settings as of now)."""
        return Parts(self.namespace, self.host_name, self.config, self.limiter, self.handshake, self.gate)

    def close(self) -> None:
        with self._lock:
            opened = list(self._opened)
        for thing in opened:
            thing.close()
