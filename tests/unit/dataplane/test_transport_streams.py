"""The data-plane transport (gemini_ckpt/dataplane) moving bytes: transfers land in the sink's
buffers with their headers, checksums are verified, a sink may refuse, a closed channel or an
aborted transfer fails both sides at once, and the sending host's bandwidth cap holds.

Loads the transport package straight from its directory, as test_transport_interface.py
explains and checks.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from standalone_transport import NS, SECRET, load_standalone
from transport_support import RecordingSink, make_transport

T = load_standalone()


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# --- moving bytes -----------------------------------------------------------------------------
def test_transfers_land_in_the_sinks_buffer_with_their_headers():
    chunk = 64 << 10
    sizes = [0, 1, chunk - 1, chunk, 3 * chunk + 5, 1 << 20]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    total = sum(sizes)
    sink = RecordingSink(total)
    src = _data(total)
    sender = make_transport(name="sender-host", streams=3, chunk_bytes=chunk)
    with make_transport(name="receiver-host").listen("127.0.0.1", sink) as listener:
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
        make_transport(chunk_bytes=64 << 10).connect(listener.endpoint) as channel,
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
        make_transport().listen("127.0.0.1", sink) as listener,
        make_transport(chunk_bytes=64 << 10).connect(listener.endpoint) as channel,
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
    sender = make_transport(max_send_bytes_per_s=32 << 20)
    with make_transport().listen("127.0.0.1", sink) as listener:
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
    sender = make_transport(max_send_bytes_per_s=8 << 20)  # 4 s for the whole transfer
    with make_transport().listen("127.0.0.1", sink) as listener:
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
    sender = make_transport(max_send_bytes_per_s=128 << 20)
    with make_transport().listen("127.0.0.1", sink) as listener, sender.connect(listener.endpoint) as channel:
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
