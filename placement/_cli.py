"""``python -m placement``: compare strategies, explain a failure, draw a placement,
advise on checkpoint settings (``advise``, in ``_advise_cli``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from fractions import Fraction
from math import comb
from typing import NoReturn

from . import _advise_cli
from ._errors import PlacementError
from ._planner import RecoveryPlan, fatal_count, plan_recovery, recovery_probability, survives
from ._strategies import LAYOUTS as _COMPARED, Placement, domain_violations, make

__all__ = ["main"]

_MATRIX_MAX_HOSTS = 64  # beyond this a who-holds-whom matrix is unreadable


class _Parser(argparse.ArgumentParser):
    # One line on stderr and exit 2, like argparse but without the usage block.
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (errors exit 2 via ``SystemExit``)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            out = _report(args)
        elif args.command == "advise":
            out = _advise_cli.run(args)
        else:
            out = _show(args)
    except PlacementError as exc:
        parser.error(str(exc))
    sys.stdout.write(out)
    return 0


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="placement",
        description="In-memory checkpoint placement: survivability of host failures, "
        "and which checkpoint settings keep the most training time.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{report,show,advise}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hosts", type=_positive, required=True, help="number of hosts N")
        p.add_argument("--replicas", type=_positive, required=True, help="copies in memory m")
        p.add_argument(
            "--domains",
            type=_labels,
            help="one failure-domain label per host, comma separated; 'rackA*4,rackB*4' repeats a label",
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")

    report = sub.add_parser(
        "report",
        help="recovery probability per strategy for k simultaneous failures",
        description="Exact probability of recovering from memory when k hosts fail at "
        "once (all failure sets equally likely), per strategy; or, with --failed, "
        "what recovery does for one failure set.",
    )
    common(report)
    report.add_argument(
        "--strategy",
        choices=(*_COMPARED, "auto", "all"),
        default="all",
        help="strategy to report (default: all)",
    )
    report.add_argument(
        "--max-failures",
        type=_positive,
        metavar="K",
        help="largest k to report (default: min(hosts, replicas + 2))",
    )
    report.add_argument("--failed", type=_hosts, metavar="H,H,...", help="explain this failure set")
    report.add_argument(
        "--no-durable",
        dest="durable",
        action="store_false",
        help="with --failed: durable storage is unreachable too",
    )

    show = sub.add_parser("show", help="draw which hosts hold which hosts' shards")
    common(show)
    show.add_argument("--strategy", choices=(*_COMPARED, "auto"), default="auto")
    _advise_cli.add_parser(sub)
    return parser


# ---- report -----------------------------------------------------------------


def _placements(args: argparse.Namespace) -> tuple[dict[str, Placement], dict[str, str]]:
    names = _COMPARED if args.strategy == "all" else (args.strategy,)
    built: dict[str, Placement] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            p = make(name, hosts=args.hosts, replicas=args.replicas, domains=args.domains)
        except PlacementError as exc:
            if args.strategy != "all" or not str(exc).startswith("strategy:"):
                raise
            skipped[name] = str(exc)  # group when replicas does not divide hosts
            continue
        built[p.strategy] = p  # "auto" shows up under what it resolved to
    return built, skipped


def _report(args: argparse.Namespace) -> str:
    placements, skipped = _placements(args)
    if args.failed is not None:
        return _explain(args, placements, skipped)
    n = args.hosts
    top = args.max_failures if args.max_failures is not None else min(n, args.replicas + 2)
    if top > n:
        raise PlacementError(f"max-failures: must be at most hosts={n}, got {top}")
    rows = []
    for k in range(1, top + 1):
        probs = {name: recovery_probability(p, k) for name, p in placements.items()}
        best_p = max(probs.values())
        rows.append((k, probs, [name for name, q in probs.items() if q == best_p]))

    if args.json:
        doc = {
            "hosts": n,
            "replicas": args.replicas,
            "domains": _domains_json(args.domains),
            "requested": args.strategy,
            "strategies": list(placements),
            "unavailable": skipped,
            "rows": [
                {
                    "k": k,
                    "failure_sets": comb(n, k),
                    "strategies": {
                        name: {
                            "probability": str(q),
                            "percent": _percent_value(q),
                            "fatal_sets": fatal_count(placements[name], k),
                        }
                        for name, q in probs.items()
                    },
                    "best": best,
                }
                for k, probs, best in rows
            ],
        }
        return json.dumps(doc, indent=2) + "\n"

    names = list(placements)
    width = max(9, *(len(name) for name in names))
    lines = [
        f"hosts={n} replicas={args.replicas}" + (f" domains={len(set(args.domains))}" if args.domains else ""),
        f"P(recover from memory | k hosts fail at once, each of the C({n}, k) sets equally likely)",
        "",
        "   k  " + "".join(f"{name:>{width}} " for name in names) + "  best",
    ]
    for k, probs, best in rows:
        cells = "".join(f"{_percent(probs[name]):>{width}} " for name in names)
        tie = "all equal" if len(best) == len(names) > 1 else " = ".join(best)
        lines.append(f"{k:>4}  {cells}  {tie}")
    for name, why in skipped.items():
        lines.append(f"\n{name}: n/a ({why})")
    return "\n".join(lines) + "\n"


def _explain(args: argparse.Namespace, placements: dict[str, Placement], skipped: dict[str, str]) -> str:
    failed = sorted(set(args.failed))
    plans = {name: plan_recovery(p, failed, durable_available=args.durable) for name, p in placements.items()}
    if args.json:
        doc = {
            "hosts": args.hosts,
            "replicas": args.replicas,
            "domains": _domains_json(args.domains),
            "failed": failed,
            "unavailable": skipped,
            "plans": {
                name: {
                    "from_memory": plan.from_memory,
                    "tier": plan.tier,
                    "lost_hosts": list(plan.lost_hosts),
                    "sources": {str(h): s for h, s in enumerate(plan.sources)},
                    "holders": {str(h): list(placements[name].holders(h)) for h in failed},
                }
                for name, plan in plans.items()
            },
        }
        return json.dumps(doc, indent=2) + "\n"
    blocks = [_explain_one(name, placements[name], plan) for name, plan in plans.items()]
    for name, why in skipped.items():
        blocks.append(f"{name}: n/a ({why})\n")
    return "\n".join(blocks)


def _explain_one(name: str, p: Placement, plan: RecoveryPlan) -> str:
    failed = sorted(plan.failed)
    lines = [f"{name}: hosts={p.hosts} replicas={p.replicas}, failed hosts: " + (", ".join(map(str, failed)) or "none")]
    for h in failed:
        holders = ", ".join(map(str, p.holders(h)))
        src = plan.source(h)
        if src is None:
            lines.append(f"  host {h}: LOST - every holder failed (holders {holders})")
        else:
            lines.append(f"  host {h}: read from host {src} (holders {holders})")
    alive = p.hosts - len(failed)
    if alive:
        lines.append(f"  the other {alive} hosts read their own shards from local memory")
    if plan.tier == "memory":
        lines.append("  => recoverable from memory: every host's shards have a live copy")
    else:
        lost = ", ".join(map(str, plan.lost_hosts))
        lines.append(f"  => NOT recoverable from memory: no live copy of the shards of host(s) {lost}")
        if plan.tier == "durable":
            lines.append("  => the durable tier is needed: restore the latest persisted version")
        else:
            lines.append("  => durable storage is unreachable too: nothing to restore from")
    return "\n".join(lines) + "\n"


# ---- show -------------------------------------------------------------------


def _show(args: argparse.Namespace) -> str:
    p = make(args.strategy, hosts=args.hosts, replicas=args.replicas, domains=args.domains)
    clashes = domain_violations(p)
    if args.json:
        doc = {
            "strategy": p.strategy,
            "hosts": p.hosts,
            "replicas": p.replicas,
            "domains": _domains_json(p.domains),
            "holders": {str(h): list(p.holders(h)) for h in range(p.hosts)},
            "held_by": {str(h): list(p.held_by(h)) for h in range(p.hosts)},
            "domain_violations": list(clashes),
        }
        return json.dumps(doc, indent=2) + "\n"

    w = len(str(p.hosts - 1))
    dw = max((len(str(d)) for d in p.domains), default=0) if p.domains else 0
    lines = [f"strategy={p.strategy} hosts={p.hosts} replicas={p.replicas}", ""]
    head = f"{'host':>{max(4, w)}}" + (f"  {'domain':<{max(6, dw)}}" if dw else "")
    lines.append(f"{head}  holders (owner first)   holds shards of")
    for h in range(p.hosts):
        row = f"{h:>{max(4, w)}}" + (f"  {str(p.domains[h]):<{max(6, dw)}}" if dw else "")
        holders = ", ".join(map(str, p.holders(h)))
        held = ", ".join(map(str, p.held_by(h)))
        lines.append(f"{row}  {holders:<22}  {held}")
    if p.hosts <= _MATRIX_MAX_HOSTS:
        lines += ["", "who holds whom (row = holder, column = owner; O own shards, x a copy):"]
        cw = w + 1
        lines.append(" " * (w + 2) + "".join(f"{o:>{cw}}" for o in range(p.hosts)))
        for h in range(p.hosts):
            held = set(p.held_by(h))
            marks = "".join(f"{'O' if o == h else 'x' if o in held else '.':>{cw}}" for o in range(p.hosts))
            lines.append(f"{h:>{w}}  {marks}")
    else:
        lines.append(f"\n(matrix omitted above {_MATRIX_MAX_HOSTS} hosts)")
    if p.domains is not None:
        lines.append("")
        if clashes:
            lines.append(
                "hosts with two copies in one domain (unavoidable for these domains): " + ", ".join(map(str, clashes))
            )
        else:
            lines.append("no host has two copies in one domain")
        by_domain: dict[object, list[int]] = {}
        for h, d in enumerate(p.domains):
            by_domain.setdefault(d, []).append(h)
        for d, members in by_domain.items():
            verdict = "survivable" if survives(p, members) else "NOT survivable from memory"
            lines.append(f"losing all of domain {d} ({len(members)} hosts): {verdict}")
    return "\n".join(lines) + "\n"


# ---- argument types ---------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _hosts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated host ids like 2,3, got {text!r}") from None


def _labels(text: str) -> list[str]:
    labels: list[str] = []
    for part in text.split(","):
        part = part.strip()
        name, star, count = part.rpartition("*")
        if star and count.isdigit() and name:
            labels += [name] * int(count)
        elif part:
            labels.append(part)
        else:
            raise argparse.ArgumentTypeError(f"empty domain label in {text!r}")
    return labels


def _percent(q: Fraction) -> str:
    # Never print a certainty that is not one: 99.9999% shows as >99.99%.
    value = _percent_value(q)
    if value == 100 and q != 1:
        return ">99.99%"
    if value == 0 and q != 0:
        return "<0.01%"
    return f"{value:.2f}%"


def _percent_value(q: Fraction) -> float:
    # Round the exact value, not a float: 2/3 -> 66.67 every time.
    return float(round(q * 100, 2))


def _domains_json(domains: Sequence[object] | None) -> list[str] | None:
    return None if domains is None else [str(d) for d in domains]
