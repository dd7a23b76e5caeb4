"""``python -m gemini_ckpt ls URI`` and ``python -m gemini_ckpt verify URI [--step S]``."""

from __future__ import annotations

import argparse
import json
import time

from ._durable import DurableTier


def _ls(args: argparse.Namespace) -> int:
    tier = DurableTier(args.uri)
    latest = tier.latest()
    rows = []
    for step, complete in sorted(tier.store.list_versions().items()):
        row = {"step": step, "complete": complete, "latest": step == latest, "bytes": None, "job": {}}
        if complete:
            manifest = tier.store.manifest(step)
            row["bytes"] = manifest.nbytes
            row["job"] = manifest.job
        rows.append(row)
    if args.json:
        print(json.dumps({"uri": args.uri, "latest": latest, "versions": rows}, indent=2))
        return 0
    if not rows:
        print(f"{args.uri}: no versions")
        return 0
    print(f"{'step':>10}  {'state':<10}  {'size':>10}  {'world':>5}  {'placement':<12}  created")
    for r in rows:
        job = r["job"]
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_unix"])) \
            if "created_unix" in job else "-"
        state = ("complete" if r["complete"] else "INCOMPLETE") + ("*" if r["latest"] else "")
        print(f"{r['step']:>10}  {state:<10}  {size:>10}  {job.get('world_size', '-'):>5}  "
              f"{str(job.get('placement', '-')):<12}  {created}")
    print("* = latest. Incomplete versions are never loaded; the next job removes them.")
    return 0


def _verify(args: argparse.Namespace) -> int:
    tier = DurableTier(args.uri)
    steps = [args.step] if args.step is not None else tier.complete_steps()
    if not steps:
        print(f"{args.uri}: no complete versions to verify")
        return 1
    bad = 0
    for step in steps:
        t0 = time.perf_counter()
        try:
            problems = tier.verify(step)
        except LookupError as exc:
            problems = [str(exc)]
        took = time.perf_counter() - t0
        if problems:
            bad += 1
            print(f"step {step}: BAD ({len(problems)} problem(s), {took:.2f}s)")
            for p in problems:
                print(f"  - {p}")
        else:
            print(f"step {step}: ok ({took:.2f}s)")
    return 1 if bad else 0


def add_ls_command(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("ls", help="list the versions in a durable location",
                               description="List versions under URI: complete or not, size, job description.")
    p.add_argument("uri", help="a local path or pyarrow.fs URI (file://, s3://...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_ls)


def add_verify_command(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("verify", help="re-read every byte of durable versions and check checksums",
                               description="Exit status 0 when every checked version is intact, 1 otherwise.")
    p.add_argument("uri", help="a local path or pyarrow.fs URI (file://, s3://...)")
    p.add_argument("--step", type=int, default=None, help="verify only this step")
    p.set_defaults(func=_verify)
