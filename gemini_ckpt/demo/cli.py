"""``python -m gemini_ckpt demo``: a host dies mid-run and training resumes from peer memory.

Starts a local Ray cluster of simulated hosts (one Ray node each), trains the tiny LM of
:mod:`gemini_ckpt.toy` with Ray Train (one worker per host, gloo, FSDP2), checkpoints every
step into the host stores' memory (``replicas`` copies) and every 10th step to durable storage
under ``--out``, and at ``--kill-at-step`` hits one host with ``--fault``: ``host`` kills it hard
(its raylet and every process on it, host store included) and adds a replacement host,
``process`` SIGKILLs its training worker, ``hang`` SIGSTOPs it. Ray Train replaces only the
failed worker (in-place recovery; ``--full-restart`` restarts them all), every rank rolls back
to the newest committed version, and the demo prints a report: where the failure hit, which
step was restored and from where, each stage of the recovery and whose it is, the steps lost
against a durable-only setup, the stall per save, and a PNG timeline.

This module is the command line only: the options are in :mod:`.options`, the driver that runs
the demo (and how the failure is injected) in :mod:`.driver`, the report in :mod:`.report`, and
:func:`~gemini_ckpt.demo.job.train_loop`, the training function (the tests run it too), in
:mod:`.job`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .driver import run_demo
from .options import FAULTS, DemoOptions


# --- CLI -----------------------------------------------------------------------------------------
def add_demo_command(subcommands: argparse._SubParsersAction) -> None:
    """Register ``demo`` on the ``python -m gemini_ckpt`` parser."""
    d = DemoOptions()
    p = subcommands.add_parser(
        "demo",
        help="kill a host mid-run on a local Ray cluster and resume from peer memory",
        description="Train a tiny LM with Ray Train on simulated hosts, checkpoint every step to peer "
        "memory, kill a host, resume from memory, and report what it cost.",
    )
    p.add_argument("--hosts", type=int, default=d.hosts, help="simulated hosts (Ray nodes), one worker each")
    p.add_argument("--replicas", type=int, default=d.replicas, help="copies of each shard in memory")
    p.add_argument(
        "--fault",
        choices=FAULTS,
        default=d.fault,
        help="host: the host dies (raylet and every process) and a replacement joins; process: its "
        "training worker is SIGKILLed; hang: its training worker is SIGSTOPped",
    )
    p.add_argument("--kill-host", type=int, default=d.kill_host, help="host the fault hits (0-based)")
    p.add_argument(
        "--full-restart",
        action="store_true",
        help="let Ray Train restart every worker at the failure (default: replace only the failed one "
        "and keep the others' processes: in-place recovery)",
    )
    p.add_argument(
        "--hang-s",
        type=float,
        default=d.hang_s,
        help="with --fault hang: seconds without an answer before Ray Train counts a worker as failed",
    )
    p.add_argument(
        "--no-replacement",
        action="store_true",
        help="with --fault host: no host takes the lost one's place; the run is elastic (one rank per host, "
        "at least half the hosts) and goes on with the hosts left, restoring from memory",
    )
    p.add_argument(
        "--host-returns",
        type=float,
        metavar="S",
        help="with --no-replacement: the lost host joins again S seconds after the failure, and the run grows "
        "back to every host",
    )
    p.add_argument("--kill-at-step", type=int, default=d.kill_at_step, help="kill once this step is done")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--persist-every", type=int, default=d.persist_every, help="durable version every N steps")
    p.add_argument("--no-failure", action="store_true", help="run without killing a host")
    p.add_argument("--out", default=d.out, help="directory for durable versions, the report and the timeline")
    p.add_argument(
        "--network",
        choices=("loopback", "netns"),
        default=d.network,
        help="netns: each host in its own network namespace with its own address (needs root)",
    )
    p.add_argument("--link", metavar="RATE", help="with --network netns: each host's link rate, e.g. 1gbit")
    p.set_defaults(func=_run_cli)


def missing_extra() -> Optional[str]:
    """What the ``gemini_ckpt[demo]`` extra provides and is not installed, or None."""
    import importlib.util

    missing = [m for m in ("matplotlib", "torchdata") if importlib.util.find_spec(m) is None]
    return ", ".join(missing) or None


def _run_cli(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        print(
            f"error: the demo needs {missing} (the optional extra gemini_ckpt[demo]); install it with "
            f'`python -m pip install -c constraints.txt -e ".[demo]"` in a checkout, or '
            f"`python -m pip install 'gemini_ckpt[demo]'`",
            file=sys.stderr,
        )
        return 2
    try:
        options = DemoOptions(
            hosts=args.hosts,
            replicas=args.replicas,
            kill_host=args.kill_host,
            kill_at_step=args.kill_at_step,
            steps=args.steps,
            persist_every=args.persist_every,
            failure=not args.no_failure,
            out=args.out,
            network=args.network,
            link=args.link,
            fault=args.fault,
            in_place=not args.full_restart,
            hang_s=args.hang_s,
            replacement=not args.no_replacement,
            host_returns_s=args.host_returns,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = run_demo(options)
    print(report.format())
    if options.failure and report.restored_step is None:
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemini_ckpt")
    add_demo_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
