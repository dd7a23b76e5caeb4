"""The trainer's end of the attach channel (:mod:`gemini_ckpt.hoststore.attach`): it proves the
namespace's secret, then sends requests, matches replies to them, and collects each version's
outcome, on a reader thread of its own.

Standard library only.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from concurrent.futures import Future
from typing import Optional

from ..errors import AttachError
from .attach import MAX_HELLO, PROTOCOL, RESTART_STORES, Connection, close_all, proof
from .attach_messages import VersionOutcome


QUEUE_WAIT_S = 1.0
"""The longest one try of :func:`connect_until` waits in the kernel for room in the store's queue."""


def connect_until(address: str, deadline: float) -> socket.socket:
    """A connected socket to ``address``, trying again until ``deadline`` (monotonic) while the
    listener's queue is full (EAGAIN: a burst of connections, or another local user flooding the
    socket). The last error past the deadline.

    Each try is a blocking connect bounded by ``SO_SNDTIMEO`` (at most :data:`QUEUE_WAIT_S`): it
    waits in the kernel's queue of the listener's waiters, and every connection the store accepts
    wakes one of them. Tries of non-blocking connects with sleeps between them lost the race for
    each freed slot to processes connecting in a tight loop (four such: 3-15 s to get in here, and
    a CI run in which one trainer did not get in within its 120 s)."""
    while True:
        wait = max(0.05, min(QUEUE_WAIT_S, deadline - time.monotonic()))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(wait))
            sock.connect(address)  # blocking: a full queue is waited on, for ``wait`` at most
            # A signal that interrupts the wait makes CPython take it for a connection in progress
            # (as for TCP) and return without one: ENOTCONN here, and another try.
            sock.getpeername()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))  # later sends: as before
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            return sock
        except (BlockingIOError, InterruptedError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise OSError(exc.errno, f"the store's attach queue stayed full ({exc.strerror})") from None
        except OSError as exc:
            sock.close()
            if exc.errno != errno.ENOTCONN or time.monotonic() >= deadline:
                raise


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class _Skew(Exception):
    """The store's greeting names another attach protocol (args[0]; 1: it names none)."""


# --- the trainer's side ------------------------------------------------------------------------
class AttachClient:
    """A training process's channel to its host store (see :mod:`gemini_ckpt.hoststore.attach`)."""

    def __init__(self, address: str, secret: bytes, *, rank: int, epoch: int, timeout_s: float) -> None:
        self.rank, self.epoch, self.timeout_s = rank, epoch, timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            sock = connect_until(address, deadline)
        except OSError as exc:
            raise AttachError(
                f"rank {rank}: cannot reach the host store's attach socket within {timeout_s:g}s: {exc}"
            ) from None
        self.conn = Connection(sock)
        try:
            greeting, _, fds = self.conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
            close_all(fds)
            nonce = bytes.fromhex(greeting["nonce"])
            if greeting.get("protocol") != PROTOCOL:
                raise _Skew(greeting.get("protocol", 1))
            self.conn.send(
                {"rank": rank, "epoch": epoch, "proof": proof(secret, nonce, rank, epoch), "protocol": PROTOCOL}
            )
            verdict, _, fds = self.conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
            close_all(fds)
        except _Skew as skew:
            self.conn.close()
            raise AttachError(
                f"rank {rank}: the host store on this node speaks attach protocol {skew.args[0]!r} and "
                f"this trainer {PROTOCOL}: the store was started by another gemini_ckpt version; "
                f"{RESTART_STORES}"
            ) from None
        except (EOFError, OSError, KeyError, ValueError) as exc:
            self.conn.close()
            raise AttachError(f"rank {rank}: the host store closed the attach socket ({exc})") from None
        if not verdict.get("ok"):
            self.conn.close()
            raise AttachError(f"rank {rank}: the host store {verdict.get('error', 'refused the trainer')}")
        sock.settimeout(None)
        self._lock = threading.Lock()
        self._next = 1
        self._replies: dict[int, Future] = {}
        self._outcomes: dict[int, Future] = {}
        self._early: dict[int, dict] = {}
        self._broken: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._read, name="gemini-attach-client", daemon=True)
        self._thread.start()

    def request(self, header: dict, payload: bytes = b"", *, timeout: Optional[float] = None) -> tuple[dict, list[int]]:
        """Send a message and wait for its reply: ``(reply header, received fds)``."""
        return self.reply(self.request_async(header, payload), timeout=timeout)

    def request_async(self, header: dict, payload: bytes = b"") -> Future:
        """Send a message; :meth:`reply` of the returned future waits for its answer."""
        fut: Future = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken_error()
            rid, self._next = self._next, self._next + 1
            self._replies[rid] = fut
        self.conn.send({**header, "id": rid}, payload)
        return fut

    def reply(self, fut: Future, *, timeout: Optional[float] = None) -> tuple[dict, list[int]]:
        reply, fds = fut.result(timeout=self.timeout_s if timeout is None else timeout)
        if "error" in reply:
            close_all(fds)
            raise _error(reply)
        return reply, fds

    def send(self, header: dict, payload: bytes = b"") -> None:
        """A message without a reply."""
        with self._lock:
            if self._broken is not None:
                raise self._broken_error()
        self.conn.send({**header, "id": 0}, payload)

    def outcome(self, step: int) -> Future:
        """The future of ``step``'s outcome message (register it before staging the step)."""
        with self._lock:
            fut = self._outcomes.get(step)
            if fut is None:
                fut = self._outcomes[step] = Future()
                early = self._early.pop(step, None)
                if early is not None:
                    fut.set_result(early)
                elif self._broken is not None:
                    fut.set_exception(self._broken_error())
            return fut

    def _broken_error(self) -> AttachError:
        return AttachError(
            f"rank {self.rank}: the attach channel to this host's host store is broken (the "
            f"store died or closed it): {self._broken}"
        )

    def forget_outcome(self, step: int) -> None:
        with self._lock:
            self._outcomes.pop(step, None)

    def _read(self) -> None:
        try:
            while True:
                header, _payload, fds = self.conn.recv()
                rid = header.get("id", 0)
                with self._lock:
                    if rid:
                        fut = self._replies.pop(rid, None)
                    elif header.get("type") == VersionOutcome.TYPE:
                        step = int(header["step"])
                        fut = self._outcomes.get(step)
                        if fut is None:
                            self._early[step] = header
                            continue
                    else:
                        fut = None
                if fut is None:
                    close_all(fds)
                elif rid:
                    fut.set_result((header, fds))
                elif not fut.done():
                    fut.set_result(header)
        except (EOFError, OSError, ValueError) as exc:
            with self._lock:
                self._broken = exc
                pending = list(self._replies.values()) + [f for f in self._outcomes.values() if not f.done()]
                self._replies = {}
            for fut in pending:
                if not fut.done():
                    fut.set_exception(
                        AttachError(
                            f"rank {self.rank}: the host store's attach socket closed "
                            f"({type(exc).__name__}: {exc}); the store died or restarted"
                        )
                    )

    def close(self) -> None:
        self.conn.close()
        self._thread.join(timeout=5)


def _error(reply: dict) -> BaseException:
    kind, message = reply.get("kind", ""), reply.get("error", "")
    if kind == "MemoryError":
        return MemoryError(message)
    if kind == "PermissionError":
        return PermissionError(message)
    if kind in ("LookupError", "KeyError"):
        return LookupError(message)
    if kind == "ValueError":
        return ValueError(message)
    return AttachError(message)
