"""Does time to safe stay flat as hosts are added, and does a host's memory match the predicted footprint?

Setup: a local Ray cluster of simulated hosts (one Ray node each, all on this machine), grown
from 2 to 4 to 8 hosts, one rank per host: an FSDP2-sharded stack of Linear layers over gloo
(``_raybench.Rank``), each rank's shard ``--mb`` MB whatever the host count (fixed bytes per
host, so the total grows with the hosts). ``CheckpointConfig(store="ray", replicas=2,
keep_in_memory=K)``, a fresh namespace per host count. Measured per host count:

- **time to safe**: ``save()`` -> the version committed in the memory of ``replicas`` hosts
  (``handle.committed``), all ranks starting together after a barrier; median over the timed
  saves of the slowest rank (a version is safe when the last rank's shard is). Reported:
  the least-squares slope over host counts (seconds per added host) and t(8) / t(2); flat
  scaling means a slope near 0 and a ratio near 1.
- **host memory vs the predicted footprint**: per host store, the bytes it holds
  (``cluster_status``: ``held`` = the shards of kept versions, ``reserved`` = held plus
  buffers pooled for reuse) and its process's resident memory, sampled from
  ``/proc/<pid>/status`` during the saves (peak anonymous + shared memory over the baseline before the
  first save; ``VmHWM`` also counts the object-store pages the process mapped while pulling
  chunks). Predicted: K x m x shard (the issue's formula: K versions kept, m copies, one rank
  per host so each host keeps its own shard and m - 1 peers'), and (K + 1) x m x shard: the
  newest version arrives before retention drops the oldest, and the dropped version's
  buffers stay pooled for the next one. Staging buffers live in the trainer process
  (``max_inflight`` x shard), reported with that process's peak RSS.

On this machine all hosts share 2 cores and one memory bus, so adding hosts adds CPU
contention that real hosts would not have: a rising time to safe here is an upper bound.

Usage::

    python benchmarks/bench_scaling.py                 # 64 MB per rank, 2/4/8 hosts, 5 saves each
    python benchmarks/bench_scaling.py --quick         # 8 MB per rank, 2/4/8 hosts, 3 saves each

Writes ``benchmarks/results/scaling.json`` (``BENCH_RESULTS_DIR`` redirects) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402  (_raybench sets the Ray environment first)

import _common  # noqa: E402
import _raybench as rb  # noqa: E402

HOST_COUNTS = (2, 4, 8)
REPLICAS = 2
WARMUP = 2  # connect + plan + first allocations; later saves reuse staging and store buffers
SAMPLE_S = 0.01


class ScalingRank(rb.Rank):
    """``_raybench.Rank`` plus timed saves with one long-lived ``Checkpointer``, and its own memory."""

    def timed_saves(self, steps: int, **config) -> list[dict]:
        import torch.distributed as dist

        ckpt = self.checkpointer(**config)
        out = []
        for step in range(WARMUP + steps):
            dist.barrier()  # every rank's save() starts together: time to safe is one clock
            t0 = time.perf_counter()
            handle = ckpt.save(step)
            stall = time.perf_counter() - t0
            handle.committed.result(timeout=900)
            if step >= WARMUP:
                out.append({"stall_s": stall, "safe_s": time.perf_counter() - t0})
        return out

    def memory(self) -> dict:
        status = _proc_status(os.getpid())
        staging = self.ckpt.stats.staging_bytes if self.ckpt is not None else 0
        return {"rss_bytes": status.get("VmRSS", 0), "peak_rss_bytes": status.get("VmHWM", 0), "staging_bytes": staging}


def _proc_status(pid: int) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/<pid>/status``, in bytes ({} when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    # A host store's shards live in memfd segments (shared memory), its heap in anonymous memory.
    out["RssAnon"] = out.get("RssAnon", 0) + out.get("RssShmem", 0)
    return out


class MemorySampler:
    """Polls ``/proc/<pid>/status`` of the host stores from a driver thread (no Ray calls)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.baseline = {node: _proc_status(pid) for node, pid in pids.items()}
        self.peak_anon = {node: s.get("RssAnon", 0) for node, s in self.baseline.items()}
        self.peak_rss = {node: s.get("VmRSS", 0) for node, s in self.baseline.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaling-memory-sampler", daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        for node, pid in self.pids.items():
            s = _proc_status(pid)
            self.peak_anon[node] = max(self.peak_anon[node], s.get("RssAnon", 0))
            self.peak_rss[node] = max(self.peak_rss[node], s.get("VmRSS", 0))

    def report(self, node: str) -> dict:
        base, end = self.baseline[node], _proc_status(self.pids[node])
        return {
            "pid": self.pids[node],
            "baseline_rss_bytes": base.get("VmRSS", 0),
            "baseline_anon_bytes": base.get("RssAnon", 0),
            "peak_rss_bytes": max(self.peak_rss[node], end.get("VmHWM", 0)),
            "peak_anon_bytes": self.peak_anon[node],
            "peak_anon_growth_bytes": self.peak_anon[node] - base.get("RssAnon", 0),
        }


def _store_pids(namespace: str, node_ids: list[str]) -> dict[str, int]:
    """Process ids of the live host stores of ``namespace`` (from the GCS actor table)."""
    from ray._private import state  # the actor table's Pid; the public state API needs the dashboard

    from gemini_ckpt.hoststore.cluster import store_name

    wanted = {store_name(namespace, n): n for n in node_ids}
    pids = {}
    for info in state.actors().values():
        if info.get("State") == "ALIVE" and info.get("Name") in wanted and info.get("Pid"):
            pids[wanted[info["Name"]]] = int(info["Pid"])
    missing = sorted(set(node_ids) - set(pids))
    if missing:
        raise RuntimeError(
            f"no live host store process found for nodes {[m[:12] for m in missing]} in namespace {namespace!r}"
        )
    return pids


def _grow(cluster, hosts: int, plasma: int) -> None:
    """Add simulated hosts ``host{i}`` until the cluster has ``hosts`` (main thread only)."""
    for i in range(len(cluster.present()), hosts):
        cluster.add_host(i)
    cluster.cluster.wait_for_nodes()


def measure(cluster, hosts: int, args, plasma: int) -> dict:
    from gemini_ckpt import CheckpointConfig, cluster_status
    from gemini_ckpt.hoststore.cluster import shutdown_host_stores, start_host_stores

    _grow(cluster, hosts, plasma)
    ns = f"bench-scaling-{os.getpid()}-h{hosts}"
    config = dict(namespace=ns, replicas=REPLICAS, keep_in_memory=args.keep)
    load_before = rb.load_average()
    ranks, shard = rb.make_ranks(hosts, args.mb, cls=ScalingRank)
    try:
        nodes = ray.get([r.node_id.remote() for r in ranks], timeout=300)
        # Stores started before the first save, so their baseline memory excludes every shard.
        start_host_stores(CheckpointConfig(store="ray", **config), nodes, timeout_s=300)
        with MemorySampler(_store_pids(ns, nodes)) as sampler:
            per_rank = ray.get([r.timed_saves.remote(args.steps, **config) for r in ranks], timeout=3600)
        trainers = ray.get([r.memory.remote() for r in ranks], timeout=300)
        status = cluster_status(ns, timeout_s=60)[ns]
        by_node = {h.node_id: h for h in status.hosts}
        stores = []
        for node in nodes:
            h = by_node[node]
            stores.append(
                {
                    "node_id": node,
                    "slot": h.slot,
                    "versions": list(h.versions),
                    "own_shards": h.own_shards,
                    "replica_shards": h.replica_shards,
                    "held_bytes": h.held_bytes,
                    "reserved_bytes": h.reserved_bytes,
                    **sampler.report(node),
                }
            )
    finally:
        rb.kill_ranks(ranks)
        shutdown_host_stores(ns)

    safe = [max(r[i]["safe_s"] for r in per_rank) for i in range(args.steps)]
    stall = [max(r[i]["stall_s"] for r in per_rank) for i in range(args.steps)]
    k, m = args.keep, REPLICAS
    file_bytes = statistics.mean(s["held_bytes"] / (k * m) for s in stores)
    staging = max(t["staging_bytes"] for t in trainers)
    predicted = {"kept": k * m * shard, "arriving": (k + 1) * m * shard}
    measured = {
        "held_bytes": max(s["held_bytes"] for s in stores),
        "reserved_bytes": max(s["reserved_bytes"] for s in stores),
        "peak_anon_growth_bytes": max(s["peak_anon_growth_bytes"] for s in stores),
        "peak_rss_bytes": max(s["peak_rss_bytes"] for s in stores),
    }
    return {
        "hosts": hosts,
        "namespace": ns,
        "shard_bytes": shard,
        "file_bytes": file_bytes,
        "time_to_safe_s": statistics.median(safe),
        "stall_s": statistics.median(stall),
        "safe_per_save_s": safe,
        "predicted_store_bytes": {"K*m*shard": predicted["kept"], "(K+1)*m*shard": predicted["arriving"]},
        "measured_store_bytes": measured,
        "peak_matches": _closest(measured["peak_anon_growth_bytes"], predicted),
        "reserved_matches": _closest(measured["reserved_bytes"], predicted),
        "trainer": {
            "staging_bytes": staging,
            "predicted_staging_bytes": shard,
            "peak_rss_bytes": max(t["peak_rss_bytes"] for t in trainers),
            "per_rank": trainers,
        },
        "stores": stores,
        "raw": per_rank,
        "load_average_before": load_before,
        "load_average_after": rb.load_average(),
    }


def _closest(value: float, predicted: dict[str, int]) -> str:
    name = min(predicted, key=lambda key: abs(value - predicted[key]))
    return "K*m*shard" if name == "kept" else "(K+1)*m*shard"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="shard size per rank (= per host) in MB (default 64)")
    ap.add_argument("--hosts", type=int, nargs="+", default=list(HOST_COUNTS), help="host counts (default 2 4 8)")
    ap.add_argument("--steps", type=int, default=5, help="timed saves per host count (after 2 warm-up saves)")
    ap.add_argument("--keep", type=int, default=2, help="CheckpointConfig.keep_in_memory (K, default 2)")
    ap.add_argument("--quick", action="store_true", help="8 MB per rank, 3 timed saves")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.steps = 8, 3
    hosts = sorted(set(args.hosts))
    if hosts[0] < REPLICAS or args.steps < 1 or args.keep < 1:
        ap.error(f"host counts must be >= replicas ({REPLICAS}); --steps and --keep >= 1")

    t_start = time.perf_counter()
    plasma = max(256, 3 * min(args.mb, 64) * REPLICAS + 64) * 2**20
    cluster = rb.start_cluster(hosts[0], plasma)
    rows = []
    try:
        for n in hosts:
            rows.append(measure(cluster, n, args, plasma))
            print(f"{n} hosts: time to safe {rows[-1]['time_to_safe_s']:.3f}s", flush=True)
    finally:
        rb.stop_cluster(cluster, [r["namespace"] for r in rows])

    xs, ys = [r["hosts"] for r in rows], [r["time_to_safe_s"] for r in rows]
    by_hosts = dict(zip(xs, ys))
    ratio = by_hosts[max(xs)] / by_hosts[min(xs)] if len(xs) > 1 else None
    result = {
        "question": "time to safe (save -> committed in m hosts' memory) vs host count at fixed bytes per host; "
        "host-store memory vs the predicted footprint",
        "hosts": xs,
        "replicas": REPLICAS,
        "keep_in_memory": args.keep,
        "max_inflight": 1,
        "shard_mb_requested": args.mb,
        "steps": args.steps,
        "warmup_saves": WARMUP,
        "quick": args.quick,
        "slope_s_per_host": slope(xs, ys) if len(xs) > 1 else None,
        "ratio_largest_to_smallest": ratio,
        "ratio_label": f"t({max(xs)})/t({min(xs)})",
        "wall_s": time.perf_counter() - t_start,
        "load_average_end": rb.load_average(),
        "rows": rows,
    }
    path = _common.write_results("scaling", result)
    print(_markdown(result))
    print(f"\nwrote {path}")
    return 0


def _markdown(result: dict) -> str:
    def mb(v: float) -> str:
        return f"{v / 1e6:.1f}"

    rows = result["rows"]
    k, m = result["keep_in_memory"], result["replicas"]
    lines = [
        f"Fixed {rows[0]['shard_bytes'] / 1e6:.1f} MB shard per host (one rank per host), replicas={m}, "
        f"keep_in_memory={k}, median of {result['steps']} saves (slowest rank) after {result['warmup_saves']} "
        f"warm-up; {os.cpu_count()} cores shared by every simulated host; load average at end "
        f"{result['load_average_end'][0]:.1f}",
        "",
        "| hosts | time to safe (s) | save() stall (s) | store held (MB) | store reserved (MB) "
        "| store peak anon growth (MB) | store peak RSS (MB) | predicted K·m·shard (MB) "
        "| predicted (K+1)·m·shard (MB) | peak matches | trainer peak RSS (MB) | staging (MB) |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        ms, pr = r["measured_store_bytes"], r["predicted_store_bytes"]
        lines.append(
            f"| {r['hosts']} | {r['time_to_safe_s']:.3f} | {r['stall_s']:.3f} | {mb(ms['held_bytes'])} "
            f"| {mb(ms['reserved_bytes'])} | {mb(ms['peak_anon_growth_bytes'])} | {mb(ms['peak_rss_bytes'])} "
            f"| {mb(pr['K*m*shard'])} | {mb(pr['(K+1)*m*shard'])} | {r['peak_matches']} "
            f"| {mb(r['trainer']['peak_rss_bytes'])} | {mb(r['trainer']['staging_bytes'])} |"
        )
    if result["slope_s_per_host"] is not None:
        lines += [
            "",
            f"slope {result['slope_s_per_host'] * 1e3:+.1f} ms per added host (least squares); "
            f"{result['ratio_label']} = {result['ratio_largest_to_smallest']:.2f} (flat scaling: 1.00)",
        ]
    lines += [
        "",
        "Store columns: the largest host; held = shards of kept versions, reserved = held + buffers "
        "pooled for the next version, peak anon growth = the store process's anonymous + shared (segment) memory over "
        "its baseline before the first save (sampled every 10 ms), peak RSS includes mapped "
        "object-store pages and the process's baseline.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
