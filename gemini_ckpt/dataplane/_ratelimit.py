"""A token bucket: the sending host's bandwidth cap, shared by every stream of every channel."""

from __future__ import annotations

import threading
import time

_PIECE_SECONDS = 0.02  # one grant is about this long at the full rate: waits stay short
_MIN_PIECE = 16 << 10
_MAX_PIECE = 1 << 20


class TokenBucket:
    """At most ``rate`` bytes/s on average, bursts of at most ``burst`` bytes.

    ``acquire(n)`` books ``n`` bytes at once and sleeps until the bucket would have held them
    (a debt model: callers queue in arrival order without a condition variable, and a big grant
    never starves small ones for long). Senders ask for :attr:`piece` bytes at a time, so every
    stream keeps moving and a waiting stream never waits much longer than
    ``streams x piece / rate``.

    Example::

        bucket = TokenBucket(128 << 20)   # 128 MiB/s for the whole host
    """

    def __init__(self, rate: float, burst: int | None = None) -> None:
        if not rate > 0:
            raise ValueError(f"TokenBucket rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.piece = int(min(_MAX_PIECE, max(_MIN_PIECE, self.rate * _PIECE_SECONDS)))
        self.burst = int(burst) if burst is not None else self.piece
        self._tokens = float(self.burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> float:
        """Take ``n`` bytes' worth, sleeping as needed; returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait
