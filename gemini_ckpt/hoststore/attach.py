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
(``SO_PEERCRED``), the whole handshake has
:attr:`~gemini_ckpt.timeouts.Timeouts.handshake_s`, at most
:data:`MAX_HELLO` bytes are read (a message declaring more is refused unread), and file
descriptors passed with the hello are closed whatever it proves. Refusals are logged at most
once per ten seconds, with a count.

Messages carry an ``id`` the reply carries (0: none wanted, and the store's unasked
outcome of a version); what they say is typed in :mod:`gemini_ckpt.hoststore.attach_messages`.

This module holds what both ends share: the framing (:class:`Connection`) and the proof. The
store's end is :mod:`gemini_ckpt.hoststore.attach_server`, the trainer's :mod:`gemini_ckpt.hoststore.attach_client`.

Standard library only.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from typing import Optional

from ..errors import AttachError

_HEAD = struct.Struct("<IQ")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 31
MAX_FDS = 4
_CONTEXT = b"gemini_ckpt attach v1\x00"

PROTOCOL = 3
"""The attach channel's version. Host stores are detached and outlive jobs: a trainer of one
gemini_ckpt version must not attach to a store left running by another (an older store that
leaves the health verdict out of its records made a NaN step healthy). Each end names its
version in the handshake and refuses another; change it with any change of the messages
(3: the outcome says whether every shard carries a verdict, ``checked``)."""

RESTART_STORES = (
    "end the old host stores (they are detached Ray actors: `ray stop` on a cluster of your own, "
    "or ray.kill() on each actor `gemini_ckpt status` lists) and run the job again"
)

MAX_HELLO = 4 << 10
"""Bytes the store reads of a message before its proof checks (the hello is a JSON header of
rank, epoch and proof, about 150 bytes, and no payload); a message declaring more is refused
before any of it is read."""


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

    def recv(
        self, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD, deadline: Optional[float] = None
    ) -> tuple[dict, bytes, list[int]]:
        """The next message (header, payload, received fds); EOFError when the peer closed,
        AttachError when it declares more than ``max_header`` / ``max_payload`` bytes (refused
        before they are read), TimeoutError past ``deadline`` (monotonic; None: the socket's
        timeout per call). Whatever fails, the fds that came with it are closed."""
        fds: list[int] = []
        try:
            head = self._exact(_HEAD.size, fds, deadline)
            n_head, n_payload = _HEAD.unpack(head)
            if n_head > max_header or n_payload > max_payload:
                raise AttachError(
                    f"an attach message of {n_head} + {n_payload} bytes (at most {max_header} + "
                    f"{max_payload} here); refused"
                )
            header = json.loads(self._exact(n_head, fds, deadline))
            if not isinstance(header, dict):
                raise AttachError("an attach message whose header is not an object")
            payload = self._exact(n_payload, fds, deadline) if n_payload else b""
        except BaseException:
            close_all(fds)
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
            # MSG_CMSG_CLOEXEC: the received segment and comm-page fds are not inherited by a
            # child process the trainer starts (they would keep the memory after both ends close).
            msg, anc, _flags, _addr = self.sock.recvmsg(
                n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
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


def close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
