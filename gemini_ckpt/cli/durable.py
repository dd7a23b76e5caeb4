"""``python -m gemini_ckpt ls URI`` and ``python -m gemini_ckpt verify URI [--step S]``.

Both report damage per version (exit status 1) and never end in a traceback: a tool pointed
at a broken or hostile directory says what is wrong with it. With ``$GEMINI_CKPT_SIGNING_KEY``
set, unsigned or wrongly signed versions are reported as damaged, as restore would refuse them.
Both show each version's health as its manifest records it (``healthy``, ``unchecked``: saved
with ``health_check=None`` or before versions had a verdict, ``UNHEALTHY``: restore skips it).
"""

from __future__ import annotations

import argparse
import json
import time

from ..health import UNCHECKED, Health
from ..durable.tier import DurableTier
from ..signing import resolve_key
from ..trust.metadata import load_metadata


def _problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _health(manifest) -> Health:
    """The manifest's verdict (already validated when the manifest was decoded)."""
    return Health(UNCHECKED) if manifest.health is None else Health.from_json(manifest.health)


def _health_text(health: Health) -> str:
    return f"UNHEALTHY ({health.reason})" if health.unhealthy else health.status


def _ls(args: argparse.Namespace) -> int:
    try:
        tier = DurableTier(args.uri)
        versions = sorted(tier.store.list_versions().items())
        stray = tier.store.stray_entries()
        latest, latest_problem = tier.read_latest()
    except Exception as exc:  # noqa: BLE001 - a tool reports, never crashes
        print(f"{args.uri}: cannot be listed ({_problem(exc)})")
        return 1
    key = resolve_key()
    rows = []
    for step, complete in versions:
        row = {
            "step": step,
            "complete": complete,
            "latest": step == latest,
            "bytes": None,
            "job": {},
            "health": None,
            "problem": None,
        }
        if complete:
            try:
                manifest = tier.store.manifest(step, key=key)  # the signature before .metadata is read
                load_metadata(manifest, key)
                row["bytes"] = manifest.nbytes
                row["job"] = manifest.job
                row["signed"] = manifest.signature is not None
                row["health"] = _health(manifest).to_json()
            except Exception as exc:  # noqa: BLE001 - damage is reported per version
                row["problem"] = _problem(exc)
        rows.append(row)
    bad = any(r["problem"] for r in rows) or latest_problem is not None
    if args.json:
        print(
            json.dumps(
                {
                    "uri": args.uri,
                    "latest": latest,
                    "latest_problem": latest_problem,
                    "ignored": stray,
                    "versions": rows,
                },
                indent=2,
                default=str,
            )
        )
        return 1 if bad else 0
    if not rows:
        print(f"{args.uri}: no versions")
    else:
        print(f"{'step':>10}  {'state':<10}  {'size':>10}  {'world':>5}  {'placement':<12}  {'health':<10}  created")
        for r in rows:
            job = r["job"] if isinstance(r["job"], dict) else {}
            size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
            created = job.get("created_unix")
            try:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created is not None else "-"
            except (TypeError, ValueError, OverflowError, OSError):
                created = "?"
            state = "DAMAGED" if r["problem"] else "complete" if r["complete"] else "INCOMPLETE"
            state += "*" if r["latest"] else ""
            health = Health.from_json(r["health"]) if r["health"] is not None else None
            print(
                f"{r['step']:>10}  {state:<10}  {size:>10}  {str(job.get('world_size', '-')):>5}  "
                f"{str(job.get('placement', '-')):<12}  "
                f"{'-' if health is None else 'UNHEALTHY' if health.unhealthy else health.status:<10}  {created}"
            )
            if r["problem"]:
                print(f"{'':>12}- {r['problem']}")
            if health is not None and health.unhealthy:
                print(f"{'':>12}- unhealthy: {health.reason}")
        print(
            "* = latest. Incomplete versions are never loaded; the next job removes them. "
            "Damaged and unhealthy versions are skipped by restore."
        )
    if latest_problem is not None:
        print(f"warning: {latest_problem}; restore ignores it and the next persist rewrites it")
    for name in stray:
        print(f"ignored: {name} (not a step directory name gemini_ckpt writes)")
    return 1 if bad else 0


def _verify(args: argparse.Namespace) -> int:
    try:
        tier = DurableTier(args.uri)
        steps = [args.step] if args.step is not None else tier.complete_steps()
        _, latest_problem = tier.read_latest()
    except Exception as exc:  # noqa: BLE001 - a tool reports, never crashes
        print(f"{args.uri}: cannot be listed ({_problem(exc)})")
        return 1
    if not steps:
        print(f"{args.uri}: no complete versions to verify")
        return 1
    bad = 0
    for step in steps:
        t0 = time.perf_counter()
        try:
            problems = tier.verify(step)
        except Exception as exc:  # noqa: BLE001 - damage is reported per version
            problems = [_problem(exc)]
        took = time.perf_counter() - t0
        if problems:
            bad += 1
            print(f"step {step}: BAD ({len(problems)} problem(s), {took:.2f}s)")
            for p in problems:
                print(f"  - {p}")
        else:
            try:  # intact: its manifest (checked by verify) says how healthy its state is
                health = _health_text(_health(tier.store.manifest(step)))
            except Exception as exc:  # noqa: BLE001 - a tool reports, never crashes
                health = f"health unknown ({_problem(exc)})"
            print(f"step {step}: ok, {health} ({took:.2f}s)")
    if latest_problem is not None:
        bad += 1
        print(f"latest: BAD ({latest_problem}; restore ignores it and the next persist rewrites it)")
    return 1 if bad else 0


def add_ls_command(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "ls",
        help="list the versions in a durable location",
        description="List versions under URI: complete, incomplete or damaged, size, "
        "job description. Exit status 1 when something is damaged.",
    )
    p.add_argument("uri", help="a local path or pyarrow.fs URI (file://, s3://...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_ls)


def add_verify_command(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "verify",
        help="re-read every byte of durable versions and check checksums",
        description="Exit status 0 when every checked version is intact, 1 otherwise. "
        "Set GEMINI_CKPT_SIGNING_KEY to check signatures too.",
    )
    p.add_argument("uri", help="a local path or pyarrow.fs URI (file://, s3://...)")
    p.add_argument("--step", type=int, default=None, help="verify only this step")
    p.set_defaults(func=_verify)
