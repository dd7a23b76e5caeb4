"""The store's end of the attach channel (:mod:`gemini_ckpt.hoststore.attach`): who may connect (the
kernel's word on the peer's uid), the handshake a connection must pass before it is served, and
the accept and serve threads that hand each trainer's messages to the host store.

Standard library only.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
import uuid
from typing import Callable, NamedTuple, Optional

from ..errors import AttachError
from ..timeouts import TIMEOUTS
from .attach import MAX_HELLO, PROTOCOL, RESTART_STORES, Connection, close_all, proof
from ..dataplane._tcp import LogThrottle

log = logging.getLogger("gemini_ckpt")


_LOG_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerCredentials(NamedTuple):
    """Who is at the other end of a Unix socket, as the kernel says (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process's pid, uid and gid (Linux ``SO_PEERCRED``; what it was at connect)."""
    return PeerCredentials(*_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)))


def peer_refusal(peer: PeerCredentials, uid: int) -> Optional[str]:
    """Why ``peer`` may not attach to a store serving ``uid`` (None: it may). Only processes of the
    store's own user: anyone else on the node could reach the abstract socket, and a process of
    the same user could read the store's memory anyway.

    Example::

        peer_refusal(PeerCredentials(pid=4242, uid=1001, gid=1001), uid=1000)  # "pid 4242 runs as uid 1001, ..."
    """
    if peer.uid != uid:
        return (
            f"pid {peer.pid} runs as uid {peer.uid}, the host store as uid {uid}: only processes of the "
            f"store's own user may attach"
        )
    return None


# --- the store's side --------------------------------------------------------------------------
class AttachServer:
    """Accepts the training processes of this node. ``handler(conn, rank, header, payload,
    fds)`` answers each message (return ``(reply header, payload, fds)`` or None for no reply;
    raise to send an error reply); ``closed(conn, rank)`` runs when a trainer's socket closes."""

    def __init__(
        self, secret: bytes, epoch: Callable[[], int], handler: Callable, closed: Callable, *, uid: Optional[int] = None
    ) -> None:
        """``uid``: the user whose processes may attach (default: this process's; see
        :func:`peer_refusal`)."""
        self.secret, self._epoch, self._handler, self._closed = secret, epoch, handler, closed
        self._uid = os.getuid() if uid is None else uid
        self._deadline_s = TIMEOUTS.handshake_s  # from accept to a verified proof; past it, closed
        self._refusals = LogThrottle(_LOG_EVERY_S)
        self.address = f"\0gemini-ckpt-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._stop = False
        self._conns: set[Connection] = set()
        self._epochs: dict[Connection, int] = {}  # a trainer's connection -> the epoch it attached in
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

    def _handshake(self, conn: Connection) -> tuple[int, int]:
        """The trainer's rank and epoch once it proved the secret for this epoch, else (-1, -1)
        (the caller closes the socket). Nothing of a stranger's is kept: at most MAX_HELLO bytes are read,
        by the deadline, and fds it passed are closed."""
        deadline = time.monotonic() + self._deadline_s
        conn.sock.settimeout(self._deadline_s)
        nonce = os.urandom(32)
        try:
            conn.send({"nonce": nonce.hex(), "protocol": PROTOCOL})
            hello, _, fds = conn.recv(max_header=MAX_HELLO, max_payload=0, deadline=deadline)
        except EOFError:
            return -1, -1
        except TimeoutError:
            self._refused(f"a connection did not prove the namespace's secret within {self._deadline_s:g}s")
            return -1, -1
        except (OSError, ValueError, AttachError) as exc:
            self._refused(f"a connection sent a malformed hello ({exc})")
            return -1, -1
        close_all(fds)  # a hello carries none, whatever it proves
        try:
            rank, epoch = int(hello.get("rank", -1)), int(hello.get("epoch", -1))
        except (TypeError, ValueError):
            rank = epoch = -1
        conn.sock.settimeout(max(0.1, deadline - time.monotonic()))
        if rank < 0 or not hmac.compare_digest(str(hello.get("proof", "")), proof(self.secret, nonce, rank, epoch)):
            self._refused("a connection that does not prove the namespace's secret was refused")
            conn.send({"ok": False, "error": "refused: the proof does not match this store's secret"})
            return -1, -1
        if hello.get("protocol") != PROTOCOL:
            self._refused(
                f"refused a trainer of attach protocol {hello.get('protocol', 1)!r} (this store's: {PROTOCOL})"
            )
            conn.send(
                {
                    "ok": False,
                    "error": f"refused: this host store speaks attach protocol {PROTOCOL} and the "
                    f"trainer {hello.get('protocol', 1)!r}: they come from different "
                    f"gemini_ckpt versions; {RESTART_STORES}",
                }
            )
            return -1, -1
        if epoch != self._epoch():
            conn.send({"ok": False, "error": f"refused: epoch {epoch} is not this store's ({self._epoch()})"})
            return -1, -1
        conn.send({"ok": True})
        conn.sock.settimeout(None)
        return rank, epoch

    def _serve(self, conn: Connection) -> None:
        rank = -1
        with self._lock:  # known before the handshake, so a close() during it closes this one too
            if self._stop:
                conn.close()
                return
            self._conns.add(conn)
        try:
            rank, epoch = self._handshake(conn)
            if rank < 0:
                return
            with self._lock:
                self._epochs[conn] = epoch
            while True:
                header, payload, fds = conn.recv()
                rid = header.get("id", 0)
                if epoch != self._epoch():  # a newer epoch fenced this trainer (a zombie's connection)
                    close_all(fds)
                    conn.send({"error": f"refused: epoch {epoch} ended (the store's is {self._epoch()})", "id": rid})
                    return
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
                self._epochs.pop(conn, None)
            conn.close()
            if rank >= 0:  # only a trainer that attached detaches
                self._closed(conn, rank)

    def new_epoch(self, secret: bytes) -> None:
        """The store opened a new epoch (its secret ``secret``): trainers of older epochs are
        fenced, their connections closed (a message one sends meanwhile is refused)."""
        self.secret = secret
        now = self._epoch()
        with self._lock:
            older = [conn for conn, epoch in self._epochs.items() if epoch != now]
        for conn in older:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            conns, self._conns = list(self._conns), set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() that close() alone would not
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            conn.close()
