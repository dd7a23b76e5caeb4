"""How fast is a version persisted to the durable tier, and what does persisting cost training?

Setup: a local Ray cluster of 4 simulated hosts, one FSDP2 rank per host over gloo, each
rank's shard ``--mb`` MB (default 256, ~1 GB per version). ``CheckpointConfig(store="ray",
replicas=2, durable_uri=tmp)``; per round: a memory-only save, a ``save(step, persist=True)``
(the host stores write their own ranks' shards from memory, in parallel), and one more
memory-only save while that persist runs. Measured (slowest rank, median over rounds):

- persist throughput: version bytes / (committed -> persisted) seconds, and save -> persisted,
  on rank 0 (the coordinator, which commits the durable version; others poll for it);
- the training-visible cost: ``save()`` stall of a memory-only step, of the persisting step,
  and of the next step while the persist is still writing.

Baselines on the same bytes: ``dcp.save`` of the whole state from one process (``no_dist``,
single writer: the driver holds a ~1 GB state of the same shapes) and ``dcp.save`` from the 4
ranks (each writes its shard, DCP's default). All on this machine's local disk; the page cache
is not dropped between writes (writes are measured until ``dcp.save`` / the persist returns,
not until fsync, for both).

Usage::

    python benchmarks/bench_persist.py            # 256 MB per rank
    python benchmarks/bench_persist.py --quick    # 16 MB per rank, one round

Writes ``benchmarks/results/persist.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402

import _raybench as rb  # noqa: E402
from _common import write_report  # noqa: E402

HOSTS = 4


def _single_process_dcp_save(total_bytes: int, path: str, repeats: int) -> float:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    layer = rb.LAYER_DIM * rb.LAYER_DIM
    n = max(1, round(total_bytes / (layer * 4)))
    sd = {"model": {f"{i}.weight": torch.rand(rb.LAYER_DIM, rb.LAYER_DIM) for i in range(n)}}
    times = []
    for i in range(repeats):
        p = f"{path}_{i}"
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=p, no_dist=True)
        times.append(time.perf_counter() - t0)
        rb.rmtree(p)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="shard size per rank in MB (default 256)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 MB shards, one round")
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
            "persist.json",
        ),
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 16, 1

    plasma = max(256, 3 * min(args.mb, 64) * 2 + 64) * 2**20
    workdir = tempfile.mkdtemp(prefix="gemini_bench_persist_", dir=os.environ.get("BENCH_DISK_DIR"))
    ns = f"bench-persist-{os.getpid()}"
    cluster = rb.start_cluster(HOSTS, plasma)
    try:
        ranks, shard_bytes = rb.make_ranks(HOSTS, args.mb)
        cfg = dict(
            namespace=ns,
            replicas=2,
            keep_in_memory=1,
            durable_uri=os.path.join(workdir, "durable"),
            keep_durable=1,
            persist_every=0,
            persist_on_close=False,
        )
        per_rank = ray.get([r.persist_run.remote(args.rounds, **cfg) for r in ranks], timeout=3600)
        dist_times = []
        for i in range(max(1, args.rounds)):
            p = os.path.join(workdir, f"dcp_dist_{i}")
            dist_times.append(max(ray.get([r.dcp_save.remote(p) for r in ranks], timeout=1800)))
            rb.rmtree(p)
        rb.kill_ranks(ranks)
    finally:
        rb.stop_cluster(cluster, [ns])
    try:
        total = HOSTS * shard_bytes
        single = _single_process_dcp_save(total, os.path.join(workdir, "dcp_single"), max(1, args.rounds))
    finally:
        rb.rmtree(workdir)

    def agg(key: str) -> float:
        return statistics.median(max(r[i][key] for r in per_rank) for i in range(len(per_rank[0])))

    def coordinator(key: str) -> float:
        # Rank 0 commits the durable version; other ranks only poll the tier for it.
        return statistics.median(r[key] for r in per_rank[0])

    persist_s = coordinator("committed_to_persisted_s")
    dist_s = statistics.median(dist_times)
    result = {
        "question": "persist throughput from host stores vs dcp.save; save() stall of persisting vs memory-only steps",
        "hosts": HOSTS,
        "shard_mb_requested": args.mb,
        "shard_bytes": shard_bytes,
        "total_bytes": total,
        "rounds": args.rounds,
        "persist": {
            "committed_to_persisted_s": persist_s,
            "save_to_persisted_s": coordinator("save_to_persisted_s"),
            "save_to_committed_s": agg("save_to_committed_s"),
            "gbps": total / persist_s / 1e9,
        },
        "dcp_save_single_process": {"seconds": single, "gbps": total / single / 1e9},
        "dcp_save_4_ranks": {"seconds": dist_s, "gbps": total / dist_s / 1e9},
        "stall": {
            "memory_only_s": agg("memory_stall_s"),
            "persisting_step_s": agg("persist_step_stall_s"),
            "next_step_during_persist_s": agg("stall_during_persist_s"),
        },
        "speedup_vs_single_process_dcp_save": single / persist_s,
        "load_average_end": rb.load_average(),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "raw": per_rank,
    }
    return write_report(args.out, result, _markdown(result))


def _markdown(result: dict) -> str:
    p, s = result["persist"], result["stall"]
    lines = [
        f"{result['hosts']} simulated hosts on {result['machine']['cpus']} cores, "
        f"{result['total_bytes'] / 1e9:.2f} GB per version ({result['shard_bytes'] / 1e6:.0f} MB per rank), "
        f"median of {result['rounds']} round(s), slowest rank; load average at end "
        f"{result['load_average_end'][0]:.1f}",
        "",
        "| method | seconds | GB/s |",
        "|---|---|---|",
        f"| gemini_ckpt persist (host stores write in parallel), committed -> persisted "
        f"| {p['committed_to_persisted_s']:.3f} | {p['gbps']:.2f} |",
        f"| gemini_ckpt save -> persisted | {p['save_to_persisted_s']:.3f} | - |",
        f"| stock dcp.save, one process | {result['dcp_save_single_process']['seconds']:.3f} "
        f"| {result['dcp_save_single_process']['gbps']:.2f} |",
        f"| stock dcp.save, 4 ranks | {result['dcp_save_4_ranks']['seconds']:.3f} "
        f"| {result['dcp_save_4_ranks']['gbps']:.2f} |",
        "",
        "| save() stall | seconds |",
        "|---|---|",
        f"| memory-only step | {s['memory_only_s']:.3f} |",
        f"| persisting step | {s['persisting_step_s']:.3f} |",
        f"| next step while the persist writes | {s['next_step_during_persist_s']:.3f} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
