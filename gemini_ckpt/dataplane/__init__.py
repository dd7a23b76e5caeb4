"""The data plane: bytes from host store to host store, straight into the holder's buffers.

A small interface (:class:`Transport`, :class:`Listener`, :class:`Channel`, and the
:class:`Sink` a receiver implements) with one backend today, :class:`TcpTransport`:
authenticated (mutual HMAC-SHA256 with the namespace's secret), chunked over several parallel
streams, capped in bandwidth per sending host, and quick to notice a dead or stalled peer.
See docs/transport.md.

Self-contained on purpose (the standard library only, no ``gemini_ckpt`` imports outside this
package): the host-store actor is shipped to Ray by value, so its process never imports the
package (or torch).

Example::

    transport = TcpTransport(secret, "run-7", host_name=node_id)
    listener = transport.listen(node_ip, sink)            # sink: buffer_for / received / failed
    channel = transport.connect(peer_endpoint)            # an Endpoint from the control plane
    channel.send(Header("run-7", step, name, offset=0, length=n, total=n), array)
"""

from ._base import Channel, Endpoint, Header, Listener, Sink, Transport
from ._errors import (
    AuthenticationError,
    ChannelClosedError,
    ChecksumMismatchError,
    PeerLostError,
    ProgressTimeoutError,
    ProtocolError,
    TransferRejectedError,
    TransportError,
)
from ._interleave import IdleGate, choose_chunk
from ._ratelimit import TokenBucket
from ._tcp import LOWER_EFFORT_DSCP, TcpConfig
from ._tcp_transport import TcpTransport

__all__ = [
    "AuthenticationError",
    "Channel",
    "ChannelClosedError",
    "ChecksumMismatchError",
    "Endpoint",
    "Header",
    "IdleGate",
    "LOWER_EFFORT_DSCP",
    "Listener",
    "PeerLostError",
    "ProgressTimeoutError",
    "ProtocolError",
    "Sink",
    "TcpConfig",
    "TcpTransport",
    "TokenBucket",
    "TransferRejectedError",
    "Transport",
    "TransportError",
    "choose_chunk",
]
