"""The transport interface: what a backend implements and what a receiving host store provides.

Roles and call order
--------------------
Receiving side (a holder's host store)::

    listener = transport.listen(node_ip, sink)     # starts accepting; listener.endpoint -> Ray
    ...                                            # per transfer, on transport threads:
    sink.buffer_for(header) -> writable memoryview #   once, when its first bytes arrive
    sink.received(header)                          #   once, when every byte is in that view
    sink.failed(header, exc)                       #   or once, instead, if the transfer broke
    listener.abort(put_ids, timeout=...)           # the receiver gives up on some transfers:
                                                   #   returns once no stream writes into their views
    listener.close()

Sending side (the host store that owns the bytes)::

    channel = transport.connect(endpoint)          # authenticates every stream first
    fut = channel.send_async(header, view)         # or channel.send(...) to block
    fut.result()                                   # the holder acknowledged: received() returned
    channel.close()

A transfer is one contiguous byte range (``header.offset``, ``header.length``) of one file of
one version; the backend splits it into chunks and moves them over its streams however it
likes, and the sink sees only the three calls above. The sink's view is written in place (no
intermediate copy), so a host store hands out slices of its own reused buffers.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

MAX_NAME_BYTES = 1024
MAX_META_BYTES = 4096


@dataclass(frozen=True)
class Header:
    """What a transfer is: ``length`` bytes at ``offset`` of file ``name`` of version ``step``.

    ``checksum`` is computed by the sender over exactly these bytes (with ``checksum_algo``) and
    carried as metadata; the receiver verifies it only when its transport is configured to
    (``TcpConfig.verify_checksum``). ``total`` (the whole file's size) lets a sink reserve the
    file on the first range it sees; ``put_id`` and ``meta`` (small, opaque) are the caller's.

    Example::

        Header("run-7", step=3, name="__0_0.distcp", offset=0, length=1 << 20, total=1 << 20)
    """

    namespace: str
    step: int
    name: str
    offset: int
    length: int
    total: Optional[int] = None
    checksum: Optional[int] = None
    checksum_algo: str = ""
    put_id: str = ""
    meta: bytes = b""

    def __post_init__(self) -> None:
        for field_name in ("step", "offset", "length"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Header.{field_name} must be an int >= 0, got {value!r}")
        if self.total is not None and (not isinstance(self.total, int) or self.total < self.offset + self.length):
            raise ValueError(
                f"Header.total ({self.total!r}) must be an int >= offset + length ({self.offset + self.length})"
            )
        if self.checksum is not None and not (isinstance(self.checksum, int) and 0 <= self.checksum < 2**64):
            raise ValueError(f"Header.checksum must be an unsigned 64-bit int or None, got {self.checksum!r}")
        for field_name in ("namespace", "name", "put_id", "checksum_algo"):
            if len(getattr(self, field_name).encode()) > MAX_NAME_BYTES:
                raise ValueError(f"Header.{field_name} is longer than {MAX_NAME_BYTES} bytes")
        if not isinstance(self.meta, bytes) or len(self.meta) > MAX_META_BYTES:
            raise ValueError(f"Header.meta must be bytes of at most {MAX_META_BYTES} bytes")

    def describe(self) -> str:
        return f"{self.name} of step {self.step} (bytes [{self.offset}, {self.offset + self.length}))"


@dataclass(frozen=True)
class Endpoint:
    """Where a listener can be reached: small and picklable, published over the control plane.

    ``peer`` names the listening host (e.g. its Ray node id) so errors can name it; ``extra`` is
    backend-specific (an RDMA backend puts its agent metadata there).
    """

    transport: str
    host: str
    port: int
    peer: str = ""
    extra: bytes = b""

    def label(self) -> str:
        return f"{self.peer or 'peer'} at {self.host}:{self.port}"


@runtime_checkable
class Sink(Protocol):
    """The receiving side: where a transfer's bytes go, and what to do when it ends.

    Called on the transport's threads, possibly concurrently for different transfers; each
    method must return quickly (no waiting on other transfers): a stream is blocked meanwhile,
    and a sender waits at most ``progress_timeout_s`` for signs of progress.
    """

    def buffer_for(self, header: Header) -> memoryview:
        """A writable, contiguous view of at least ``header.length`` bytes; the transfer's byte
        ``i`` lands at index ``i``. Raise to refuse the transfer (the sender gets
        :class:`TransferRejectedError` with this message; no other call follows)."""

    def received(self, header: Header) -> None:
        """Every byte is in the view (and verified, when configured). Raise to refuse it after
        all (the sender gets :class:`TransferRejectedError`)."""

    def failed(self, header: Header, error: BaseException) -> None:
        """The transfer broke (the sender died, stalled, or sent bytes that fail the checksum).
        Once this is called the transport writes nothing more into the view."""


class Listener(abc.ABC):
    """A receiving endpoint, accepting authenticated peers until closed."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> Endpoint:
        """Where peers connect (publish it through the control plane)."""

    @abc.abstractmethod
    def abort(self, put_ids, *, timeout: float) -> None:
        """Give up on the incomplete transfers whose ``header.put_id`` is in ``put_ids``: they fail
        (``sink.failed``), and so may others from the same sender (a stream cannot be stopped
        mid-chunk without dropping its connection; the sender's sends fail at once, so it stops
        sending). Returns once no stream writes into their views any more, or raises
        :class:`ProgressTimeoutError` if one still did after ``timeout`` seconds. A transfer
        that has not begun yet is the sink's to refuse (its ``buffer_for`` raises)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting, drop every connection; incomplete transfers get ``sink.failed``."""

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Channel(abc.ABC):
    """An authenticated connection (of one or more streams) to one peer's listener.

    A channel that failed stays failed: every later send raises the first error. Connect a new
    one (the control plane says whether the peer is still alive).
    """

    @property
    @abc.abstractmethod
    def peer(self) -> str:
        """The peer's name and address, as errors name it."""

    @abc.abstractmethod
    def send_async(self, header: Header, buffer) -> "Future[None]":
        """Queue ``buffer`` (``header.length`` bytes, any contiguous buffer) for the peer. The
        future resolves when the peer's sink has the bytes (``received`` returned), or fails
        with a :class:`TransportError`. Keep ``buffer`` alive and unchanged until then."""

    def send(self, header: Header, buffer, timeout: Optional[float] = None) -> None:
        """:meth:`send_async` and wait. ``timeout`` bounds the whole transfer (None: progress
        timeouts alone decide)."""
        self.send_async(header, buffer).result(timeout)

    @abc.abstractmethod
    def close(self) -> None:
        """Close the streams; pending transfers fail with :class:`ChannelClosedError`."""

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Transport(abc.ABC):
    """A way to move bytes between host stores of one namespace (TCP today; RDMA later).

    An instance holds the namespace's secret and the sending host's bandwidth cap, shared by
    every channel it connects.
    """

    name: str = ""

    @abc.abstractmethod
    def listen(self, bind_host: str, sink: Sink, *, port: int = 0) -> Listener:
        """Accept peers on ``bind_host`` (the node address Ray reports) into ``sink``."""

    @abc.abstractmethod
    def connect(self, endpoint: Endpoint, *, marked: bool = True) -> Channel:
        """Connect to a peer's listener and authenticate (both ways) before any data moves.
        ``marked=False``: this channel's packets go in the normal class even when the transport
        marks its sends lower-effort (restore pushes and re-replication: recovery must not yield)."""

    def close(self) -> None:
        """Close every listener and channel this transport opened."""
