"""The data-plane transport's interface (gemini_ckpt/dataplane): validated configuration and
headers, the wire format of headers, what crosses process boundaries, and self-containment.

Everything here loads the transport package the way the host-store actor gets it (shipped by
value, without ``gemini_ckpt`` or torch): straight from its directory, which checks that the
package needs nothing outside itself and keeps each spawned peer's start-up (test_transport_peers.py)
under a second.
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys

import pytest

from standalone_transport import NS, SECRET, TRANSPORT_DIR, load_standalone
from transport_support import RecordingSink, make_transport

T = load_standalone()
wire = sys.modules["_standalone_gemini_transport._wire"]


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
        make_transport().listen("0.0.0.0", RecordingSink())
    with (
        make_transport().listen("127.0.0.1", RecordingSink()) as listener,
        make_transport().connect(listener.endpoint) as channel,
    ):
        with pytest.raises(ValueError, match="the header says"):
            channel.send_async(T.Header(NS, 1, "f", 0, 10), b"123")
    with pytest.raises(T.PeerLostError, match="cannot connect"):
        make_transport().connect(listener.endpoint)  # closed


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
