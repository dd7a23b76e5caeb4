"""The TCP backend's shared plumbing: its configuration and socket helpers (the transport is in
:mod:`._tcp_transport`, the two sides in :mod:`._tcp_send` and :mod:`._tcp_recv` + :mod:`._tcp_stream`).

Threads, not asyncio: every blocking call is a socket call that releases the GIL, the host
store that embeds this is itself a threaded actor, and a thread per stream keeps the hot loop
(``recv_into`` straight into the sink's buffer) a few lines long.

Liveness, in one place:

* a peer that dies is noticed at once: its kernel closes the connections (FIN or RST), so the
  other side's ``recv``/``send`` fails on the next call;
* a peer that stops (SIGSTOP, a hung process, a host that vanished without a word) is noticed
  by the *progress timeout*: every socket call waits at most :attr:`TcpConfig.tick_s`, and a
  side with work outstanding that has heard nothing from its peer for ``progress_timeout_s``
  gives up. The receiver reports progress every ~50 ms while bytes arrive (and while it
  verifies a checksum), so a slow but live peer is never mistaken for a dead one;
* TCP keepalive and ``TCP_USER_TIMEOUT`` back this up for idle connections to a host that
  vanished (the next send would notice anyway).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import _wire as wire
from ._errors import PeerLostError, ProgressTimeoutError, ProtocolError

LOWER_EFFORT_DSCP = 8  # CS1, the "scavenger" class switches are configured with for bulk traffic
_TC_PRIO_BULK = 2  # Linux socket priority of bulk traffic: the last band of pfifo_fast, prio, mqprio
DEFAULT_STREAMS = 4
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_NAME_BYTES = 1024


@dataclass(frozen=True)
class TcpConfig:
    """How the TCP backend moves bytes.

    ``streams`` connections per peer, each carrying whole chunks of ``chunk_bytes`` (the
    defaults were the fastest and steadiest against a raw socket: docs/transport.md).
    ``progress_timeout_s``: a peer that makes no progress for this long while a transfer is
    outstanding fails it. ``max_send_bytes_per_s``: the sending host's cap,
    shared by all its channels (None: unlimited). ``verify_checksum``: a function
    ``f(data, value) -> int`` (``zlib.crc32``, ``crc32c.crc32c``) the receiver runs over a
    complete transfer when the header carries a checksum; None leaves verification to the sink.
    ``dscp``: the DSCP the sending end of every data-plane connection marks its packets with, and
    the socket priority that goes with it (:func:`tune`); None marks nothing. The host store uses
    :data:`LOWER_EFFORT_DSCP` under ``CheckpointConfig(interleave=...)``.
    """

    streams: int = DEFAULT_STREAMS
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress_timeout_s: float = 1.0
    connect_timeout_s: float = 5.0
    max_send_bytes_per_s: Optional[float] = None
    verify_checksum: Optional[Callable[[Any, int], int]] = None
    socket_buffer_bytes: Optional[int] = None
    dscp: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ValueError(f"TcpConfig.streams must be an int in [1, 64], got {self.streams!r}")
        if not isinstance(self.chunk_bytes, int) or not 64 << 10 <= self.chunk_bytes <= 1 << 30:
            raise ValueError(f"TcpConfig.chunk_bytes must be an int in [64 KiB, 1 GiB], got {self.chunk_bytes!r}")
        for name in ("progress_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TcpConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_send_bytes_per_s is not None and not self.max_send_bytes_per_s > 0:
            raise ValueError(f"TcpConfig.max_send_bytes_per_s must be > 0 or None, got {self.max_send_bytes_per_s!r}")
        if self.dscp is not None and (not isinstance(self.dscp, int) or not 0 <= self.dscp <= 63):
            raise ValueError(f"TcpConfig.dscp must be an int in [0, 63] or None, got {self.dscp!r}")
        if self.socket_buffer_bytes is not None and not self.socket_buffer_bytes > 0:
            raise ValueError(f"TcpConfig.socket_buffer_bytes must be > 0 or None, got {self.socket_buffer_bytes!r}")

    @property
    def tick_s(self) -> float:
        """The longest any socket call blocks before the stall check runs."""
        return min(0.1, self.progress_timeout_s / 5)


# --- socket helpers ---------------------------------------------------------------------------
def tune(sock: socket.socket, config: TcpConfig, *, sending: bool = True) -> None:
    """A data-plane socket's options; ``sending``: the end that carries the bulk bytes, the only
    one :func:`mark` marks. The receiving end's acknowledgements and progress frames are a few
    bytes each; marked, they would wait in the lower class of their host's own link behind that
    host's lower-effort sends and slow the flow they acknowledge (and its progress timeout)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", 1),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", int(1000 * max(2.0, 2 * config.progress_timeout_s))),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:  # not on this platform: the progress timeout still holds
                pass
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    if config.dscp is not None and sending:
        mark(sock, config.dscp)


def mark(sock: socket.socket, dscp: int) -> None:
    """Mark ``sock``'s packets with ``dscp`` (a network that honours it, e.g. a switch with a
    scavenger class, or ``LocalCluster(qos=True)``, queues them behind other traffic) and, for
    :data:`LOWER_EFFORT_DSCP`, give the socket bulk priority (this host's own queues with bands
    put it last). Where the platform refuses, the socket goes unmarked: marking is a preference,
    never a condition for sending."""
    try:
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)
        else:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
        if dscp == LOWER_EFFORT_DSCP and hasattr(socket, "SO_PRIORITY"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, _TC_PRIO_BULK)  # after IP_TOS, which resets it
    except (OSError, AttributeError):  # refused, or no such option on this platform (IPV6_TCLASS)
        pass


class TurnedAway(PeerLostError):
    """The listener closed the connection before its greeting: it is at its cap of
    unauthenticated connections (see :data:`._tcp_recv.MAX_PREAUTH`), or closing. A sender tries
    again until its connect timeout."""


def wait_until(sock: socket.socket, deadline: Optional[float], label: str) -> None:
    """Make ``sock``'s next call wait no later than ``deadline`` (monotonic; None: leave the
    socket's own timeout); raise :class:`ProgressTimeoutError` once it has passed."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise ProgressTimeoutError(f"{label} did not complete the handshake in time", label)
    sock.settimeout(left)


def recv_exact(sock: socket.socket, n: int, label: str, deadline: Optional[float] = None) -> bytes:
    """Exactly ``n`` small bytes (handshakes only), by ``deadline`` (monotonic) when given, else
    under the socket's own timeout. One deadline for a whole handshake is what keeps a peer
    that trickles a byte at a time from holding the connection: a per-call timeout never
    fires for it."""
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        wait_until(sock, deadline, label)
        try:
            k = sock.recv_into(view[pos:])
        except socket.timeout:
            raise ProgressTimeoutError(f"{label} did not answer the handshake in time", label) from None
        if not k:
            raise PeerLostError(f"{label} closed the connection", label)
        pos += k
    return bytes(buf)


def recv_str(sock: socket.socket, label: str, deadline: Optional[float] = None) -> str:
    (n,) = wire.U16.unpack(recv_exact(sock, 2, label, deadline))
    if n > MAX_NAME_BYTES:
        raise ProtocolError(f"{label} sent a name of {n} bytes", label)
    try:
        return recv_exact(sock, n, label, deadline).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{label} sent a name that is not utf-8", label) from None


class LogThrottle:
    """At most one log line per ``every_s`` for a kind of event a stranger can repeat at will
    (refused handshakes, connections over the cap): the first is logged at once, the rest are
    counted into the next line. Thread-safe.

    Example::

        throttle = LogThrottle(10.0)
        if (n := throttle.due()) is not None:
            log.warning("refused a client (%d like it since the last line)", n)
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._count = 0

    def due(self) -> Optional[int]:
        """Count one event; the number of events since the last line (this one included) when
        a line is due now, else None."""
        now = time.monotonic()
        with self._lock:
            self._count += 1
            if now - self._last < self.every_s:
                return None
            self._last, count, self._count = now, self._count, 0
            return count


def shutdown(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock`` (they see EOF or an error) without closing the fd
    under them; the owning thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
