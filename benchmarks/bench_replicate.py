"""How long from ``save()`` until a version is committed in peer memory, and how fast is replication?

Setup: a local Ray cluster of 4 simulated hosts (one Ray node each, all on this machine), one
rank per host training-free: an FSDP2-sharded stack of Linear layers over gloo, sized so each
rank's shard is ``--mb`` MB. For each ``replicas`` value (2 and 3): ``save()`` -> committed
with ``Checkpointer(CheckpointConfig(store="ray", replicas=m, keep_in_memory=1))``, split into
the stall (staging into the host store's memory) and the rest, which the host stores do
(checksums, the copies to ``replicas - 1`` peers over the data plane, the commit among them).
Baselines on the same bytes: a single-threaded memcpy on this machine, the same copies over
raw TCP streams between the same nodes (the transport floor), and
``torch.distributed.checkpoint.async_save`` to local disk until its background write completes.

Replication GB/s per host = replicas x shard bytes / (committed - stall) (every host keeps its
own shard and receives ``replicas - 1`` peers' shards, all hosts at once). On this machine every "host"
shares the same 2 cores and memory bus, so this is a lower bound for real hosts with their own
NICs, and the memcpy baseline is the ceiling of what one core can move.

Usage::

    RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python benchmarks/bench_replicate.py --mb 64
    python benchmarks/bench_replicate.py --quick           # 16 MB, one repeat

Writes ``benchmarks/results/replicate.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from _common import write_report  # noqa: E402
from _raybench import stop_cluster  # noqa: E402

HOSTS = 4
LAYER_DIM = 2048  # one fp32 layer = 16 MiB, sharded over the ranks


class BenchRank:
    """One rank: an FSDP2 model whose local shard is about ``mb`` MB, and timed saves."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.ckpt = None

    def address(self) -> tuple[str, int]:
        """This host's address and a port free on it (rank 0 serves the process group's rendezvous)."""
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, world_size: int, master: tuple[str, int], mb: int) -> int:
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from gemini_ckpt.toy import linear_stack

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        self.rank, self.world_size = rank, world_size
        layers = max(1, round(mb * world_size / (LAYER_DIM * LAYER_DIM * 4 / 2**20)))
        mesh = init_device_mesh("cpu", (world_size,))
        self.model = model = linear_stack(layers, LAYER_DIM, mesh, seed=rank)
        return sum(p.to_local().nbytes for p in model.parameters())

    def gemini(self, replicas: int, steps: int, namespace: str) -> list[dict]:
        from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState

        if self.ckpt is not None:
            self.ckpt.close()
        self.ckpt = Checkpointer(
            TrainState(model=self.model),
            CheckpointConfig(store="ray", namespace=namespace, replicas=replicas, keep_in_memory=1, timeout_s=600),
        )
        out = []
        warmup = 2  # connect + plan + first allocations; from step 2 on, dropped versions' buffers are reused
        for step in range(steps + warmup):
            t0 = time.perf_counter()
            handle = self.ckpt.save(step)
            stall = time.perf_counter() - t0
            handle.committed.result(timeout=600)
            commit = time.perf_counter() - t0
            if step >= warmup:
                # After the stall the host stores do the rest (checksums, copies, the commit).
                out.append(
                    {
                        "stall_s": stall,
                        "commit_s": commit,
                        "put_s": commit - stall,
                        "file_bytes": self.ckpt.stats.staging_bytes,
                    }
                )
        self.ckpt.close()
        self.ckpt = None
        return out

    # --- the transport floor: the same bytes over plain TCP sockets between the same nodes -------
    def raw_listen(self, expect: int, nbytes: int) -> tuple[str, int]:
        """Accept ``expect`` senders of ``nbytes`` each (recv_into one buffer per sender, a
        one-byte ack when all arrived); returns this node's address and the port."""
        import threading

        server = socket.create_server((ray.util.get_node_ip_address(), 0))
        bufs = [np.empty(nbytes, np.uint8) for _ in range(expect)]

        def serve(conn, buf):
            view, got = memoryview(buf), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
                if not n:
                    break
                got += n
            conn.sendall(b"k")
            conn.close()

        def accept_all():
            for buf in bufs:
                conn, _ = server.accept()
                threading.Thread(target=serve, args=(conn, buf), daemon=True).start()
            server.close()

        threading.Thread(target=accept_all, daemon=True).start()
        return ray.util.get_node_ip_address(), server.getsockname()[1]

    def raw_send(self, targets: list[tuple[str, int]], nbytes: int) -> float:
        """Send ``nbytes`` to every target at once (one stream each); seconds until all acked."""
        import threading

        data = np.ones(nbytes, np.uint8)

        def send(addr):
            with socket.create_connection(addr) as sock:
                sock.sendall(memoryview(data))
                sock.recv(1)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=send, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    # --- what the bandwidth cap buys: training step time while every step is replicated ------
    def train_while_saving(self, steps: int, namespace: str | None, replicas: int, cap: int | None) -> list[float]:
        """Step times of a fixed compute step (matmuls on one thread) followed by ``save()``;
        ``namespace=None``: no checkpointing (the baseline)."""
        import torch

        from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState

        ckpt = None
        if namespace is not None:
            ckpt = Checkpointer(
                TrainState(model=self.model),
                CheckpointConfig(
                    store="ray",
                    namespace=namespace,
                    replicas=replicas,
                    keep_in_memory=1,
                    timeout_s=600,
                    replication_bandwidth=cap,
                ),
            )
        a = torch.rand(384, 384)
        times = []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            for _ in range(6):
                a = torch.tanh(a @ a)
            if ckpt is not None:
                ckpt.save(step)
            if step:
                times.append(time.perf_counter() - t0)
        if ckpt is not None:
            ckpt.close()
        return times

    def dcp_async(self, directory: str, steps: int) -> list[dict]:
        import torch.distributed.checkpoint as dcp

        out = []
        for step in range(steps + 1):
            path = os.path.join(directory, f"step{step}")
            t0 = time.perf_counter()
            fut = dcp.async_save({"model": self.model.state_dict()}, checkpoint_id=path)
            stall = time.perf_counter() - t0
            fut.result()
            done = time.perf_counter() - t0
            if step:
                out.append({"stall_s": stall, "commit_s": done})
            if self.rank == 0:
                shutil.rmtree(os.path.join(directory, f"step{step - 1}"), ignore_errors=True)
        return out

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(per_rank: list[list[dict]], key: str) -> float:
    """Median over steps of the slowest rank (a version is committed when the last rank is)."""
    return statistics.median(max(r[i][key] for r in per_rank) for i in range(len(per_rank[0])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="shard size per rank in MB (default 256)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=3, help="timed saves per configuration")
    ap.add_argument("--quick", action="store_true", help="16 MB shards, one timed save")
    ap.add_argument("--cap-mb", type=int, default=200, help="replication_bandwidth for the step-time comparison")
    ap.add_argument(
        "--network",
        choices=("loopback", "netns"),
        default="loopback",
        help="netns: each host in its own network namespace (needs root; see bench_interference.py)",
    )
    ap.add_argument("--link", metavar="RATE", help="with --network netns: each host's link rate, e.g. 1gbit")
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
            "replicate.json",
        ),
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.steps = 16, 1

    from gemini_ckpt.hoststore.cluster import shutdown_host_stores
    from gemini_ckpt.testing.cluster import LocalCluster

    plasma = max(256, 3 * min(args.mb, 64) * max(args.replicas) + 64) * 2**20
    cluster = LocalCluster(HOSTS, head_cpus=1, object_store_bytes=plasma, network=args.network, link=args.link).start()
    workdir = tempfile.mkdtemp(prefix="gemini_bench_dcp_", dir=os.environ.get("BENCH_DISK_DIR"))
    namespaces = [f"bench-replicate-m{m}" for m in args.replicas] + ["bench-replicate-cap-none", "bench-replicate-cap"]
    try:
        ranks = [ray.remote(BenchRank).options(num_cpus=0, resources={f"host{i}": 0.01}).remote() for i in range(HOSTS)]
        master = ray.get(ranks[0].address.remote())
        shard = ray.get([r.setup.remote(i, HOSTS, master, args.mb) for i, r in enumerate(ranks)])
        shard_bytes = int(statistics.mean(shard))
        copy_gbps = memcpy_gbps(shard_bytes)
        rows = []
        for m, ns in zip(args.replicas, namespaces):
            per_rank = ray.get([r.gemini.remote(m, args.steps, ns) for r in ranks])
            put = _summary(per_rank, "put_s")
            file_bytes = statistics.mean(r[-1]["file_bytes"] for r in per_rank)
            rows.append(
                {
                    "method": f"gemini_ckpt replicas={m}",
                    "replicas": m,
                    "stall_s": _summary(per_rank, "stall_s"),
                    "commit_s": _summary(per_rank, "commit_s"),
                    "put_s": put,
                    "file_bytes": file_bytes,
                    "per_rank_send_gbps": file_bytes / put / 1e9,
                    "per_host_ingest_gbps": m * file_bytes / put / 1e9,
                    "raw": per_rank,
                    "store_timeline": _store_timeline(ns, args.steps + 1),
                }
            )
            shutdown_host_stores(ns)
        per_rank = ray.get([r.dcp_async.remote(workdir, args.steps) for r in ranks])
        rows.append(
            {
                "method": "DCP async_save to local disk",
                "replicas": 1,
                "stall_s": _summary(per_rank, "stall_s"),
                "commit_s": _summary(per_rank, "commit_s"),
                "raw": per_rank,
            }
        )
        for m in args.replicas:
            file_bytes = next(r["file_bytes"] for r in rows if r.get("replicas") == m and "put_s" in r)
            floor = [_raw_tcp_round(ranks, m, int(file_bytes)) for _ in range(max(2, args.steps))]
            rows.append(
                {
                    "method": f"raw TCP floor replicas={m}",
                    "replicas": m,
                    "floor_s": statistics.median(floor),
                    "raw": floor,
                }
            )
        cap_rows = _cap_effect(ranks, args)
        shutdown_host_stores("bench-replicate-cap-none")
        shutdown_host_stores("bench-replicate-cap")
        ray.get([r.teardown.remote() for r in ranks])
    finally:
        stop_cluster(cluster, namespaces)
        shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "question": "save() -> committed in peer memory, replication throughput, vs memcpy and DCP async_save",
        "hosts": HOSTS,
        "network": args.network,
        "link": args.link,
        "shard_mb_requested": args.mb,
        "shard_bytes": shard_bytes,
        "steps": args.steps,
        "memcpy_gbps_single_thread": copy_gbps,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "rows": rows,
        "cap": cap_rows,
    }
    return write_report(args.out, result, _markdown(result))


def _store_timeline(namespace: str, step: int) -> dict:
    """Per host store, when each phase of ``step`` happened, in seconds after the first store
    had a shard staged (where the time after the stall goes)."""
    from gemini_ckpt.hoststore.cluster import alive_node_ids, find_store

    marks = {}
    for node in alive_node_ids():
        handle = find_store(namespace, node)
        if handle is not None:
            got = ray.get(handle.timeline.remote(step), timeout=60)
            if got:
                marks[node[:12]] = got
    if not marks:
        return {}
    start = min(m.get("staged", float("inf")) for m in marks.values())
    return {
        node: {k: round(v - start, 4) for k, v in sorted(m.items(), key=lambda kv: kv[1])} for node, m in marks.items()
    }


def _raw_tcp_round(ranks, replicas: int, nbytes: int) -> float:
    """Every host sends ``nbytes`` to each other holder of its shard (one stream each), as the
    host stores do; seconds until the slowest host's sends are all acknowledged."""
    from gemini_ckpt.hoststore.slots import holders_for

    holders = [holders_for(r, hosts=HOSTS, replicas=replicas)[1:] for r in range(HOSTS)]
    expect = [sum(h in hs for hs in holders) for h in range(HOSTS)]
    addrs = ray.get([r.raw_listen.remote(expect[i], nbytes) for i, r in enumerate(ranks)])
    return max(ray.get([r.raw_send.remote([addrs[h] for h in holders[i]], nbytes) for i, r in enumerate(ranks)]))


def _cap_effect(ranks, args) -> dict:
    """Median step time (slowest rank): no checkpoint, every step saved with replication
    uncapped, and capped at ``--cap-mb`` MB/s per process."""
    steps, m = (6 if args.quick else 12), 2
    cap = args.cap_mb * 10**6
    out = {"steps": steps, "replicas": m, "cap_bytes_per_s": cap}
    for label, ns, limit in (
        ("no checkpoint", None, None),
        ("uncapped", "bench-replicate-cap-none", None),
        (f"capped {args.cap_mb} MB/s", "bench-replicate-cap", cap),
    ):
        per_rank = ray.get([r.train_while_saving.remote(steps, ns, m, limit) for r in ranks])
        out[label] = statistics.median(max(r[i] for r in per_rank) for i in range(steps))
    return out


def _markdown(result: dict) -> str:
    mb = result["shard_bytes"] / 1e6
    lines = [
        f"{result['hosts']} simulated hosts on {result['machine']['cpus']} cores, {mb:.0f} MB shard per rank, "
        f"median of {result['steps']} saves (slowest rank); memcpy of the shard: "
        f"{result['memcpy_gbps_single_thread']:.2f} GB/s (1 thread)",
        "",
        "| method | stall (s) | save -> committed (s) | stores: hand-off -> committed (s) | send GB/s per rank "
        "| ingest GB/s per host | vs memcpy |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "floor_s" in row:
            gem = next(r for r in result["rows"] if r.get("replicas") == row["replicas"] and "put_s" in r)
            lines.append(
                f"| {row['method']} | - | {row['floor_s']:.3f} (gemini: {gem['commit_s'] / row['floor_s']:.2f}x "
                f"this floor) | - | - | - | - |"
            )
        elif "put_s" in row:
            ratio = row["per_host_ingest_gbps"] / result["memcpy_gbps_single_thread"]
            lines.append(
                f"| {row['method']} | {row['stall_s']:.3f} | {row['commit_s']:.3f} | {row['put_s']:.3f} "
                f"| {row['per_rank_send_gbps']:.2f} | {row['per_host_ingest_gbps']:.2f} | {ratio:.0%} |"
            )
        else:
            lines.append(f"| {row['method']} | {row['stall_s']:.3f} | {row['commit_s']:.3f} | - | - | - | - |")
    for row in result["rows"]:
        for node, marks in (row.get("store_timeline") or {}).items():
            lines.append(
                f"- {row['method']}, store {node}: " + ", ".join(f"{k} +{v * 1e3:.0f} ms" for k, v in marks.items())
            )
    cap = result.get("cap")
    if cap:
        lines += [
            "",
            f"Step time while every step is saved (replicas={cap['replicas']}, median of {cap['steps']} "
            f"steps, slowest rank):",
            "",
        ]
        lines += [f"- {k}: {v:.3f} s" for k, v in cap.items() if isinstance(v, float)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
