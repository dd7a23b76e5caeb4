"""The data-plane transport (gemini_ckpt/dataplane): bytes into the sink's buffers, mutual
authentication, dead and stalled peers, the bandwidth cap, and self-containment.

Peers that get killed run in spawned processes. Everything here loads the transport package
the way the host-store actor gets it (shipped by value, without ``gemini_ckpt`` or torch):
straight from its directory, which keeps each spawned peer's start-up under a second and checks
that the package needs nothing outside itself.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from standalone_transport import NS, SECRET, TRANSPORT_DIR, load_standalone

T = load_standalone()
wire = sys.modules["_standalone_gemini_transport._wire"]


class RecordingSink:
    """Receives into one numpy buffer (a transfer lands at its header's offset)."""

    def __init__(self, nbytes: int = 0, refuse: Exception | None = None, conn=None) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.refuse = refuse
        self.conn = conn
        self.asked: list = []
        self.events: list = []
        self.cond = threading.Condition()

    def buffer_for(self, header):
        self.asked.append(header)
        if self.conn is not None:
            self.conn.send("started")
        if self.refuse is not None:
            raise self.refuse
        return memoryview(self.buffer)[header.offset : header.offset + header.length]

    def received(self, header) -> None:
        self._event(("received", header, time.monotonic()))

    def failed(self, header, error) -> None:
        self._event(("failed", header, error, time.monotonic()))

    def _event(self, event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait(self, count: int = 1, timeout: float = 10) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= count, timeout), self.events
            return list(self.events)


def _transport(secret: bytes = SECRET, name: str = "", **config) -> "T.TcpTransport":
    config.setdefault("progress_timeout_s", 5.0)  # generous unless a test is about the timeout
    return T.TcpTransport(secret, NS, host_name=name, config=T.TcpConfig(**config))


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


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


# --- moving bytes -----------------------------------------------------------------------------
def test_transfers_land_in_the_sinks_buffer_with_their_headers():
    chunk = 64 << 10
    sizes = [0, 1, chunk - 1, chunk, 3 * chunk + 5, 1 << 20]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    total = sum(sizes)
    sink = RecordingSink(total)
    src = _data(total)
    sender = _transport(name="sender-host", streams=3, chunk_bytes=chunk)
    with _transport(name="receiver-host").listen("127.0.0.1", sink) as listener:
        assert listener.endpoint.peer == "receiver-host"
        with sender.connect(listener.endpoint) as channel:
            assert "receiver-host" in channel.peer
            headers = [
                T.Header(
                    NS,
                    5,
                    f"file{i}",
                    off,
                    n,
                    total=total,
                    checksum=zlib.crc32(src[off : off + n]),
                    checksum_algo="crc32",
                    put_id=f"put-{i}",
                    meta=b"\x00holders=[1,2]",
                )
                for i, (off, n) in enumerate(zip(offsets, sizes))
            ]
            futures = [channel.send_async(h, src[h.offset : h.offset + h.length]) for h in headers]
            for f in futures:
                assert f.result(timeout=20) is None
            channel.send(T.Header(NS, 6, "tail", 0, 3), bytearray(src[:3].tobytes()))  # any contiguous buffer
    assert np.array_equal(sink.buffer, src)
    got = {e[1].name: e[1] for e in sink.events if e[0] == "received"}
    assert [got[h.name] for h in headers] == headers  # every field arrives as sent
    assert got["tail"].total is None and got["tail"].checksum is None
    assert [e[0] for e in sink.events].count("failed") == 0


def test_checksum_is_verified_when_configured():
    n = 300 << 10
    sink = RecordingSink(n)
    src = _data(n)
    receiver = T.TcpTransport(SECRET, NS, config=T.TcpConfig(verify_checksum=zlib.crc32, chunk_bytes=64 << 10))
    with (
        receiver.listen("127.0.0.1", sink) as listener,
        _transport(chunk_bytes=64 << 10).connect(listener.endpoint) as channel,
    ):
        channel.send(T.Header(NS, 1, "good", 0, n, checksum=zlib.crc32(src)), src)
        with pytest.raises(T.ChecksumMismatchError, match="bad.*failed verification"):
            channel.send(T.Header(NS, 1, "bad", 0, n, checksum=zlib.crc32(src) ^ 1), src)
        channel.send(T.Header(NS, 1, "unchecked", 0, n), src)  # no checksum: nothing to verify
    kinds = {(e[0], e[1].name) for e in sink.wait(3)}
    assert kinds == {("received", "good"), ("failed", "bad"), ("received", "unchecked")}
    bad = next(e for e in sink.events if e[1].name == "bad")
    assert isinstance(bad[2], T.ChecksumMismatchError)


def test_a_sink_that_refuses_tells_the_sender_and_the_channel_keeps_working():
    sink = RecordingSink(1 << 20, refuse=MemoryError("over the host memory budget"))
    src = _data(1 << 20)
    with (
        _transport().listen("127.0.0.1", sink) as listener,
        _transport(chunk_bytes=64 << 10).connect(listener.endpoint) as channel,
    ):
        with pytest.raises(T.TransferRejectedError, match="MemoryError: over the host memory budget"):
            channel.send(T.Header(NS, 1, "f", 0, len(src)), src)
        sink.refuse = None
        with pytest.raises(T.TransferRejectedError, match="namespace"):  # the header names another job
            channel.send(T.Header("other-job", 1, "f", 0, len(src)), src)
        with pytest.raises(T.TransferRejectedError, match="returned 0 bytes for a transfer of 64"):
            channel.send(T.Header(NS, 1, "f", 1 << 20, 64), src[:64])  # beyond the sink's buffer
        channel.send(T.Header(NS, 1, "f", 0, len(src)), src)
    assert np.array_equal(sink.buffer, src)
    assert [e[0] for e in sink.events] == ["received"]


def test_closing_the_channel_mid_transfer_fails_both_sides():
    n = 32 << 20
    sink = RecordingSink(n)
    sender = _transport(max_send_bytes_per_s=32 << 20)
    with _transport().listen("127.0.0.1", sink) as listener:
        channel = sender.connect(listener.endpoint)
        future = channel.send_async(T.Header(NS, 1, "f", 0, n), np.ones(n, dtype=np.uint8))
        time.sleep(0.2)
        channel.close()
        with pytest.raises(T.ChannelClosedError):
            future.result(timeout=5)
        with pytest.raises(T.ChannelClosedError):
            channel.send_async(T.Header(NS, 1, "g", 0, 1), b"x")
        (event,) = sink.wait(1)
    assert event[0] == "failed" and isinstance(event[2], T.PeerLostError)


def test_a_receiver_that_aborts_a_transfer_gets_no_more_bytes_and_the_sender_stops_at_once():
    n = 32 << 20
    sink = RecordingSink(n)
    sender = _transport(max_send_bytes_per_s=8 << 20)  # 4 s for the whole transfer
    with _transport().listen("127.0.0.1", sink) as listener:
        channel = sender.connect(listener.endpoint)
        future = channel.send_async(T.Header(NS, 1, "f", 0, n, put_id="tag-1"), np.ones(n, dtype=np.uint8))
        deadline = time.monotonic() + 10
        while not sink.buffer.any() and time.monotonic() < deadline:
            time.sleep(0.01)
        listener.abort(["tag-0", "tag-1"], timeout=5)
        # Once abort returned, no stream writes into the view: the sink was told, and what is
        # set now stays set.
        assert [e[0] for e in sink.events] == ["failed"]
        sink.buffer[:] = 7
        t0 = time.monotonic()
        with pytest.raises(T.PeerLostError):
            future.result(timeout=5)
        stopped = time.monotonic() - t0
        time.sleep(0.5)
        assert (sink.buffer == 7).all()
        listener.abort(["tag-1"], timeout=5)  # nothing left of it: returns at once
    assert stopped < 1.0, stopped


def test_bandwidth_cap_64_mib_at_128_mib_per_s_takes_half_a_second():
    n = 64 << 20
    sink = RecordingSink(n)
    src = np.ones(n, dtype=np.uint8)
    sender = _transport(max_send_bytes_per_s=128 << 20)
    with _transport().listen("127.0.0.1", sink) as listener, sender.connect(listener.endpoint) as channel:
        channel.send(T.Header(NS, 1, "warm", 0, 1 << 20), src[: 1 << 20])
        t0 = time.perf_counter()
        channel.send(T.Header(NS, 1, "f", 0, n), src)
        alone = time.perf_counter() - t0
        # The cap is the sending host's: two channels share it.
        with sender.connect(listener.endpoint) as second:
            t0 = time.perf_counter()
            futures = [
                c.send_async(T.Header(NS, 2, f"h{i}", 0, n // 2), src[: n // 2])
                for i, c in enumerate((channel, second))
            ]
            for f in futures:
                f.result(timeout=10)
            shared = time.perf_counter() - t0
    assert 0.4 <= alone <= 1.0, alone
    assert 0.4 <= shared <= 1.0, shared


# --- authentication ---------------------------------------------------------------------------
def test_a_client_with_the_wrong_secret_cannot_write_into_the_servers_buffers():
    sink = RecordingSink(1 << 20)
    with _transport().listen("127.0.0.1", sink) as listener:
        endpoint = listener.endpoint
        with pytest.raises(T.AuthenticationError, match="refused our proof"):
            _transport(secret=b"another-jobs-secret-000000000000").connect(endpoint)
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
        _transport().connect(endpoint)
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
    with _transport(name="receiver-host", progress_timeout_s=1.0).listen("127.0.0.1", sink) as listener:
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


# --- the interface ----------------------------------------------------------------------------
def test_configuration_and_headers_are_validated():
    with pytest.raises(ValueError, match="TcpConfig.streams"):
        T.TcpConfig(streams=0)
    with pytest.raises(ValueError, match="TcpConfig.chunk_bytes"):
        T.TcpConfig(chunk_bytes=10)
    with pytest.raises(ValueError, match="TcpConfig.progress_timeout_s"):
        T.TcpConfig(progress_timeout_s=0)
    with pytest.raises(ValueError, match="Header.offset"):
        T.Header(NS, 1, "f", -1, 10)
    with pytest.raises(ValueError, match="Header.total"):
        T.Header(NS, 1, "f", 8, 10, total=12)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        T.TcpTransport(b"short", NS)
    with pytest.raises(ValueError, match="advertise_host"):
        _transport().listen("0.0.0.0", RecordingSink())
    with (
        _transport().listen("127.0.0.1", RecordingSink()) as listener,
        _transport().connect(listener.endpoint) as channel,
    ):
        with pytest.raises(ValueError, match="the header says"):
            channel.send_async(T.Header(NS, 1, "f", 0, 10), b"123")
    with pytest.raises(T.PeerLostError, match="cannot connect"):
        _transport().connect(listener.endpoint)  # closed


def test_headers_round_trip_the_wire_and_garbage_is_refused():
    header = T.Header(
        NS,
        2**40,
        "__0_0.distcp",
        5,
        7,
        total=100,
        checksum=2**63 + 1,
        checksum_algo="crc32c",
        put_id="p",
        meta=bytes(range(256)),
    )
    assert wire.decode_header(wire.encode_header(header)) == header
    encoded = wire.encode_header(header)
    for bad in (encoded[:-1], encoded + b"x", b"", b"\x00" * 40):
        with pytest.raises(ValueError):
            wire.decode_header(bad)


def test_endpoints_headers_and_errors_cross_process_boundaries():
    endpoint = T.Endpoint("tcp", "10.0.0.2", 4242, "node-abc", b"rdma-agent-metadata")
    header = T.Header(NS, 1, "f", 0, 1)
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
    assert pickle.loads(pickle.dumps(header)) == header
    error = pickle.loads(pickle.dumps(T.PeerLostError("node-abc at 10.0.0.2:4242 died", "node-abc")))
    assert isinstance(error, ConnectionError) and error.peer == "node-abc" and "died" in str(error)
    assert issubclass(T.ProgressTimeoutError, TimeoutError) and issubclass(T.AuthenticationError, PermissionError)


def test_the_package_is_self_contained():
    """Standard library and relative imports only (the actor is shipped by value; see the
    module docstring): ``import gemini_ckpt.dataplane`` itself is left to the integration
    tests, as it imports torch through ``gemini_ckpt``."""
    allowed = set(sys.stdlib_module_names)
    for path in TRANSPORT_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
    assert "torch" not in sys.modules or "_standalone_gemini_transport" in sys.modules
    assert issubclass(T.TcpTransport, T.Transport) and sorted(T.__all__) == sorted(set(T.__all__))
    # Imported by its name, it comes through the package's lazy facade: no torch, no Ray either.
    probe = "import sys, gemini_ckpt.dataplane; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=TRANSPORT_DIR.parents[1]
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr or out.stdout


def test_the_package_ships_by_value_to_a_process_that_cannot_import_it():
    """What the host-store actor will do: cloudpickle the transport by value, run it in a fresh
    interpreter, move bytes, and never import ``gemini_ckpt`` or torch there."""
    cloudpickle = pytest.importorskip("cloudpickle")

    def roundtrip() -> str:
        import sys as child_sys

        import numpy as child_np

        class Sink:
            buffer = child_np.zeros(1 << 20, dtype=child_np.uint8)
            done: list = []

            def buffer_for(self, header):
                return memoryview(self.buffer)

            def received(self, header):
                self.done.append(header.name)

            def failed(self, header, error):
                self.done.append(repr(error))

        transport = T.TcpTransport(SECRET, NS, config=T.TcpConfig(chunk_bytes=64 << 10))
        data = child_np.arange(1 << 20, dtype=child_np.uint8)
        with transport.listen("127.0.0.1", Sink()) as listener, transport.connect(listener.endpoint) as channel:
            channel.send(T.Header(NS, 1, "f", 0, data.nbytes), data)
        imported = sorted(m for m in ("gemini_ckpt", "torch", "ray") if m in child_sys.modules)
        return f"{Sink.done} {bool((Sink.buffer == data).all())} {imported}"

    cloudpickle.register_pickle_by_value(T)
    try:
        payload = cloudpickle.dumps(roundtrip)
    finally:
        cloudpickle.unregister_pickle_by_value(T)
    child = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())())"],
        input=payload,
        capture_output=True,
        timeout=60,
        cwd="/",
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().strip() == "['f'] True []"
