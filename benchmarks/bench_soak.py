"""Does a host store's own memory stay flat over thousands of versions?

Setup: a local Ray cluster of ``--hosts`` simulated hosts, one FSDP2 rank per host
(``_raybench.Rank``, each shard ``--mb`` MB), one long-lived ``Checkpointer`` per rank with
``CheckpointConfig(store="ray", replicas=2, keep_in_memory=2)``, a version every step and the
next step only once it is committed (the every-step case, as fast as the stores go).

Sampled from ``/proc/<pid>/status`` of every host store, every ``--every`` versions:

- **private memory**: ``RssAnon``, the process's own heap and stacks. The shards themselves
  live in memfd segments (``RssShmem``), reported apart: kept versions are a fixed number of
  segments, reused, so they stay flat by construction.
- the store's own account of its segments (``gemini_ckpt status --json``'s ``memory``).

Reported per store: private memory at the first sample after ``--warmup`` versions and at the
end, the growth in percent, and the growth over the last half of the run (a leak keeps
growing; a warm-up plateau does not). The target: growth within 2% over the last half (of
the private memory at its start: versions ``N/2`` to ``N``).

Usage::

    python benchmarks/bench_soak.py                   # 10,000 versions, 2 hosts, 1 MB per rank
    python benchmarks/bench_soak.py --quick           # 1,000 versions

Writes ``benchmarks/results/soak.json`` (``BENCH_RESULTS_DIR`` redirects) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _raybench as rb  # noqa: E402
import ray  # noqa: E402
from _common import RESULTS, write_report  # noqa: E402
from bench_scaling import _proc_status, _store_pids  # noqa: E402

TARGET_GROWTH = 0.02


class SoakRank(rb.Rank):
    """``_raybench.Rank`` saving ``n`` versions in a row with one ``Checkpointer``."""

    def saves(self, first: int, n: int, **config) -> float:
        if self.ckpt is None:
            self.checkpointer(**config)
        t0 = time.perf_counter()
        for step in range(first, first + n):
            self.ckpt.save(step).committed.result(timeout=900)
        return time.perf_counter() - t0


def _private(pid: int) -> dict:
    s = _proc_status(pid)  # its RssAnon has RssShmem added in: take them apart again
    return {"anon": s.get("RssAnon", 0) - s.get("RssShmem", 0), "shmem": s.get("RssShmem", 0), "rss": s.get("VmRSS", 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--mb", type=int, default=1, help="state per rank in MB")
    ap.add_argument("--every", type=int, default=250, help="sample every N versions")
    ap.add_argument("--warmup", type=int, default=500, help="versions before the baseline sample")
    ap.add_argument("--quick", action="store_true", help="1,000 versions, warm-up 200")
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.versions, args.warmup, args.every = 1_000, 200, 100
    args.warmup = min(args.warmup, args.versions // 2)

    cluster = rb.start_cluster(args.hosts, 100 << 20)
    namespace = f"soak-{os.getpid()}"
    config = {"namespace": namespace, "replicas": 2, "keep_in_memory": 2}
    ranks = None
    try:
        ranks, shard = rb.make_ranks(args.hosts, args.mb, cls=SoakRank)
        nodes = ray.get([r.node_id.remote() for r in ranks], timeout=60)
        ray.get([r.saves.remote(0, 1, **config) for r in ranks], timeout=900)  # the stores start here
        pids = _store_pids(namespace, nodes)
        samples, done, t0 = [], 1, time.perf_counter()
        while done < args.versions:
            n = min(args.every, args.versions - done)
            ray.get([r.saves.remote(done, n) for r in ranks], timeout=3600)
            done += n
            samples.append(
                {
                    "versions": done,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "stores": {node[:12]: _private(pid) for node, pid in pids.items()},
                }
            )
            print(
                f"  {done:6d} versions, {time.perf_counter() - t0:6.1f}s: private MB "
                + " ".join(f"{s['anon'] / 2**20:.1f}" for s in samples[-1]["stores"].values()),
                flush=True,
            )
        from gemini_ckpt.cli.status import cluster_status

        accounts = {h.node_id[:12]: h.memory for h in cluster_status(namespace)[namespace].hosts}
    finally:
        if ranks is not None:
            rb.kill_ranks(ranks)
        rb.stop_cluster(cluster, [namespace])

    base = next(s for s in samples if s["versions"] >= args.warmup)
    mid = next(s for s in samples if s["versions"] >= args.versions // 2)  # the last half of the run
    end = samples[-1]
    stores = {}
    for node in end["stores"]:
        b, m, e = (x["stores"][node]["anon"] for x in (base, mid, end))
        stores[node] = {
            "private_at_warmup_bytes": b,
            "private_at_half_bytes": m,
            "private_at_end_bytes": e,
            "growth": (e - b) / b,
            "growth_last_half": (e - m) / m,
            "shmem_at_end_bytes": end["stores"][node]["shmem"],
            "account": accounts.get(node, {}),
        }
    worst = max(s["growth_last_half"] for s in stores.values())
    result = {
        "benchmark": "soak",
        "hosts": args.hosts,
        "versions": args.versions,
        "warmup_versions": base["versions"],
        "half_versions": mid["versions"],
        "shard_bytes": shard,
        "seconds": end["seconds"],
        "versions_per_s": args.versions / end["seconds"],
        "stores": stores,
        "worst_growth": worst,
        "target_growth": TARGET_GROWTH,
        "target_met": worst <= TARGET_GROWTH,
        "samples": samples,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    lines = [
        f"{args.hosts} hosts, {result['shard_bytes'] / 2**20:.1f} MB per rank, {args.versions} versions "
        f"(every step, replicas=2, keep 2), {result['versions_per_s']:.0f} versions/s",
        "",
        f"| store | private MB after {base['versions']} | at {mid['versions']} | at the end | growth since "
        f"{base['versions']} | growth over the last half |",
        "|---|---|---|---|---|---|",
    ]
    for node, s in stores.items():
        lines.append(
            f"| {node} | {s['private_at_warmup_bytes'] / 2**20:.1f} | {s['private_at_half_bytes'] / 2**20:.1f} "
            f"| {s['private_at_end_bytes'] / 2**20:.1f} | {100 * s['growth']:+.2f}% "
            f"| {100 * s['growth_last_half']:+.2f}% |"
        )
    lines += [
        "",
        f"worst growth over the last half {100 * worst:+.2f}% (target within {100 * TARGET_GROWTH:.0f}%: "
        f"{'met' if result['target_met'] else 'NOT met'})",
    ]
    return write_report(args.out, result, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
