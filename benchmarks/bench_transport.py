"""How fast is the data-plane transport, next to a raw TCP stream, and how fast does it notice a dead peer?

Setup: two OS processes on this machine (loopback), a sender (this process) and a receiver
(a spawned child) that receives into one preallocated, pre-touched numpy buffer, as a holder's
host store does. For 1, 2 and 4 streams:

* **raw TCP floor**: plain blocking sockets, the same number of connections, each carrying an
  equal slice (``sendall`` / ``recv_into`` straight into the buffer), a 1-byte ack per stream;
* **gemini_ckpt transport**: ``TcpTransport`` (handshake done once, outside the timing), one
  ``channel.send`` of the whole buffer, which returns when the receiver's sink has it all.

Reported per stream count: median and best GB/s of each (rounds alternate, so both see the
same load), and the CPU seconds per GiB of both processes together, which other load on the
machine barely moves. Then a chunk-size sweep at 4 streams, the bandwidth cap's accuracy, and dead-peer detection:
time from SIGKILL/SIGSTOP of the receiver (or the sender) mid-transfer until the other side's
transfer fails.

On this 2-core machine both processes share the cores, so the floor is the machine's, not a
NIC's; what matters is the ratio (target: our throughput >= 0.67x the floor).

Usage::

    python benchmarks/bench_transport.py            # 256 MiB, 5 repeats
    python benchmarks/bench_transport.py --quick    # 64 MiB, 2 repeats

Writes ``benchmarks/results/transport.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

_TRANSPORT_DIR = Path(__file__).resolve().parent.parent / "gemini_ckpt" / "dataplane"
SECRET = b"bench-transport-secret-0123456789"
NAMESPACE = "bench-transport"


def load_transport():
    """The transport package without importing ``gemini_ckpt`` (and torch): the way the
    host-store actor, shipped by value, gets it."""
    name = "_bench_gemini_transport"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, _TRANSPORT_DIR / "__init__.py", submodule_search_locations=[str(_TRANSPORT_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- the receiver process -------------------------------------------------------------------
class _BufferSink:
    def __init__(self, nbytes: int, conn) -> None:
        self.buffer = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults in the timing
        self.conn = conn

    def buffer_for(self, header):
        self.conn.send(("started", time.time()))
        return memoryview(self.buffer)[header.offset : header.offset + header.length]

    def received(self, header) -> None:
        pass

    def failed(self, header, error) -> None:
        self.conn.send(("failed", time.time(), type(error).__name__, str(error)))


def _raw_serve(server: socket.socket, view: memoryview, streams: int) -> None:
    """Raw floor: each of ``streams`` connections fills its slice of ``view``, then acks 1 byte."""
    socks = [server.accept()[0] for _ in range(streams)]
    bounds = np.linspace(0, len(view), streams + 1).astype(int)

    def run(i: int) -> None:
        sock = socks[i]
        part = view[bounds[i] : bounds[i + 1]]
        while True:
            pos = 0
            while pos < len(part):
                k = sock.recv_into(part[pos:])
                if not k:
                    return
                pos += k
            sock.sendall(b"k")

    for i in range(streams):
        threading.Thread(target=run, args=(i,), daemon=True).start()


def _transport_receiver(conn, nbytes: int, config_kwargs: dict) -> None:
    T = load_transport()
    transport = T.TcpTransport(SECRET, NAMESPACE, host_name="receiver", config=T.TcpConfig(**config_kwargs))
    sink = _BufferSink(nbytes, conn)
    listener = transport.listen("127.0.0.1", sink)
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=_raw_serve, args=(server, memoryview(sink.buffer), config_kwargs.get("streams", 4)), daemon=True
    ).start()
    conn.send((listener.endpoint, server.getsockname()[1]))
    conn.recv()  # until the parent is done (or kills us)
    listener.close()


def _transport_sender(conn, nbytes: int, address: tuple, config_kwargs: dict) -> None:
    T = load_transport()
    endpoint = T.Endpoint("tcp", *address)
    transport = T.TcpTransport(SECRET, NAMESPACE, host_name="sender", config=T.TcpConfig(**config_kwargs))
    data = np.ones(nbytes, dtype=np.uint8)
    with transport.connect(endpoint) as channel:
        conn.send("connected")
        channel.send(T.Header(NAMESPACE, 1, "shard", 0, nbytes, total=nbytes), data)
    conn.send("sent")
    conn.recv()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far (Linux; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


class _Peer:
    """A spawned child and its control pipe."""

    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 60):
        if not self.conn.poll(timeout):
            raise TimeoutError("the benchmark peer did not answer")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.conn.send("stop")
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# --- measurements ---------------------------------------------------------------------------
def throughput(nbytes: int, streams: int, chunk: int, repeats: int, raw: bool = True) -> dict:
    """GB/s of the transport and (when ``raw``) of the raw floor into the same receiver process,
    interleaved round by round so both see the same load on this shared machine."""
    T = load_transport()
    config = {"streams": streams, "chunk_bytes": chunk}
    peer = _Peer(_transport_receiver, nbytes, config)
    try:
        endpoint, raw_port = peer.recv()
        transport = T.TcpTransport(SECRET, NAMESPACE, host_name="sender", config=T.TcpConfig(**config))
        data = np.ones(nbytes, dtype=np.uint8)
        view = memoryview(data)
        header = T.Header(NAMESPACE, 1, "shard", 0, nbytes, total=nbytes)
        socks = [socket.create_connection(("127.0.0.1", raw_port)) for _ in range(streams)]
        bounds = np.linspace(0, nbytes, streams + 1).astype(int)

        def raw_once() -> float:
            barrier = threading.Barrier(streams + 1)

            def run(i: int) -> None:
                barrier.wait()
                socks[i].sendall(view[bounds[i] : bounds[i + 1]])
                socks[i].recv(1)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            return time.perf_counter() - t0

        out: dict = {"raw": [], "ours": [], "raw_cpu_s": [], "ours_cpu_s": []}
        with transport.connect(endpoint) as channel:

            def ours_once() -> float:
                t0 = time.perf_counter()
                channel.send(header, data)
                return time.perf_counter() - t0

            for rep in range(repeats + 1):  # round 0 warms up
                rounds = [("ours", ours_once)] + ([("raw", raw_once)] if raw else [])
                for name, fn in rounds if rep % 2 else rounds[::-1]:
                    cpu0 = time.process_time() + _cpu_seconds(peer.proc.pid)
                    seconds = fn()
                    if rep:  # CPU of both processes: robust to other load on the machine, unlike GB/s
                        out[name].append(nbytes / seconds / 1e9)
                        out[f"{name}_cpu_s"].append(time.process_time() + _cpu_seconds(peer.proc.pid) - cpu0)
        for s in socks:
            s.close()
        return out
    finally:
        peer.stop()


def cap_accuracy(nbytes: int, cap: float) -> dict:
    T = load_transport()
    peer = _Peer(_transport_receiver, nbytes, {})
    try:
        endpoint, _ = peer.recv()
        transport = T.TcpTransport(SECRET, NAMESPACE, config=T.TcpConfig(max_send_bytes_per_s=cap))
        data = np.ones(nbytes, dtype=np.uint8)
        with transport.connect(endpoint) as channel:
            t0 = time.perf_counter()
            channel.send(T.Header(NAMESPACE, 1, "shard", 0, nbytes), data)
            seconds = time.perf_counter() - t0
        return {
            "bytes": nbytes,
            "cap_bytes_per_s": cap,
            "seconds": seconds,
            "expected_s": nbytes / cap,
            "achieved_over_cap": nbytes / seconds / cap,
        }
    finally:
        peer.stop()


def detect_receiver_death(sig: int, nbytes: int, progress_timeout: float) -> dict:
    """Kill/stop the receiver mid-transfer; seconds until the sender's transfer fails."""
    T = load_transport()
    peer = _Peer(_transport_receiver, nbytes, {"progress_timeout_s": progress_timeout})
    try:
        endpoint, _ = peer.recv()
        # Capped so the transfer is long enough to be interrupted half-way.
        config = T.TcpConfig(progress_timeout_s=progress_timeout, max_send_bytes_per_s=nbytes / 2)
        transport = T.TcpTransport(SECRET, NAMESPACE, config=config)
        data = np.ones(nbytes, dtype=np.uint8)
        channel = transport.connect(endpoint)
        future = channel.send_async(T.Header(NAMESPACE, 1, "shard", 0, nbytes), data)
        peer.recv()  # the receiver started
        time.sleep(0.5)
        t0 = time.perf_counter()
        os.kill(peer.proc.pid, sig)
        try:
            future.result(timeout=30)
            outcome, message = "completed (not detected)", ""
        except Exception as exc:  # noqa: BLE001 - what we measure
            outcome, message = type(exc).__name__, str(exc)
        seconds = time.perf_counter() - t0
        channel.close()
        return {"seconds": seconds, "error": outcome, "message": message}
    finally:
        peer.proc.kill()
        peer.proc.join(10)


def detect_sender_death(sig: int, nbytes: int, progress_timeout: float) -> dict:
    """Kill/stop the sender mid-transfer; seconds until the receiver's sink gets ``failed``."""
    T = load_transport()
    transport = T.TcpTransport(
        SECRET, NAMESPACE, host_name="receiver", config=T.TcpConfig(progress_timeout_s=progress_timeout)
    )
    events: "list[tuple]" = []
    started, failed = threading.Event(), threading.Event()

    class Sink:
        buffer = np.ones(nbytes, dtype=np.uint8)

        def buffer_for(self, header):
            started.set()
            return memoryview(self.buffer)

        def received(self, header):
            events.append(("received",))
            failed.set()

        def failed(self, header, error):
            events.append((type(error).__name__, str(error), time.perf_counter()))
            failed.set()

    with transport.listen("127.0.0.1", Sink()) as listener:
        peer = _Peer(
            _transport_sender,
            nbytes,
            (listener.endpoint.host, listener.endpoint.port),
            {"progress_timeout_s": progress_timeout, "max_send_bytes_per_s": nbytes / 2},
        )
        try:
            started.wait(60)
            time.sleep(0.5)
            t0 = time.perf_counter()
            os.kill(peer.proc.pid, sig)
            failed.wait(30)
            if events and len(events[0]) == 3:
                kind, message, t1 = events[0]
            else:
                kind, message, t1 = "not detected", "", time.perf_counter()
            return {"seconds": t1 - t0, "error": kind, "message": message}
        finally:
            peer.proc.kill()
            peer.proc.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="bytes per transfer in MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats, fewer chunk sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeats = 64, 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import RESULTS, table, write_results

    T = load_transport()
    nbytes = args.mb << 20
    default_chunk = T.TcpConfig().chunk_bytes

    streams_rows = []
    for streams in (1, 2, 4):
        runs = throughput(nbytes, streams, default_chunk, args.repeats)
        raw, ours = runs["raw"], runs["ours"]
        streams_rows.append(
            {
                "streams": streams,
                "chunk_bytes": default_chunk,
                "raw_gbps": statistics.median(raw),
                "transport_gbps": statistics.median(ours),
                "ratio": statistics.median(ours) / statistics.median(raw),
                "raw_best_gbps": max(raw),
                "transport_best_gbps": max(ours),
                "best_ratio": max(ours) / max(raw),
                "raw_cpu_s_per_gib": statistics.median(runs["raw_cpu_s"]) * 2**30 / nbytes,
                "transport_cpu_s_per_gib": statistics.median(runs["ours_cpu_s"]) * 2**30 / nbytes,
                **runs,
            }
        )
    chunk_rows = []
    for chunk_mb in (1, 4, 16) if args.quick else (1, 2, 4, 8, 16):
        runs = throughput(nbytes, 4, chunk_mb << 20, args.repeats)
        raw, ours = statistics.median(runs["raw"]), statistics.median(runs["ours"])
        chunk_rows.append(
            {
                "streams": 4,
                "chunk_bytes": chunk_mb << 20,
                "raw_gbps": raw,
                "transport_gbps": ours,
                "ratio": ours / raw,
                "transport_cpu_s_per_gib": statistics.median(runs["ours_cpu_s"]) * 2**30 / nbytes,
                **runs,
            }
        )
    caps = [cap_accuracy(64 << 20, 128 << 20), cap_accuracy(nbytes, 4 * nbytes)]
    timeout = T.TcpConfig().progress_timeout_s
    detect_bytes = 64 << 20
    detection = {
        "receiver SIGKILL": detect_receiver_death(signal.SIGKILL, detect_bytes, timeout),
        "receiver SIGSTOP": detect_receiver_death(signal.SIGSTOP, detect_bytes, timeout),
        "sender SIGKILL": detect_sender_death(signal.SIGKILL, detect_bytes, timeout),
        "sender SIGSTOP": detect_sender_death(signal.SIGSTOP, detect_bytes, timeout),
    }

    result = {
        "question": "transport throughput vs a raw TCP floor (two processes, loopback), cap accuracy, "
        "dead-peer detection",
        "bytes": nbytes,
        "repeats": args.repeats,
        "progress_timeout_s": timeout,
        "streams": streams_rows,
        "chunks": chunk_rows,
        "caps": caps,
        "detection": detection,
    }
    out = Path(args.out) if args.out else RESULTS / "transport.json"
    if args.out:
        import json

        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    else:
        out = write_results("transport", result)

    print(f"{args.mb} MiB per transfer, two processes on loopback, {os.cpu_count()} cores, median of {args.repeats}\n")
    print(
        table(
            [
                "streams",
                "raw TCP GB/s",
                "transport GB/s",
                "transport / raw",
                "best raw",
                "best transport",
                "best / best",
                "raw CPU s/GiB",
                "transport CPU s/GiB",
            ],
            [
                [
                    r["streams"],
                    r["raw_gbps"],
                    r["transport_gbps"],
                    r["ratio"],
                    r["raw_best_gbps"],
                    r["transport_best_gbps"],
                    r["best_ratio"],
                    r["raw_cpu_s_per_gib"],
                    r["transport_cpu_s_per_gib"],
                ]
                for r in streams_rows
            ],
        )
    )
    print()
    print(
        table(
            ["chunk MiB (4 streams)", "raw TCP GB/s", "transport GB/s", "transport / raw", "transport CPU s/GiB"],
            [
                [r["chunk_bytes"] >> 20, r["raw_gbps"], r["transport_gbps"], r["ratio"], r["transport_cpu_s_per_gib"]]
                for r in chunk_rows
            ],
        )
    )
    print()
    print(
        table(
            ["cap MiB/s", "MiB", "expected s", "took s", "achieved / cap"],
            [
                [c["cap_bytes_per_s"] / 2**20, c["bytes"] >> 20, c["expected_s"], c["seconds"], c["achieved_over_cap"]]
                for c in caps
            ],
        )
    )
    print()
    print(
        table(
            [f"dead peer (progress timeout {timeout}s)", "detected after s", "error"],
            [[k, v["seconds"], v["error"]] for k, v in detection.items()],
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
