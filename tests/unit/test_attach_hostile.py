"""The attach socket against other local processes (issue 22, item 7): the socket is abstract, so
any process on the node can connect. Before the proof checks, a connection gets a deadline, a
few KiB at most, and no file descriptor of its is kept; a process of another uid is refused at
accept."""

from __future__ import annotations

import array
import dataclasses
import json
import logging
import os
import select
import socket
import struct
import time

import pytest

from gemini_ckpt.ray import attach_server
from gemini_ckpt.errors import AttachError
from gemini_ckpt.ray.attach_client import AttachClient
from gemini_ckpt.ray.attach_server import AttachServer
from gemini_ckpt.timeouts import TIMEOUTS

SECRET = os.urandom(32)
_HEAD = struct.Struct("<IQ")


class _Store:
    def __init__(self, **kwargs) -> None:
        self.calls: list = []
        self.detached: list = []
        self.server = AttachServer(SECRET, lambda: 1, self.handle, lambda conn, rank: self.detached.append(rank),
                                   **kwargs)

    def handle(self, conn, rank, header, payload, fds):
        self.calls.append(header)
        return {}, b"", ()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def store():
    s = _Store()
    yield s
    s.close()


def _dial(address: str) -> socket.socket:
    """Connect and read the store's greeting, as a client would before it answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(address)
    n_head, n_payload = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    greeting = json.loads(_recv_exact(sock, n_head))
    assert "nonce" in greeting and n_payload == 0
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the store closed the socket"
        buf += chunk
    return buf


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the store closed ``sock`` (EOF or reset), or None if it did not."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        data = sock.recv(1)
    except socket.timeout:
        return None
    except OSError:
        return time.monotonic() - t0
    assert data == b"", data
    return time.monotonic() - t0


def _eof_within(fd: int, seconds: float) -> bool:
    """Whether the read end ``fd`` of a pipe sees EOF (every write end closed) within ``seconds``."""
    readable, _, _ = select.select([fd], [], [], seconds)
    return bool(readable) and os.read(fd, 1) == b""


def test_a_silent_client_is_closed_at_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(attach_server, "TIMEOUTS", dataclasses.replace(TIMEOUTS, handshake_s=1.0))
    store = _Store()  # a server reads the deadline when it starts
    try:
        with _dial(store.server.address) as sock:
            took = _closed_within(sock, 4.0)
        assert took is not None, "a client that never answered was still connected after 4 s"
        assert took <= 2.0, took
        assert store.calls == []
    finally:
        store.close()


@pytest.mark.parametrize("n_head,n_payload", [(2, 256 << 20), (1 << 20, 0)], ids=["payload", "header"])
def test_a_big_message_before_the_proof_is_refused_without_reading_it(store, n_head, n_payload):
    sent = 0
    with _dial(store.server.address) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sock.settimeout(4)
        piece = b"{}" + b" " * ((64 << 10) - 2)
        refused = False
        try:
            sock.sendall(_HEAD.pack(n_head, n_payload))
            while sent < 32 << 20:
                sock.sendall(piece)
                sent += len(piece)
        except socket.timeout:
            pass  # not read, but not closed either: the assertion below says so
        except OSError:  # EPIPE / ECONNRESET: the store closed the socket
            refused = True
    assert refused, f"the store read {sent:,} bytes from a client that had not proved anything"
    assert sent <= 512 << 10, sent  # what the socket buffers held, not what the store read
    assert store.calls == []


def _send_with_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _message(header: dict) -> bytes:
    head = json.dumps(header).encode()
    return _HEAD.pack(len(head), 0) + head


@pytest.mark.parametrize("case", ["bad proof", "oversized", "stalled"])
def test_fds_passed_before_the_proof_are_closed(monkeypatch, case):
    monkeypatch.setattr(attach_server, "TIMEOUTS", dataclasses.replace(TIMEOUTS, handshake_s=1.0))
    store = _Store()
    r, w = os.pipe()
    try:
        with _dial(store.server.address) as sock:
            if case == "bad proof":
                _send_with_fd(sock, _message({"rank": 0, "epoch": 1, "proof": "00" * 32}), w)
            elif case == "oversized":  # more than the store would take from anyone
                _send_with_fd(sock, _HEAD.pack(2, 3 << 30), w)
            else:  # the first bytes of a hello, then nothing
                _send_with_fd(sock, _HEAD.pack(100, 0) + b'{"rank"', w)
            os.close(w)
            w = -1
            closed = _eof_within(r, 3.0)  # our socket stays open meanwhile
        assert closed, f"{case}: the store still held the fd passed before the proof"
        assert store.calls == []
        time.sleep(0.1)
        assert store.detached == []  # a stranger that named rank 0 never detaches rank 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        store.close()


def test_peer_credentials_and_the_uid_rule():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = attach_server.peer_credentials(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert attach_server.peer_refusal(peer, os.getuid()) is None
    stranger = attach_server.PeerCredentials(pid=4242, uid=os.getuid() + 1, gid=0)
    reason = attach_server.peer_refusal(stranger, os.getuid())
    assert reason is not None and f"uid {os.getuid() + 1}" in reason and "pid 4242" in reason


def test_a_process_of_another_uid_is_refused_at_accept(caplog):
    store = _Store(uid=os.getuid() + 1)  # as if this test ran as someone else
    try:
        with caplog.at_level(logging.WARNING, logger="gemini_ckpt"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with sock:
                sock.connect(store.server.address)
                took = _closed_within(sock, 3.0)  # not even a greeting
            assert took is not None and took < 2.0, took
            with pytest.raises(AttachError):
                AttachClient(store.server.address, SECRET, rank=0, epoch=1, timeout_s=5)
        lines = [r.getMessage() for r in caplog.records if "uid" in r.getMessage()]
        assert lines and f"uid {os.getuid()}" in lines[0] and f"pid {os.getpid()}" in lines[0], lines
        assert store.calls == []
    finally:
        store.close()


def test_a_real_trainer_still_attaches_while_strangers_hang_around(store):
    silent = [_dial(store.server.address) for _ in range(8)]
    try:
        client = AttachClient(store.server.address, SECRET, rank=2, epoch=1, timeout_s=5)
        client.request({"type": "plan"}, b"x" * (4 << 20))  # after the proof, big messages are fine
        client.close()
        assert store.calls and store.calls[0]["type"] == "plan"
    finally:
        for sock in silent:
            sock.close()
