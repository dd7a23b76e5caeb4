"""Interleaving: a sending host's replication yields to its training processes' collectives.

An :class:`IdleGate` sits beside the bandwidth cap (one per sending host, shared by every stream
of every channel). Before each piece of a transfer, a stream takes the gate's turn (one piece in
flight per host), waits until the host's training collectives are idle (the
:class:`CommSignal`: the comm state its ranks mark, :mod:`gemini_ckpt.format.commstate`), writes
the piece, and waits until no more than that piece is left in the kernel (the one before it is on
the wire and acknowledged), which also measures the rate the link takes bytes at. So the link
stays busy from piece to piece, and what a collective can find queued ahead of its own bytes is at
most two pieces, each sized by :func:`choose_chunk` for half of ``fraction``: together they delay
the collective by at most ``fraction`` (2%) of its measured duration.

Never stuck: a mark older than ``stale_s`` is ignored (a rank died or hung mid-collective; the
store also clears a detached rank's marks), and after ``patience_s`` of waiting one piece goes
anyway, still sized by the 2% rule, so replication trickles on under back-to-back collectives and
versions commit or fail by their usual timeouts. The channel caps the patience at a third of its
progress timeout: a receiver in the middle of a transfer that hears nothing for that long takes
the sender for dead. Waiting is the sender's own time: its progress (stall) check counts only
bytes the peer owes.

While no rank has ever marked a collective (``signal.active()`` false), the gate is not in the
way at all: streams send as they do without it.

Standard library only (see the package docstring).
"""

from __future__ import annotations

import fcntl
import sys
import termios
import threading
import time
from typing import Callable, Optional, Protocol

MIN_CHUNK = 16 << 10
MAX_CHUNK = 4 << 20
FRACTION = 0.02  # larger slowed FSDP2's collectives on slow links; this much did not (docs/interleave.md)
_POLL_S = 0.0005
_IDLE_POLL_MAX_S = 0.002  # how late, at most, the gate notices that training went idle
_SLEEP_MAX_S = 0.05  # the longest a waiting piece sleeps without looking (the checks run between)
_RECENT_S = 1.0  # a socket counts in the queue bound while a piece went to it this recently
_RATE_WINDOW_S = 0.02  # watching time per rate sample


def choose_chunk(
    rate: Optional[float],
    collective_s: Optional[float],
    *,
    fraction: float = FRACTION,
    lo: int = MIN_CHUNK,
    hi: int = MAX_CHUNK,
) -> int:
    """Bytes per piece so that one piece in flight, at ``rate`` bytes/s, delays a collective of
    ``collective_s`` seconds by at most ``fraction`` of it, within ``[lo, hi]``. Without a rate
    measured yet, ``lo``; without a collective measured yet, ``hi``.

    Example::

        choose_chunk(125e6, 0.1)    # 1 Gbit/s, 100 ms all-reduce: 250,000 bytes (2 ms of link)
    """
    if not rate or rate <= 0:
        return lo
    if collective_s is None:
        return hi
    return int(min(hi, max(lo, rate * collective_s * fraction)))


class CommSignal(Protocol):
    """What the gate reads: the host's training collectives (a comm state)."""

    def busy(self, *, stale_s: float) -> bool: ...

    def collective_s(self) -> Optional[float]: ...

    def busy_since(self, *, stale_s: float, now: Optional[float] = None) -> Optional[float]: ...

    def active(self) -> bool: ...


def unsent_bytes(sock) -> int:
    """Bytes the kernel holds for the socket, not yet acknowledged by the peer (Linux SIOCOUTQ)."""
    buf = bytearray(4)  # an int (no struct.Struct here: the package is pickled by value)
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    return int.from_bytes(buf, sys.byteorder, signed=True)


class IdleGate:
    """Sends pieces only while ``signal`` says training's collectives are idle (module docstring).

    Example::

        gate = IdleGate(comm_state)
        TcpTransport(secret, "run-7", gate=gate)
        gate.stats()   # {"waited_s": ..., "pieces": ..., "chunk_bytes": ..., "rate": ...}
    """

    def __init__(
        self,
        signal: CommSignal,
        *,
        fraction: float = FRACTION,
        stale_s: float = 10.0,
        patience_s: float = 1.0,
        lo: int = MIN_CHUNK,
        hi: int = MAX_CHUNK,
    ) -> None:
        self.signal = signal
        self.fraction, self.stale_s, self.patience_s, self.lo, self.hi = fraction, stale_s, patience_s, lo, hi
        self._turn = threading.Lock()
        self._lock = threading.Lock()
        self.rate: Optional[float] = None  # bytes/s the link took our pieces at (running mean)
        self.waited_s = 0.0
        self.pieces = 0
        self.forced = 0  # pieces sent after patience_s although training was busy
        self.gated_bytes = 0
        self._engaged = False
        self._acc_bytes, self._acc_s = 0, 0.0  # drained while watched, toward the next rate sample
        self._socks: dict[int, tuple] = {}  # id -> (socket, when a piece last went to it); under _turn

    def engaged(self) -> bool:
        """Whether pieces go through the gate (a rank of this host has marked a collective; once
        it has, for good)."""
        if not self._engaged:
            self._engaged = self.signal.active()
        return self._engaged

    def piece(self) -> int:
        """Bytes of the next piece: two of them queued delay a collective by at most ``fraction``."""
        return choose_chunk(self.rate, self.signal.collective_s(), fraction=self.fraction / 2, lo=self.lo, hi=self.hi)

    def send(
        self,
        sock,
        view: memoryview,
        send: Callable[[memoryview], int],
        check: Callable[[], None],
        *,
        patience_s: Optional[float] = None,
    ) -> None:
        """Write ``view`` (one piece, at most :meth:`piece` bytes) through ``send`` once training is
        idle (or after ``patience_s``, default :attr:`patience_s`), then wait for the kernel to pass
        it on until at most this piece is left in the kernel, over every socket this gate has
        written to (a host's streams and peers together); ``check`` runs every poll (it raises
        when the channel failed or the peer stalled)."""
        with self._turn:
            waited = self._wait_idle(check, self.patience_s if patience_s is None else patience_s)
            self._socks[id(sock)] = (sock, time.monotonic())
            pos = 0
            while pos < len(view):
                pos += send(view[pos:])
            n = len(view)
            start = time.monotonic()
            before = left = self._queued()
            while left > n:
                check()
                time.sleep(_POLL_S)
                left = self._queued()
            took = time.monotonic() - start
            with self._lock:
                self.waited_s += waited
                self.pieces += 1
                self.gated_bytes += n
                drained = before - left
                # the rate from what left the queue while we watched it: a link's, not a burst's
                # into an empty socket buffer (a piece written after idle is not measured), over
                # at least _RATE_WINDOW_S of watching once a first sample sized the pieces: one
                # piece's few milliseconds measured a shaper's token bucket at up to twice the
                # link, and so pieces twice too large
                if took > 0 and drained >= self.lo:
                    self._acc_bytes += drained
                    self._acc_s += took
                if self._acc_s >= (_RATE_WINDOW_S if self.rate is not None else 0.0) and self._acc_bytes:
                    sample = self._acc_bytes / self._acc_s
                    self._acc_bytes, self._acc_s = 0, 0.0
                    self.rate = sample if self.rate is None else 0.7 * self.rate + 0.3 * sample

    def _queued(self) -> int:
        """Bytes the kernel holds, unsent or unacknowledged, over the sockets pieces went to within
        the last ``_RECENT_S`` (a closed one, or one not written to since, is forgotten: a dead
        peer's unacknowledged bytes must not hold back the others). One stream's queue is not the
        bound: a host's four streams to a peer, each with a piece queued, would put four pieces
        ahead of a collective."""
        total, now = 0, time.monotonic()
        for key, (sock, wrote) in list(self._socks.items()):
            try:
                if now - wrote <= _RECENT_S:
                    total += unsent_bytes(sock)
                    continue
            except (OSError, ValueError):  # closed (fileno -1) or gone
                pass
            del self._socks[key]
        return total

    def _wait_idle(self, check: Callable[[], None], patience_s: float) -> float:
        start = time.monotonic()
        pause = _POLL_S
        while self.signal.busy(stale_s=self.stale_s):
            check()
            now = time.monotonic()
            if now - start >= patience_s:
                with self._lock:
                    self.forced += 1
                break
            time.sleep(min(max(pause, self._until_near_end(now)), max(0.0, start + patience_s - now)))
            pause = min(2 * pause, _IDLE_POLL_MAX_S)
        return time.monotonic() - start

    def _until_near_end(self, now: float) -> float:
        """How long to sleep before polling again: until 80% of a usual collective has passed
        since the one in flight began (polls every millisecond through a 100 ms all-gather take
        CPU the collective's own threads want), at most ``_SLEEP_MAX_S``."""
        mean = self.signal.collective_s()
        began = self.signal.busy_since(stale_s=self.stale_s, now=now) if mean is not None else None
        if began is None:
            return 0.0
        return min(_SLEEP_MAX_S, max(0.0, began + 0.8 * mean - now))

    def stats(self) -> dict:
        with self._lock:
            return {
                "engaged": self.engaged(),
                "waited_s": round(self.waited_s, 6),
                "pieces": self.pieces,
                "forced": self.forced,
                "gated_bytes": self.gated_bytes,
                "chunk_bytes": self.piece(),
                "rate": self.rate,
                "collective_s": self.signal.collective_s(),
            }
