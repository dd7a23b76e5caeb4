"""The data plane against unauthenticated clients: a client that trickles its
hello is cut at one deadline for the whole pre-auth phase, and a crowd of such clients is held
to a cap per listener, so a real peer still gets its transfer through (in a receiver whose fds
are limited, as a real host store's are).

Loads the transport package the way the other transport tests do (straight from its directory).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import sys
import threading
import time

import numpy as np

from standalone_transport import NS, SECRET, load_standalone

T = load_standalone()
wire = sys.modules["_standalone_gemini_transport._wire"]
recv_module = sys.modules["_standalone_gemini_transport._tcp_recv"]


class _Sink:
    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.asked: list = []
        self.got: list = []

    def buffer_for(self, header):
        self.asked.append(header)
        return memoryview(self.buffer)[header.offset : header.offset + header.length]

    def received(self, header) -> None:
        self.got.append(header.name)

    def failed(self, header, error) -> None:
        pass


def _fake_hello() -> bytes:
    """A hello that looks real byte by byte (a client that trickles it never finishes it anyway)."""
    return (
        wire.HELLO_C_FIXED.pack(
            wire.MAGIC, wire.VERSION, os.urandom(wire.NONCE_BYTES), os.urandom(wire.SESSION_BYTES), 0
        )
        + wire.pack_str(NS)
        + wire.pack_str("slow")
        + os.urandom(wire.PROOF_BYTES)
    )


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock`` (reads and drops what it sent: its greeting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return not sock.recv(4096)
    except OSError:
        return True


def test_a_client_trickling_its_hello_is_cut_at_the_preauth_deadline(monkeypatch):
    deadline = 1.5
    monkeypatch.setattr(recv_module, "PREAUTH_DEADLINE_S", deadline, raising=False)
    sink = _Sink(1 << 10)
    with T.TcpTransport(SECRET, NS).listen("127.0.0.1", sink) as listener:
        hello = _fake_hello()
        with socket.create_connection((listener.endpoint.host, listener.endpoint.port), timeout=5) as sock:
            t0 = time.monotonic()
            cut_after = None
            for i in range(16):  # one byte every 0.5 s for up to 8 s: far past any per-recv timeout
                try:
                    sock.sendall(hello[i : i + 1])
                except OSError:
                    cut_after = time.monotonic() - t0
                    break
                time.sleep(0.5)
                if _closed_by_peer(sock):
                    cut_after = time.monotonic() - t0
                    break
    assert cut_after is not None, "a client sending a byte every 0.5 s was never cut"
    assert deadline - 0.2 <= cut_after <= deadline + 1.0, cut_after
    assert sink.asked == []


# --- many slow clients against a receiver with few fds ------------------------------------------
def _limited_receiver(conn, nofile: int, nbytes: int) -> None:
    import resource

    # Strangers keep their slots for the whole test: what lets the real peer in is the cap (and
    # its grace), not the deadline.
    recv_module.PREAUTH_DEADLINE_S = 60.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard), hard))
    sink = _Sink(nbytes)
    transport = T.TcpTransport(SECRET, NS, host_name="receiver-host")
    with transport.listen("127.0.0.1", sink) as listener:
        conn.send((listener.endpoint, getattr(recv_module, "MAX_PREAUTH", None)))
        conn.recv()
        conn.send(sink.got)


class _SlowCrowd:
    """``n`` clients that connect and send one byte of a hello every 0.5 s, never finishing it;
    ``held`` is how many of them the listener had not closed at the last drip."""

    def __init__(self, endpoint, n: int) -> None:
        self.socks: list[socket.socket] = []
        self.held = 0
        self.refused_at_connect = 0
        self._stop = threading.Event()
        self._hello = _fake_hello()
        for _ in range(n):
            try:
                self.socks.append(socket.create_connection((endpoint.host, endpoint.port), timeout=2))
            except OSError:
                self.refused_at_connect += 1
        self._open = list(self.socks)
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _drip(self) -> None:
        i = 0
        while not self._stop.is_set():
            still = []
            for sock in self._open:
                if _closed_by_peer(sock):
                    continue
                try:
                    sock.send(self._hello[i % len(self._hello) :][:1], socket.MSG_DONTWAIT)
                except (BlockingIOError, socket.timeout):
                    pass
                except OSError:
                    continue
                still.append(sock)
            self._open = still
            self.held = len(still)
            i += 1
            self._stop.wait(0.5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()


def test_a_crowd_of_slow_clients_does_not_lock_a_real_peer_out():
    """300 slow clients against a receiver limited to 256 fds (the issue's probe): the listener
    holds at most its cap of them, and a real peer's 4 streams get in and deliver."""
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    n = 1 << 20
    proc = ctx.Process(target=_limited_receiver, args=(child_conn, 256, n), daemon=True)
    proc.start()
    crowd = None
    try:
        assert parent.poll(30), "the receiver did not start"
        endpoint, cap = parent.recv()
        crowd = _SlowCrowd(endpoint, 300)
        sender = T.TcpTransport(
            SECRET,
            NS,
            host_name="real-peer",
            config=T.TcpConfig(streams=4, connect_timeout_s=4.0, progress_timeout_s=5.0),
        )
        t0 = time.monotonic()
        with sender.connect(endpoint) as channel:
            channel.send(T.Header(NS, 1, "shard", 0, n, total=n), np.ones(n, dtype=np.uint8), timeout=10)
        took = time.monotonic() - t0
        time.sleep(0.6)  # one more drip round: what the listener still holds
        parent.send("stop")
        assert parent.poll(10)
        assert parent.recv() == ["shard"]
        assert cap is not None and cap - 8 <= crowd.held <= cap, (crowd.held, cap)  # the crowd filled the cap
        assert took < 5.0, took
    finally:
        if crowd is not None:
            crowd.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)
