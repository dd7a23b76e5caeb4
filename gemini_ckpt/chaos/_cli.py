"""``python -m gemini_ckpt chaos``: run the fault matrix on a local cluster of simulated hosts."""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import sys


def add_chaos_command(subcommands: argparse._SubParsersAction) -> None:
    """Register ``chaos`` with the ``python -m gemini_ckpt`` parser."""
    p = subcommands.add_parser(
        "chaos",
        help="inject faults into a training job and check every outcome against the planner",
        description="Train a deterministic job on a local Ray cluster of simulated hosts (one rank per "
        "host), inject faults (killed workers and host stores, lost hosts, faults in the "
        "replicate/commit/persist phases, storage outages, corruption, a smaller world "
        "size), and check that each restore matches the placement planner's prediction "
        "and continues bit-identically. Exit status 1 unless every scenario passes "
        "(a mismatch, an ERROR, or an INFRA-ERROR: the harness's own machinery failed).",
    )
    p.add_argument(
        "--matrix",
        choices=("ci", "full", "inplace", "elastic"),
        default="full",
        help="which scenarios: the reduced CI set, everything (default: full), only the in-place "
        "recovery scenarios (a Ray Train job whose failed worker is replaced alone), or only the elastic "
        "ones (hosts lost with no replacement: the run goes on with fewer workers, and grows back)",
    )
    p.add_argument(
        "--scenario",
        "-k",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only scenarios whose name matches this glob (repeatable)",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument(
        "--job",
        metavar="MODULE:CLASS",
        help="your training job (a class with build(rank, world_size, seed) -> TrainState and "
        "step(step) -> loss); default: a small FSDP2 MLP",
    )
    p.add_argument("--hosts", type=int, default=4, help="simulated hosts, one rank each (default 4)")
    p.add_argument("--replicas", type=int, default=2, help="copies in memory (default 2)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    p.add_argument("--persist-every", type=int, default=2, help="persist every Nth version (default 2)")
    p.add_argument(
        "--domains",
        metavar="D,D,...",
        help="one failure-domain (rack) label per host, e.g. 0,0,1,1: hosts get the node label "
        "rack=D, the job CheckpointConfig(failure_domain='rack'), and kill-rack-D scenarios run",
    )
    p.add_argument(
        "--network",
        choices=("loopback", "netns"),
        default="loopback",
        help="netns: each host's Ray node in its own network namespace with its own address and "
        "link (needs root), and the network scenarios (partition-host, slow-link, "
        "flapping-link, partition-during-persist) run (default: loopback)",
    )
    p.add_argument("--link", metavar="RATE", help="with --network netns: each host's link rate, e.g. 1gbit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="CheckpointConfig.timeout_s of the job")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the table")
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="show Ray's notices about the processes and hosts the harness kills (hidden by default)",
    )
    p.set_defaults(func=_main)


def load_job(spec: str):
    """``module:Class`` -> an instance of the class (the module is shipped to Ray by value)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"--job must look like module:Class, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    module = importlib.import_module(module_name)
    import ray

    ray.cloudpickle.register_pickle_by_value(module)  # rank processes need not import it
    obj = getattr(module, attr)
    return obj() if isinstance(obj, type) else obj


def _main(args: argparse.Namespace) -> int:
    from ._matrix import run_matrix
    from ._scenarios import ci_matrix, full_matrix
    from ._phases import ScenarioError
    from ._spec import ChaosConfig

    try:
        config = ChaosConfig(
            hosts=args.hosts,
            replicas=args.replicas,
            steps=args.steps,
            persist_every=args.persist_every,
            seed=args.seed,
            timeout_s=args.timeout,
            domains=tuple(args.domains.split(",")) if args.domains else None,
            network=args.network,
            link=args.link,
        )
        scenarios = (ci_matrix if args.matrix == "ci" else full_matrix)(config)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from . import _elastic, _inplace

    ray_train = not (args.job or args.network != "loopback" or args.domains)  # the default job and cluster
    inplace = list(_inplace.SCENARIOS) if ray_train and args.matrix != "elastic" else []
    elastic = list(_elastic.SCENARIOS) if ray_train and args.matrix in ("full", "elastic") else []
    if args.matrix == "ci":
        inplace = [s for s in inplace if s.name in _inplace.CI_SCENARIOS]
    elif args.matrix in ("inplace", "elastic"):
        scenarios = []
    if args.scenario:
        scenarios = [s for s in scenarios if any(fnmatch.fnmatch(s.name, pat) for pat in args.scenario)]
        inplace = [s for s in inplace if any(fnmatch.fnmatch(s.name, pat) for pat in args.scenario)]
        elastic = [s for s in elastic if any(fnmatch.fnmatch(s.name, pat) for pat in args.scenario)]
        if not scenarios and not inplace and not elastic:
            print(f"error: no scenario matches {args.scenario}", file=sys.stderr)
            return 2
    if args.list:
        for s in scenarios:
            print(f"{s.name:48s} {s.placement:6s} {s.describe()}")
        for s in inplace:
            print(f"{s.name:48s} {'group':6s} in place: {s.describe()}")
        for s in elastic:
            print(f"{s.name:48s} {'group':6s} elastic: {s.describe()}")
        return 0
    job = load_job(args.job) if args.job else None
    log = (lambda message: None) if args.quiet else None
    from ..cli.quiet import KILLED_PROCESS, expected_deaths_hidden

    code = 0
    with expected_deaths_hidden(() if args.verbose else KILLED_PROCESS):
        if scenarios:
            report = run_matrix(scenarios, config=config, job=job, json_path=args.json, log=log)
            print(report.format_table())
            if args.json:
                print(f"report written to {args.json}")
            code = report.exit_code
        results = []
        if inplace:
            results += _inplace.run_inplace(inplace, log=log)
        if elastic:
            results += _elastic.run_elastic(elastic, log=log)
        if results:
            print(_inplace.format_table(results))
            if args.json:
                _inplace.write_json(results, args.json)
            code = code or (0 if all(r.verdict == "PASS" for r in results) else 1)
    return code
