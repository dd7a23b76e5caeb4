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
import uuid
from concurrent.futures import Future
from typing import Callable, Optional

log = logging.getLogger("gemini_ckpt")

_HEAD = struct.Struct("<IQ")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 31
MAX_FDS = 4
_CONTEXT = b"gemini_ckpt attach v1\x00"


class AttachError(ConnectionError):
    """The attach channel broke, refused the trainer, or the store answered with an error."""


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

    def recv(self) -> tuple[dict, bytes, list[int]]:
        """The next message (header, payload, received fds); EOFError when the peer closed."""
        fds: list[int] = []
        head = self._exact(_HEAD.size, fds)
        n_head, n_payload = _HEAD.unpack(head)
        if n_head > MAX_HEADER or n_payload > MAX_PAYLOAD:
            raise AttachError(f"an attach message of {n_head} + {n_payload} bytes; refused")
        header = json.loads(self._exact(n_head, fds))
        if not isinstance(header, dict):
            raise AttachError("an attach message whose header is not an object")
        payload = self._exact(n_payload, fds) if n_payload else b""
        return header, payload, fds

    def _exact(self, n: int, fds: list[int]) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            msg, anc, _flags, _addr = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(data[: len(data) - len(data) % got.itemsize])
                    fds.extend(got)
            if not msg:
                for fd in fds:
                    os.close(fd)
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

    def __init__(self, secret: bytes, epoch: Callable[[], int], handler: Callable, closed: Callable) -> None:
        self.secret, self._epoch, self._handler, self._closed = secret, epoch, handler, closed
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
            except OSError:
                return
            threading.Thread(target=self._serve, args=(Connection(sock),), name="gemini-attach", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        rank = -1
        try:
            nonce = os.urandom(32)
            conn.send({"nonce": nonce.hex()})
            hello, _, fds = conn.recv()
            _close_all(fds)
            rank, epoch = int(hello.get("rank", -1)), int(hello.get("epoch", -1))
            if not hmac.compare_digest(str(hello.get("proof", "")), proof(self.secret, nonce, rank, epoch)):
                log.warning("attach: a connection that does not prove the namespace's secret was refused")
                conn.send({"ok": False, "error": "refused: the proof does not match this store's secret"})
                return
            if epoch != self._epoch():
                conn.send({"ok": False, "error": f"refused: epoch {epoch} is not this store's ({self._epoch()})"})
                return
            conn.send({"ok": True})
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
            if rank >= 0:
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
            greeting, _, _ = self.conn.recv()
            nonce = bytes.fromhex(greeting["nonce"])
            self.conn.send({"rank": rank, "epoch": epoch, "proof": proof(secret, nonce, rank, epoch)})
            verdict, _, _ = self.conn.recv()
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
                raise AttachError(f"rank {self.rank}: the attach channel is broken: {self._broken}")
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
                raise AttachError(f"rank {self.rank}: the attach channel is broken: {self._broken}")
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
                    fut.set_exception(AttachError(f"the attach channel is broken: {self._broken}"))
            return fut

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
