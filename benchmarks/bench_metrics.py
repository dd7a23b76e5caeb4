"""What metrics cost: the save() stall and time to safe with ``CheckpointConfig(metrics=True)``
(the default with host stores) against ``metrics=False``, in one run.

    python benchmarks/bench_metrics.py            # ~256 MiB per version, 16 saves each
    python benchmarks/bench_metrics.py --quick    # ~64 MiB, 8 saves each

One Ray node started here, ``store="ray"``, one rank (this process), ``replicas=1``: three
Checkpointers of the same state in three namespaces (three host stores): ``on`` publishes metrics
(the rank's listener on its events thread, its host store's gauges every second), ``off`` and
``control`` do not. They save in turn, the order rotating every step, so background load hits all
alike; ``control`` / ``off`` is the noise floor of the comparison (an A/A run once showed 1.04-1.07
between two Checkpointers without metrics, by creation order alone). For each save: the *stall*
(the ``save()`` call) and the *time to safe* (until ``handle.committed``). The target:
the stall with metrics on within 5% of off, by median. Writes ``benchmarks/results/metrics.json``
and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
import warnings

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from _common import table, write_results  # noqa: E402
from bench_health import alternate, build  # noqa: E402
from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState  # noqa: E402

TARGET = 1.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=5, help="Linear(dim, dim) layers with AdamW state (5: ~256 MiB)")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--saves", type=int, default=16, help="measured saves per config (after 2 warm-up saves)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--control", action="store_true", help="an A/A control: metrics off in both (the noise floor)")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.saves = 1024, 8
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=2)
    try:
        # created in this order: a Checkpointer's position (its store's process, its pool) showed a bias of
        # its own in A/A runs, so "on" sits between two without metrics, and "control" measures the spread
        ckpts, res = {}, {name: {"stall": [], "safe": []} for name in ("off", "on", "control")}
        for name in res:
            model, opt = build(args.layers, args.dim)
            cfg = CheckpointConfig(
                store="ray",
                namespace=f"metrics-{name}-{uuid.uuid4().hex[:6]}",
                replicas=1,
                keep_in_memory=1,
                timeout_s=300,
                metrics=name == "on" and not args.control,
            )
            ckpts[name] = Checkpointer(TrainState(model=model, optimizer=opt), cfg)
        warmup = 2
        staged, _ = alternate(ckpts, res, args.saves, warmup)
        listeners = {n: [type(x).__name__ for x in c._events.listeners] for n, c in ckpts.items()}
        for ckpt in ckpts.values():
            ckpt.close()
    finally:
        ray.shutdown()  # the Ray instance this script started, its host stores with it
    if listeners["on"] != ([] if args.control else ["TrainerMetrics"]) or listeners["off"] or listeners["control"]:
        raise SystemExit(f"metrics were not on in one and off in the other: {listeners}")
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    ratios = {k: med["on"][k] / med["off"][k] for k in ("stall", "safe")}
    control = {k: med["control"][k] / med["off"][k] for k in ("stall", "safe")}
    met = ratios["stall"] <= TARGET
    print(
        f"state: {staged / 2**20:.0f} MiB per version, {args.saves} saves per config after {warmup} warm-up, "
        f"alternating; store='ray', one node"
    )
    rows = [
        [
            what,
            med["off"][k],
            med["on"][k],
            med["control"][k],
            f"{ratios[k]:.3f}",
            f"{control[k]:.3f}",
            f"<= {TARGET}" if k == "stall" else "-",
            ("yes" if ratios[k] <= TARGET else "NO") if k == "stall" else "-",
        ]
        for what, k in (("save() stall", "stall"), ("time to safe (committed)", "safe"))
    ]
    print(
        table(
            [
                "seconds (median)",
                "metrics off",
                "metrics on",
                "off again (control)",
                "on / off",
                "control / off",
                "target",
                "met",
            ],
            rows,
        )
    )
    path = write_results(
        "metrics",
        {
            "staged_bytes": staged,
            "saves": args.saves,
            "quick": args.quick,
            "median_s": med,
            "samples_s": res,
            "ratio_on_off": ratios,
            "ratio_control_off": control,
            "target_ratio": TARGET,
            "target_met": met,
            "note": "one process, store='ray' on one Ray node, replicas=1; metrics recorded off the training thread",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
