"""The attach channel: a training process and the host store of its own node, over a local socket.

Ray is the control plane between hosts; between a training process and its node's host store
the path is shorter: an abstract Unix socket the store listens on (its name comes from the
store through Ray at ``attach``). Over it the store lends its segments (memfds, passed with
``SCM_RIGHTS``: the trainer maps the same pages, and the memory stays the store's when the
trainer dies) and learns of each staged shard; the trainer learns each version's outcome.
A message the trainer sent before it died is still delivered (the kernel holds it), and the
store sees the connection close at once, so a version waiting for that rank fails quickly.

Wire format, both ways: ``u32 header length | u64 payload length | header (JSON) | payload``;
file descriptors ride with the first bytes of a message. The first exchange proves the
trainer knows the namespace's secret: the store sends a nonce, the trainer answers
``HMAC-SHA256(secret, "attach" | nonce | rank | epoch)``; anything else closes the socket.

The socket is abstract, so any process of the node can connect. Until its proof checks, a
connection is a stranger's and gets little: a process of another uid is refused at accept
(``SO_PEERCRED``), the whole handshake has :data:`HANDSHAKE_DEADLINE_S`, at most
:data:`MAX_HELLO` bytes are read (a message declaring more is refused unread), and file
descriptors passed with the hello are closed whatever it proves. Refusals are logged at most
once per ten seconds, with a count.

Messages (trainer -> store, each with an ``id`` the reply carries):

- ``plan``: payload = an encoded ShardPlan of this rank; reply ``{}``;
- ``segment`` ``{plan_id}``: a free segment for a version of that plan; reply ``{seg, nbytes}``
  (with the memfd the first time this connection sees that segment);
- ``staged`` ``{step, seg, persist, lengths}``, payload = the value blobs: the shard is the
  store's now; no reply, but later an ``outcome`` ``{step, committed, reason}`` (id 0);
- ``give_back`` ``{seg}``: a segment not staged after all;
- ``map`` ``{step, rank}``: read access to a shard this store holds; reply ``{nbytes}`` + memfd
  (the shard is pinned until ``unmap`` ``{step, rank}`` or the connection closes).

Standard library only.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional

from ..errors import AttachError
from .transport._tcp import LogThrottle

log = logging.getLogger("gemini_ckpt")

_HEAD = struct.Struct("<IQ")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 31
MAX_FDS = 4
_CONTEXT = b"gemini_ckpt attach v1\x00"

HANDSHAKE_DEADLINE_S = 5.0
"""Seconds from accept to a verified proof (the store's greeting, the trainer's hello); past it
the connection is closed. A trainer answers at once; a module constant for now (an
``AttachServer`` argument once a deployment needs to tune it)."""

MAX_HELLO = 4 << 10
"""Bytes the store reads of a message before its proof checks (the hello is a JSON header of
rank, epoch and proof, about 150 bytes, and no payload); a message declaring more is refused
before any of it is read."""

_LOG_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerCredentials(NamedTuple):
    """Who is at the other end of a Unix socket, as the kernel says (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process's pid, uid and gid (Linux ``SO_PEERCRED``; what it was at connect)."""
    return PeerCredentials(*_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              _PEERCRED.size)))


def peer_refusal(peer: PeerCredentials, uid: int) -> Optional[str]:
    """Why ``peer`` may not attach to a store serving ``uid`` (None: it may). Only processes of the
    store's own user: anyone else on the node could reach the abstract socket, and a process of
    the same user could read the store's memory anyway.

    Example::

        peer_refusal(PeerCredentials(pid=4242, uid=1001, gid=1001), uid=1000)  # "pid 4242 runs as uid 1001, ..."
    """
    if peer.uid != uid:
        return (f"pid {peer.pid} runs as uid {peer.uid}, the host store as uid {uid}: only processes of the "
                f"store's own user may attach")
    return None


def proof(secret: bytes, nonce: bytes, rank: int, epoch: int) -> str:
    return hmac.new(secret, _CONTEXT + nonce + f"{rank}:{epoch}".encode(), hashlib.sha256).hexdigest()


# --- framing ---------------------------------------------------------------------------------------
class Connection:
    """One end of an attach socket: whole messages, with file descriptors, thread-safe sends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, header: dict, payload: bytes = b"", fds: tuple[int, ...] = ()) -> None:
        head = json.dumps(header, separators=(",", ":")).encode()
        data = _HEAD.pack(len(head), len(payload)) + head
        with self._send_lock:
            if fds:
                self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.sendall(data)
            if payload:
                self.sock.sendall(payload)

    def recv(self, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD,
             deadline: Optional[float] = None) -> tuple[dict, bytes, list[int]]:
        """The next message (header, payload, received fds); EOFError when the peer closed,
        AttachError when it declares more than ``max_header`` / ``max_payload`` bytes (refused
        before they are read), TimeoutError past ``deadline`` (monotonic; None: the socket's
        timeout per call). Whatever fails, the fds that came with it are closed."""
        fds: list[int] = []
        try:
            head = self._exact(_HEAD.size, fds, deadline)
            n_head, n_payload = _HEAD.unpack(head)
            if n_head > max_header or n_payload > max_payload:
                raise AttachError(f"an attach message of {n_head} + {n_payload} bytes (at most {max_header} + "
                                  f"{max_payload} here); refused")
            header = json.loads(self._exact(n_head, fds, deadline))
            if not isinstance(header, dict):
                raise AttachError("an attach message whose header is not an object")
            payload = self._exact(n_payload, fds, deadline) if n_payload else b""
        except BaseException:
            _close_all(fds)
            raise
        return header, payload, fds

    def _exact(self, n: int, fds: list[int], deadline: Optional[float] = None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the attach handshake took too long")
                self.sock.settimeout(left)
            msg, anc, _flags, _addr = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(data[: len(data) - len(data) % got.itemsize])
                    fds.extend(got)
            if not msg:
                raise EOFError("the attach socket closed")
            buf += msg
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# --- the store's side --------------------------------------------------------------------------
class AttachServer:
    """Accepts the training processes of this node. ``handler(conn, rank, header, payload,
    fds)`` answers each message (return ``(reply header, payload, fds)`` or None for no reply;
    raise to send an error reply); ``closed(conn, rank)`` runs when a trainer's socket closes."""

    def __init__(self, secret: bytes, epoch: Callable[[], int], handler: Callable, closed: Callable, *,
                 uid: Optional[int] = None) -> None:
        """``uid``: the user whose processes may attach (default: this process's; see
        :func:`peer_refusal`)."""
        self.secret, self._epoch, self._handler, self._closed = secret, epoch, handler, closed
        self._uid = os.getuid() if uid is None else uid
        self._deadline_s = HANDSHAKE_DEADLINE_S
        self._refusals = LogThrottle(_LOG_EVERY_S)
        self.address = f"\0gemini-ckpt-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._stop = False
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="gemini-attach-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._stop:
                    return
                self._refused(f"accept failed ({exc})")  # out of fds, say: keep serving once they are back
                time.sleep(0.1)
                continue
            try:
                reason = peer_refusal(peer_credentials(sock), self._uid)
            except OSError as exc:
                reason = f"its credentials could not be read ({exc})"
            if reason is not None:
                sock.close()
                self._refused(f"refused a connection: {reason}")
                continue
            threading.Thread(target=self._serve, args=(Connection(sock),), name="gemini-attach", daemon=True).start()

    def _refused(self, what: str) -> None:
        if (n := self._refusals.due()) is not None:
            log.warning("attach: %s (%d refusals since the last line)", what, n)

    def _handshake(self, conn: Connection) -> int:
        """The trainer's rank once it proved the secret for this epoch, else -1 (the caller
        closes the socket). Nothing of a stranger's is kept: at most MAX_HELLO bytes are read,
        by the deadline, and fds it passed are closed."""
        deadline = time.monotonic() + self._deadline_s
        conn.sock.settimeout(self._deadline_s)
        nonce = os.urandom(32)
        try:
            conn.send({"nonce": nonce.hex()})
            hello, _, fds = conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
        except EOFError:
            return -1
        except TimeoutError:
            self._refused(f"a connection did not prove the namespace's secret within {self._deadline_s:g}s")
            return -1
        except (OSError, ValueError, AttachError) as exc:
            self._refused(f"a connection sent a malformed hello ({exc})")
            return -1
        _close_all(fds)  # a hello carries none, whatever it proves
        try:
            rank, epoch = int(hello.get("rank", -1)), int(hello.get("epoch", -1))
        except (TypeError, ValueError):
            rank = epoch = -1
        conn.sock.settimeout(max(0.1, deadline - time.monotonic()))
        if rank < 0 or not hmac.compare_digest(str(hello.get("proof", "")), proof(self.secret, nonce, rank, epoch)):
            self._refused("a connection that does not prove the namespace's secret was refused")
            conn.send({"ok": False, "error": "refused: the proof does not match this store's secret"})
            return -1
        if epoch != self._epoch():
            conn.send({"ok": False, "error": f"refused: epoch {epoch} is not this store's ({self._epoch()})"})
            return -1
        conn.send({"ok": True})
        conn.sock.settimeout(None)
        return rank

    def _serve(self, conn: Connection) -> None:
        rank = -1
        try:
            rank = self._handshake(conn)
            if rank < 0:
                return
            with self._lock:
                self._conns.add(conn)
            while True:
                header, payload, fds = conn.recv()
                rid = header.get("id", 0)
                try:
                    out = self._handler(conn, rank, header, payload, fds)
                except Exception as exc:  # noqa: BLE001 - the trainer gets the error as the reply
                    out = ({"error": f"{type(exc).__name__}: {exc}", "kind": type(exc).__name__}, b"", ())
                if out is not None and rid:
                    reply, data, out_fds = out
                    conn.send({**reply, "id": rid}, data, tuple(out_fds))
        except (EOFError, OSError, ValueError, AttachError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if rank >= 0:  # only a trainer that attached detaches
                self._closed(conn, rank)

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            conn.close()


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# --- the trainer's side ------------------------------------------------------------------------
class AttachClient:
    """A training process's channel to its host store (see the module docstring)."""

    def __init__(self, address: str, secret: bytes, *, rank: int, epoch: int, timeout_s: float) -> None:
        self.rank, self.epoch, self.timeout_s = rank, epoch, timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            raise AttachError(f"rank {rank}: cannot reach the host store's attach socket: {exc}") from None
        self.conn = Connection(sock)
        try:
            deadline = time.monotonic() + timeout_s
            greeting, _, fds = self.conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
            _close_all(fds)
            nonce = bytes.fromhex(greeting["nonce"])
            self.conn.send({"rank": rank, "epoch": epoch, "proof": proof(secret, nonce, rank, epoch)})
            verdict, _, fds = self.conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
            _close_all(fds)
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

    def request(self, header: dict, payload: bytes = b"", *, timeout: Optional[float] = None
                ) -> tuple[dict, list[int]]:
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
            _close_all(fds)
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
        return AttachError(f"rank {self.rank}: the attach channel to this host's host store is broken (the "
                           f"store died or closed it): {self._broken}")

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
                    elif header.get("type") == "outcome":
                        step = int(header["step"])
                        fut = self._outcomes.get(step)
                        if fut is None:
                            self._early[step] = header
                            continue
                    else:
                        fut = None
                if fut is None:
                    _close_all(fds)
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
                    fut.set_exception(AttachError(f"rank {self.rank}: the host store's attach socket closed "
                                                  f"({type(exc).__name__}: {exc}); the store died or restarted"))

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
