"""``python -m placement advise``: ETTR per checkpoint setting, and the one to use."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import fields
from typing import Any

from ._advise import advise_models
from ._advise_text import advice_text
from ._advise_args import commit_seconds, count, count_or_zero, number, number_or_zero, replica_counts
from ._bench import BENCH_FIELDS, BenchCosts, read_bench
from ._errors import PlacementError
from ._inputs import DOMAIN_LAYOUTS, HOUR, Costs, FailureModel, check_number

__all__ = ["add_parser", "run"]

# Field of FailureModel/Costs -> the flag that sets it (errors name the flag).
_FLAGS = {
    "hosts": "--hosts",
    "ranks_per_host": "--ranks-per-host",
    "host_mtbf_h": "--host-mtbf",
    "process_mtbf_h": "--process-mtbf",
    "domain_size": "--domain-size",
    "domain_mtbf_h": "--domain-mtbf",
    "domain_layout": "--domain-layout",
    "step_s": "--step-time",
    "stall_s": "--stall",
    "commit_s": "--commit-time",
    "persist_s": "--persist-time",
    "persist_stall_s": "--persist-stall",
    "restore_local_s": "--restore-local",
    "restore_peer_s": "--restore-peer",
    "restore_durable_s": "--restore-durable",
    "restart_process_s": "--restart-process",
    "restart_host_s": "--restart-host",
    "durable_save_s": "--durable-save",
    "max_persist_h": "--max-persist-hours",
    "replicas": "--replicas",
    "from_bench": "--from-bench",
    "events": "--simulate",
    "plot": "--plot",
}
_COST_FIELDS = tuple(f.name for f in fields(Costs))
_PLOT_HOSTS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def add_parser(sub: Any) -> None:
    """Register the ``advise`` subcommand on the main parser's subparsers."""
    p = sub.add_parser(
        "advise",
        help="expected effective training time (ETTR) per checkpoint setting, and the best",
        description="Expected effective training time ratio (ETTR) and wasted hours per day "
        "for each checkpoint setting (replicas x placement x persist interval) and for "
        "durable-only checkpointing at its optimal (Young/Daly) interval, under Poisson host, "
        "process and failure-domain failures; the planner decides exactly which failures "
        "memory survives.  Every input but --hosts has a default (docs/advise.md).",
    )
    d_fail, d_cost = FailureModel(hosts=1), Costs()
    p.add_argument("--hosts", type=count, required=True, help="number of hosts N")
    p.add_argument("--ranks-per-host", type=count, help=f"default {d_fail.ranks_per_host}")
    p.add_argument(
        "--step-time",
        type=number,
        metavar="S",
        help=f"seconds per training step without checkpointing (default {d_cost.step_s:g})",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--host-mtbf",
        type=number,
        metavar="H",
        help=f"hours between losses of one host (default {d_fail.host_mtbf_h:g})",
    )
    rate.add_argument(
        "--failures-per-day", type=number, metavar="F", help="host losses per host per day (instead of --host-mtbf)"
    )
    p.add_argument(
        "--process-mtbf",
        type=number_or_zero,
        metavar="H",
        help="hours between crashes of a host's training processes while the host "
        f"lives; 0 = none (default {d_fail.process_mtbf_h:g})",
    )
    p.add_argument(
        "--domain-size",
        type=count,
        metavar="HOSTS",
        help="hosts per correlated failure domain (e.g. a rack); needs --domain-mtbf",
    )
    p.add_argument("--domain-mtbf", type=number, metavar="H", help="hours between failures of one whole domain")
    p.add_argument(
        "--domain-layout",
        choices=DOMAIN_LAYOUTS,
        help="contiguous: slots in rank order, a domain's hosts adjacent (the library "
        "without failure_domain; default); spread: copies kept in different domains "
        "(CheckpointConfig(failure_domain=...))",
    )
    costs = p.add_argument_group("costs, in seconds (--from-bench reads measured ones)")
    costs.add_argument(
        "--stall", type=number_or_zero, metavar="S", help=f"training stall of one save() (default {d_cost.stall_s:g})"
    )
    costs.add_argument(
        "--commit-time",
        type=commit_seconds,
        metavar="S|M=S,...",
        help="save() to committed in memory; one value, or per replicas "
        "(default " + ",".join(f"{m}={c:g}" for m, c in enumerate(d_cost.commit_s, 1)) + ")",
    )
    costs.add_argument(
        "--persist-time", type=number_or_zero, metavar="S", help=f"committed to durable (default {d_cost.persist_s:g})"
    )
    costs.add_argument(
        "--persist-stall",
        type=number_or_zero,
        metavar="S",
        help=f"extra stall per persisted version (default {d_cost.persist_stall_s:g})",
    )
    for flag, name in (
        ("--restore-local", "restore_local_s"),
        ("--restore-peer", "restore_peer_s"),
        ("--restore-durable", "restore_durable_s"),
        ("--restart-process", "restart_process_s"),
        ("--restart-host", "restart_host_s"),
    ):
        costs.add_argument(flag, type=number_or_zero, metavar="S", help=f"default {getattr(d_cost, name):g}")
    costs.add_argument(
        "--durable-save",
        type=number_or_zero,
        metavar="S",
        help="stall of one blocking durable checkpoint, the durable-only "
        f"baseline's cost C (default {d_cost.durable_save_s:g})",
    )
    costs.add_argument(
        "--from-bench",
        action="append",
        metavar="PATH",
        help="JSON written by `python -m benchmarks`, or its results directory; repeatable; flags given explicitly win",
    )
    p.add_argument(
        "--max-persist-hours",
        type=number,
        metavar="H",
        default=3.0,
        help="longest persist interval considered (default 3)",
    )
    p.add_argument(
        "--replicas",
        type=replica_counts,
        default=(1, 2, 3),
        metavar="M,M,...",
        help="copy counts to compare (default 1,2,3)",
    )
    p.add_argument(
        "--simulate",
        type=count_or_zero,
        default=20000,
        metavar="EVENTS",
        help="Monte-Carlo check of the recommended and durable-only settings, "
        "failures replayed each (default 20000; 0 = off)",
    )
    p.add_argument("--seed", type=count_or_zero, default=0, help="Monte-Carlo seed (default 0)")
    p.add_argument("--durable-uri", default="runs/my-job", help="for the CheckpointConfig line")
    p.add_argument(
        "--plot", metavar="FILE.png", help="also draw ETTR vs hosts (16..4096) to this PNG (needs matplotlib)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> str:
    """Build the inputs from flags, bench results and defaults; return what to print."""
    try:
        return _run(args)
    except PlacementError as exc:
        field, sep, rest = str(exc).partition(":")
        if not (sep and field in _FLAGS):
            raise
        for name, flag in _FLAGS.items():  # the message names fields; the user typed flags
            if "_" in name:
                rest = re.sub(rf"\b{name}\b", flag, rest)
        raise PlacementError(f"{_FLAGS[field]}:{rest}") from None


def _run(args: argparse.Namespace) -> str:
    bench = read_bench(args.from_bench) if args.from_bench else None
    model, costs, origin = _inputs(args, bench)
    cap_s = check_number("max_persist_h", args.max_persist_hours, fix="hours") * HOUR
    advice = advise_models(model, costs, cap_s, args.replicas)
    sims = {}
    if args.simulate:  # the pick and the baseline, replayed through the planner
        for name, est in (("recommended", advice.recommended), ("durable_only", advice.durable_only)):
            sims[name] = (advice.simulate(est, events=args.simulate, seed=args.seed), est)
    plot = _plot(args, model, costs, cap_s) if args.plot else None
    if args.json:
        doc = advice.to_json()
        doc["recommended"]["config"] = advice.recommended.setting.config_line(args.durable_uri)
        doc["inputs"] = {
            "failures": {f.name: getattr(model, f.name) for f in fields(FailureModel)},
            "costs": {f.name: getattr(costs, f.name) for f in fields(Costs)},
            "cost_sources": origin,
            "max_persist_h": args.max_persist_hours,
        }
        if bench is not None:
            doc["inputs"]["bench_files"] = list(bench.files)
            doc["inputs"]["bench_missing"] = list(bench.missing)
        doc["monte_carlo"] = {
            name: {
                "ettr": sim.ettr,
                "analytic_ettr": est.ettr,
                "relative_error": (sim.ettr - est.ettr) / est.ettr if est.ettr else None,
                "events": sim.events,
                "seed": sim.seed,
                "simulated_days": sim.simulated_days,
                "memory_recoveries": sim.memory_recoveries,
                "durable_fallbacks": sim.durable_fallbacks,
            }
            for name, (sim, est) in sims.items()
        }
        doc["plot"] = plot
        return json.dumps(doc, indent=2) + "\n"
    return advice_text(advice, args, origin, bench, sims, plot)


def _inputs(args: argparse.Namespace, bench: BenchCosts | None) -> tuple[FailureModel, Costs, dict[str, str]]:
    """Flag, else bench value, else default; ``origin`` says which for every cost."""
    given: dict[str, Any] = {
        "ranks_per_host": args.ranks_per_host,
        "host_mtbf_h": args.host_mtbf,
        "domain_size": args.domain_size,
        "domain_mtbf_h": args.domain_mtbf,
        "domain_layout": args.domain_layout,
    }
    if args.failures_per_day is not None:
        given["host_mtbf_h"] = 24.0 / args.failures_per_day
    fail = {k: v for k, v in given.items() if v is not None}
    if args.process_mtbf is not None:
        fail["process_mtbf_h"] = args.process_mtbf or None  # 0: no process crashes
    model = FailureModel(hosts=args.hosts, **fail)
    flags = {
        "step_s": args.step_time,
        "stall_s": args.stall,
        "commit_s": args.commit_time,
        "persist_s": args.persist_time,
        "persist_stall_s": args.persist_stall,
        "restore_local_s": args.restore_local,
        "restore_peer_s": args.restore_peer,
        "restore_durable_s": args.restore_durable,
        "restart_process_s": args.restart_process,
        "restart_host_s": args.restart_host,
        "durable_save_s": args.durable_save,
    }
    default = Costs()
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name in _COST_FIELDS:
        if flags[name] is not None:
            values[name], origin[name] = flags[name], _FLAGS[name]
        elif bench is not None and name in bench.values:
            values[name], origin[name] = bench.values[name], "bench: " + bench.sources[name]
        else:
            origin[name] = "default" + (
                " (not in the bench results)" if bench is not None and name in BENCH_FIELDS else ""
            )
    commit = values.get("commit_s")
    if isinstance(commit, dict):  # per replicas from replicate.json; defaults fill the rest
        top = max(len(default.commit_s), *commit)
        filled = [commit.get(m, default.commit(m)) for m in range(1, top + 1)]
        guessed = [str(m) for m in range(1, top + 1) if m not in commit]
        values["commit_s"] = tuple(filled)
        if guessed:
            origin["commit_s"] += f" (replicas {', '.join(guessed)}: default)"
    elif isinstance(commit, float):
        values["commit_s"] = (commit,)
    return model, Costs(**values), origin


# ---- plot ---------------------------------------------------------------------


def _plot(args: argparse.Namespace, model: FailureModel, costs: Costs, cap_s: float) -> str:
    """ETTR vs hosts at fixed per-host failure rates (GEMINI's scaling figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlacementError(
            "plot: matplotlib is not installed; `python -m pip install matplotlib`, or leave out --plot"
        ) from None
    hosts = sorted({*(h for h in _PLOT_HOSTS if h >= (model.domain_size or 1)), model.hosts})
    series: dict[str, list[float]] = {
        "durable only (optimal interval)": [],
        "in memory, replicas=1": [],
        "in memory, recommended": [],
    }
    for n in hosts:
        fm = FailureModel(**{**{f.name: getattr(model, f.name) for f in fields(FailureModel)}, "hosts": n})
        a = advise_models(fm, costs, cap_s, args.replicas)
        local = [e.ettr for e in a.candidates if e.setting.replicas == 1]
        series["durable only (optimal interval)"].append(a.durable_only.ettr)
        series["in memory, replicas=1"].append(max(local) if local else math.nan)
        series["in memory, recommended"].append(a.recommended.ettr)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, ys), style in zip(series.items(), ("s--", "^:", "o-")):
        ax.plot(hosts, [100 * y for y in ys], style, label=label)
    ax.axvline(model.hosts, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(hosts, [str(h) for h in hosts])
    ax.minorticks_off()
    ax.set_xlabel("hosts")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"ETTR vs hosts: host MTBF {model.host_mtbf_h:g} h, step {costs.step_s:g} s", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    plt.close(fig)
    return str(args.plot)
