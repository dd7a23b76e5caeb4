"""The attach socket against other local processes: the socket is abstract, so
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

from attach_flood_support import draining, full_queue
from gemini_ckpt.hoststore import attach_server
from gemini_ckpt.errors import AttachError
from gemini_ckpt.hoststore.attach_client import AttachClient
from gemini_ckpt.hoststore.attach_server import AttachServer
from gemini_ckpt.timeouts import TIMEOUTS

SECRET = os.urandom(32)
_HEAD = struct.Struct("<IQ")


class _Store:
    def __init__(self, **kwargs) -> None:
        self.calls: list = []
        self.detached: list = []
        self.server = AttachServer(
            SECRET, lambda: 1, self.handle, lambda conn, rank: self.detached.append(rank), **kwargs
        )

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


def test_received_fds_are_not_inherited_by_child_processes(tmp_path):
    """Segment and comm-page fds that arrive over the attach socket are close-on-exec: a child
    process the trainer starts (a data-loader worker exec'd, a shell) must not keep the memory
    alive after the store and the trainer closed theirs."""
    import subprocess
    import sys

    from gemini_ckpt.hoststore.attach import Connection, close_all

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_path / "segment"
    path.write_bytes(b"x" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        Connection(a).send({"kind": "segment"}, fds=(fd,))
        header, _payload, fds = Connection(b).recv(deadline=time.monotonic() + 5)
        assert header == {"kind": "segment"} and len(fds) == 1
        assert not os.get_inheritable(fds[0])
        # What a child sees: the fd passed to it only if it were inheritable.
        probe = subprocess.run(
            [sys.executable, "-c", f"import os; os.fstat({fds[0]})"], close_fds=False, capture_output=True
        )
        assert probe.returncode != 0, "a child process could use the received fd"
        close_all(fds)
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_a_store_of_another_version_is_refused_with_a_clear_error(store, monkeypatch):
    """Detached host stores outlive jobs: a trainer must not attach to one an older (or newer)
    gemini_ckpt left running (an old store's records without verdicts made
    a NaN step healthy). Both ends name the attach protocol and refuse another."""
    from gemini_ckpt.hoststore import attach_client
    from gemini_ckpt.hoststore.attach import PROTOCOL

    # An old store: its greeting names no protocol.
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0gemini-ckpt-test-{os.getpid()}-{time.monotonic_ns()}"
    old.bind(address)
    old.listen(1)

    def serve_old():
        conn, _ = old.accept()
        head = json.dumps({"nonce": os.urandom(32).hex()}).encode()
        conn.sendall(_HEAD.pack(len(head), 0) + head)
        time.sleep(1)
        conn.close()

    import threading

    threading.Thread(target=serve_old, daemon=True).start()
    with pytest.raises(
        AttachError,
        match=rf"speaks attach protocol 1 and this trainer {PROTOCOL}: the store was "
        r"started by another gemini_ckpt version; end the old host stores",
    ):
        AttachClient(address, SECRET, rank=0, epoch=1, timeout_s=5)
    old.close()

    # A trainer of another version at a current store: refused by the store, with the reason.
    monkeypatch.setattr(attach_client, "PROTOCOL", PROTOCOL + 1)
    with pytest.raises(AttachError, match=rf"speaks attach protocol {PROTOCOL} and this trainer {PROTOCOL + 1}"):
        AttachClient(store.server.address, SECRET, rank=0, epoch=1, timeout_s=5)
    monkeypatch.setattr(attach_client, "PROTOCOL", PROTOCOL)
    greeting_ok = AttachClient(store.server.address, SECRET, rank=0, epoch=1, timeout_s=5)
    greeting_ok.close()


def test_the_store_refuses_a_hello_without_its_protocol(store):
    from gemini_ckpt.hoststore.attach import proof

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(store.server.address)
    n_head, _ = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    nonce = bytes.fromhex(json.loads(_recv_exact(sock, n_head))["nonce"])
    hello = json.dumps({"rank": 0, "epoch": 1, "proof": proof(SECRET, nonce, 0, 1)}).encode()  # an old trainer's
    sock.sendall(_HEAD.pack(len(hello), 0) + hello)
    n_head, _ = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    verdict = json.loads(_recv_exact(sock, n_head))
    assert verdict["ok"] is False and "different gemini_ckpt versions" in verdict["error"], verdict
    assert store.calls == []
    sock.close()


def test_a_trainer_attaches_once_a_full_attach_queue_drains():
    """A full listen queue (a burst, or another local user's connect loop) makes a non-blocking
    connect fail with EAGAIN at once; the trainer tries again until its deadline instead of
    failing the job's start (4 of 5 restarts failed under a flood)."""
    from gemini_ckpt.hoststore.attach_client import connect_until

    address = f"\0gemini-ckpt-test-queue-{os.getpid()}-{time.monotonic_ns()}"
    listener, fillers = full_queue(address)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5)
    with pytest.raises(BlockingIOError):  # what a single try gets
        probe.connect(address)
    probe.close()

    with draining(listener, 0.5) as accepted:
        t0 = time.monotonic()
        sock = connect_until(address, time.monotonic() + 10)
        assert time.monotonic() - t0 >= 0.4
    sock.close()
    for s in fillers + accepted:
        s.close()
    listener.close()

    # Full, and nobody drains it: the deadline ends the tries with a clear error.
    address = address + "-stuck"
    listener, fillers = full_queue(address)
    with pytest.raises(OSError, match="attach queue stayed full"):
        connect_until(address, time.monotonic() + 0.5)
    for s in fillers:
        s.close()
    listener.close()
