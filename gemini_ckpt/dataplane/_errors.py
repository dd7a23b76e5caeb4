"""The transport's exceptions: rooted in built-ins, picklable, naming the peer.

The host-store actor raises built-in exceptions across the Ray boundary (it never imports
``gemini_ckpt``); these derive from the built-in a caller would catch anyway
(``ConnectionError``, ``TimeoutError``, ``PermissionError``, ``ValueError``), so a client that
knows nothing of this module still maps them sensibly.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every transport failure. ``peer`` names the other side (its name and address)."""

    def __init__(self, message: str, peer: str = "") -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self):
        return (type(self), (str(self), self.peer))


class PeerLostError(TransportError, ConnectionError):
    """The connection to the peer broke (it died, closed the connection, or reset it)."""


class ProgressTimeoutError(TransportError, TimeoutError):
    """The peer stopped making progress (stopped reading, stopped sending, or vanished without
    closing its connections) for longer than ``TcpConfig.progress_timeout_s``."""


class AuthenticationError(TransportError, PermissionError):
    """The peer could not prove it knows the namespace's secret (or refused our proof)."""


class TransferRejectedError(TransportError, ValueError):
    """The receiving sink refused the transfer (``buffer_for`` or ``received`` raised, e.g. the
    holder is over its memory budget). ``str(exc)`` carries the receiver's message."""


class ChecksumMismatchError(TransferRejectedError):
    """The receiver verified the bytes against the header's checksum and they differ."""


class ProtocolError(TransportError, ValueError):
    """The peer sent something the protocol does not allow (a bad frame, a chunk out of range)."""


class ChannelClosedError(TransportError, ConnectionError):
    """The channel (or listener) was closed while the transfer was pending, or before it began."""
