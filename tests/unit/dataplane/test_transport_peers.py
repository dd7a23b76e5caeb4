"""The data-plane transport (gemini_ckpt/dataplane) against other peers: mutual authentication
(a client or server without the secret gets no bytes through), and dead and stalled peers.

Peers that get killed run in spawned processes, which load the transport package straight
from its directory (as test_transport_interface.py explains), keeping their start-up under a
second.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest

from standalone_transport import NS, SECRET, load_standalone
from transport_support import RecordingSink, make_transport

T = load_standalone()
wire = sys.modules["_standalone_gemini_transport._wire"]


# --- separate-process peers -------------------------------------------------------------------
def _receiver_child(conn, nbytes: int) -> None:
    sink = RecordingSink(nbytes, conn=conn)
    transport = T.TcpTransport(SECRET, NS, host_name="receiver-host")
    with transport.listen("127.0.0.1", sink) as listener:
        conn.send(listener.endpoint)
        conn.recv()


def _sender_child(conn, endpoint, nbytes: int, cap: float) -> None:
    transport = T.TcpTransport(SECRET, NS, host_name="sender-host", config=T.TcpConfig(max_send_bytes_per_s=cap))
    with transport.connect(endpoint) as channel:
        channel.send(T.Header(NS, 7, "shard.distcp", 0, nbytes, total=nbytes), np.ones(nbytes, dtype=np.uint8))
    conn.send("sent")
    conn.recv()


class _Child:
    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 30):
        assert self.conn.poll(timeout), "the child process did not answer"
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


@pytest.fixture
def child():
    children = []

    def start(target, *args) -> _Child:
        c = _Child(target, *args)
        children.append(c)
        return c

    yield start
    for c in children:
        c.kill()


# --- authentication ---------------------------------------------------------------------------
def test_a_client_with_the_wrong_secret_cannot_write_into_the_servers_buffers():
    sink = RecordingSink(1 << 20)
    with make_transport().listen("127.0.0.1", sink) as listener:
        endpoint = listener.endpoint
        with pytest.raises(T.AuthenticationError, match="refused our proof"):
            make_transport(secret=b"another-jobs-secret-000000000000").connect(endpoint)
        other_ns = T.TcpTransport(SECRET, "other-namespace")
        with pytest.raises(T.AuthenticationError):
            other_ns.connect(endpoint)
        # A client that skips the handshake and sends a data frame at once.
        frame = (
            wire.frame(
                wire.CHUNK, wire.CHUNK_HEAD.pack(1, 0, 1 << 20) + wire.encode_header(T.Header(NS, 1, "f", 0, 16)), 16
            )
            + b"\xff" * 16
        )
        with socket.create_connection((endpoint.host, endpoint.port)) as raw:
            raw.settimeout(5)
            raw.sendall(frame * 4)
            answer = b""
            try:
                while chunk := raw.recv(4096):
                    answer += chunk
            except ConnectionResetError:  # closed with our frames unread
                pass
        assert answer[: wire.HELLO_S.size - wire.NONCE_BYTES] == wire.MAGIC + bytes([wire.VERSION])
        assert answer[wire.HELLO_S.size :] == wire.VERDICT_STATUS.pack(wire.REFUSED)
    assert sink.asked == [] and sink.events == [] and not sink.buffer.any()


@pytest.mark.parametrize("forgery", ["random proof", "wrong secret"])
def test_a_fake_server_receives_no_payload_bytes(forgery):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    received = bytearray()

    def fake() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            nonce_s = os.urandom(wire.NONCE_BYTES)
            conn.sendall(wire.HELLO_S.pack(wire.MAGIC, wire.VERSION, nonce_s))
            hello = conn.recv(4096)
            received.extend(hello)
            _, _, nonce_c, session, stream = wire.HELLO_C_FIXED.unpack_from(hello)
            if forgery == "wrong secret":
                proof = wire.server_proof(
                    b"not-the-namespace-secret-0000000", NS, session, stream, "", "fake", nonce_s, nonce_c
                )
            else:
                proof = os.urandom(wire.PROOF_BYTES)
            conn.sendall(wire.VERDICT_STATUS.pack(wire.ACCEPTED) + wire.pack_str("fake") + proof)
            try:
                while chunk := conn.recv(1 << 20):
                    received.extend(chunk)
            except OSError:
                pass

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    endpoint = T.Endpoint("tcp", "127.0.0.1", server.getsockname()[1], "fake")
    with pytest.raises(T.AuthenticationError, match="could not prove"):
        make_transport().connect(endpoint)
    thread.join(10)
    server.close()
    hello_len = wire.HELLO_C_FIXED.size + len(wire.pack_str(NS)) + len(wire.pack_str("")) + wire.PROOF_BYTES
    assert len(received) == hello_len  # the hello, and not one byte more


# --- dead and stalled peers (separate processes) ----------------------------------------------
def _send_until_killed(child, sig: int):
    """Send to a receiver child, ``sig`` it mid-transfer; (error, seconds to notice, its sink's events)."""
    n = 64 << 20
    c = child(_receiver_child, n)
    endpoint = c.recv()
    sender = T.TcpTransport(
        SECRET, NS, host_name="sender-host", config=T.TcpConfig(max_send_bytes_per_s=64 << 20)
    )  # default progress timeout
    channel = sender.connect(endpoint)
    future = channel.send_async(T.Header(NS, 1, "f", 0, n), np.ones(n, dtype=np.uint8))
    assert c.recv() == "started"
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(c.proc.pid, sig)
    with pytest.raises(T.TransportError) as info:
        future.result(timeout=10)
    seconds = time.monotonic() - t0
    with pytest.raises(type(info.value)):  # the channel stays broken
        channel.send_async(T.Header(NS, 1, "g", 0, 1), b"x")
    channel.close()
    return info.value, seconds


def test_a_receiver_killed_mid_transfer_is_noticed_in_under_a_second(child):
    error, seconds = _send_until_killed(child, signal.SIGKILL)
    assert isinstance(error, T.PeerLostError), repr(error)
    assert seconds < 1.0
    assert "receiver-host at 127.0.0.1:" in str(error) and "f of step 1" in str(error)
    assert "receiver-host" in error.peer


def test_a_receiver_that_stops_reading_fails_the_transfer_after_the_progress_timeout(child):
    error, seconds = _send_until_killed(child, signal.SIGSTOP)
    assert isinstance(error, T.ProgressTimeoutError) and isinstance(error, TimeoutError), repr(error)
    assert 0.7 <= seconds < 2.0, seconds  # default progress_timeout_s = 1.0 (from the last sign of life)
    assert "receiver-host" in str(error) and "no progress" in str(error)


@pytest.mark.parametrize(
    "sig, error_type, bound",
    [(signal.SIGKILL, T.PeerLostError, (0.0, 1.0)), (signal.SIGSTOP, T.ProgressTimeoutError, (0.7, 2.5))],
    ids=["SIGKILL", "SIGSTOP"],
)
def test_a_sender_that_dies_mid_transfer_fails_it_in_the_sink(child, sig, error_type, bound):
    n = 64 << 20
    started = threading.Event()

    class Sink(RecordingSink):
        def buffer_for(self, header):
            started.set()
            return super().buffer_for(header)

    sink = Sink(n)
    with make_transport(name="receiver-host", progress_timeout_s=1.0).listen("127.0.0.1", sink) as listener:
        c = child(_sender_child, listener.endpoint, n, 64 << 20)
        assert started.wait(30)
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(c.proc.pid, sig)
        (event,) = sink.wait(1)
        c.kill()
    assert event[0] == "failed", event  # never marked received
    error = event[2]
    assert isinstance(error, error_type), repr(error)
    assert bound[0] <= event[3] - t0 < bound[1], event[3] - t0
    assert "sender-host at 127.0.0.1:" in str(error) and "shard.distcp of step 7" in str(error)
    assert len(sink.events) == 1
