"""The commit's work per version as hosts grow, without CPU contention: the commit protocol's
participants (``gemini_ckpt.commit``: the coordinator and every host's ``HostCommit``) in one
process (``gemini_ckpt.testing.commit_sim.Simulator``), messages delivered in a seeded random order.

    python benchmarks/bench_commit_sim.py [--quick] [--hosts 2,4,...,1024]

Per host count (one rank per host, ``replicas`` copies, placement ``ring``, three versions, the
last one measured): the control messages the coordinator handles per version, the most any one
host store handles, the mean per host, the depth of the decision tree (the hops a vote and a
decision travel: the commit's latency in round trips, beside the data plane's copy), and the CPU
seconds of the whole protocol per version divided by hosts (the work one host does). Linear
growth at the coordinator would show as a coordinator column that grows with hosts; here it
stays at ``2 x fanout``. Output: results/commit_sim.json and a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import RESULTS, machine, table, write_report  # noqa: E402

from gemini_ckpt.commit import COORDINATOR, DEFAULT_FANOUT  # noqa: E402
from gemini_ckpt.testing.commit_sim import Simulator, placed_holders  # noqa: E402

STRATEGY = "ring"


def tree_depth(hosts: int, fanout: int) -> int:
    """Levels of a ``fanout``-ary tree over ``hosts`` slots below the coordinator."""
    depth, covered, level = 0, 0, 1
    while covered < hosts:
        level *= fanout
        covered += level
        depth += 1
    return depth


def measure(hosts: int, replicas: int) -> dict:
    sim = Simulator(
        hosts=hosts, replicas=replicas, holders=placed_holders(hosts, replicas, STRATEGY), keep=2, seed=hosts
    )
    for step in range(2):
        sim.run_version(step)
    t0 = time.process_time()
    report = sim.run_version(2)
    cpu = time.process_time() - t0
    if report.outcome is not True or not report.acknowledged:
        raise RuntimeError(f"{hosts} hosts: version 2 did not commit ({report.outcome})")
    stores = [report.handled(s) for s in range(hosts)]
    return {
        "hosts": hosts,
        "coordinator_messages": report.handled(COORDINATOR),
        "store_messages_max": max(stores),
        "store_messages_mean": round(sum(stores) / hosts, 2),
        "tree_depth": tree_depth(hosts, DEFAULT_FANOUT),
        "cpu_ms_per_host": round(1e3 * cpu / hosts, 4),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 to 256 hosts")
    p.add_argument("--hosts", default=",".join(str(2**k) for k in range(1, 11)))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "commit_sim.json"))
    args = p.parse_args(argv)
    counts = [int(h) for h in args.hosts.split(",")]
    if args.quick:
        counts = [h for h in counts if h <= 256]
    rows = []
    for hosts in counts:
        rows.append(measure(hosts, args.replicas))
        print(f"   {hosts} hosts: {rows[-1]}", flush=True)
    first, last = rows[0], rows[-1]
    growth = {
        "hosts": last["hosts"] / first["hosts"],
        "coordinator": last["coordinator_messages"] / first["coordinator_messages"],
        "store_max": last["store_messages_max"] / first["store_messages_max"],
    }
    result = {
        "machine": machine(),
        "replicas": args.replicas,
        "strategy": STRATEGY,
        "fanout": DEFAULT_FANOUT,
        "rows": rows,
        "growth_first_to_last": growth,
        "model": (
            f"commit latency ~ copy time + (2 x tree depth + 2) x RTT, tree depth = ceil(log_{DEFAULT_FANOUT}) "
            f"levels ({first['tree_depth']} at {first['hosts']} hosts, {last['tree_depth']} at {last['hosts']})"
        ),
    }
    markdown = table(
        ["hosts", "coordinator msgs/version", "max msgs/store", "mean msgs/store", "tree depth", "CPU ms/host"],
        [
            [
                r["hosts"],
                r["coordinator_messages"],
                r["store_messages_max"],
                r["store_messages_mean"],
                r["tree_depth"],
                r["cpu_ms_per_host"],
            ]
            for r in rows
        ],
    )
    markdown += (
        f"\n\n{last['hosts'] // first['hosts']}x the hosts: coordinator messages x{growth['coordinator']:.2f}, "
        f"the busiest store's x{growth['store_max']:.2f}; the decision tree {last['tree_depth']} levels deep"
    )
    return write_report(args.out, result, markdown)


if __name__ == "__main__":
    sys.exit(main())
