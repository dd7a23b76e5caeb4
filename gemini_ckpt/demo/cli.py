"""``python -m gemini_ckpt demo``: a host dies mid-run and training resumes from peer memory.

Starts a local Ray cluster of simulated hosts (one Ray node each), trains the tiny LM of
:mod:`gemini_ckpt.toy` with Ray Train (one worker per host, gloo, FSDP2), checkpoints every
step into the host stores' memory (``replicas`` copies) and every 10th step to durable storage
under ``--out``, kills one host hard at ``--kill-at-step`` (its raylet and every process on it,
host store included), adds a replacement host, lets Ray Train restart the workers, and prints
a report: where the failure hit, which step was restored and from where, the steps lost
against a durable-only setup, the restore time, the stall per save, and a PNG timeline.

How the failure is injected: rank 0 sends its progress to a small actor on the head node;
the driver polls it and removes the node once rank 0 has finished ``--kill-at-step``.

:func:`train_loop` is the training function (the tests run it too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..cli.quiet import expected_deaths_hidden
from .job import RAY_NAMESPACE, Progress, digest_state, train_loop  # noqa: F401  (re-exported)

OBJECT_STORE_BYTES = 96 << 20


@dataclass(frozen=True)
class DemoOptions:
    hosts: int = 4
    replicas: int = 2
    kill_host: int = 1
    kill_at_step: int = 34
    steps: int = 60
    persist_every: int = 10
    failure: bool = True
    out: str = "runs"

    def __post_init__(self) -> None:
        if self.hosts < 1 or not 1 <= self.replicas <= self.hosts:
            raise ValueError(f"--replicas must be between 1 and --hosts ({self.hosts}), got {self.replicas}")
        if self.steps < 2:
            raise ValueError("--steps must be at least 2")
        if self.failure:
            if not 0 <= self.kill_host < self.hosts:
                raise ValueError(f"--kill-host must be between 0 and {self.hosts - 1}, got {self.kill_host}")
            if not 0 <= self.kill_at_step < self.steps - 1:
                raise ValueError(f"--kill-at-step must be between 0 and --steps - 2 ({self.steps - 2})")
            if self.replicas < 2:
                print("note: with --replicas 1 a dead host's shards have no other copy: the restore "
                      "falls back to durable storage", file=sys.stderr)


# --- the cluster ---------------------------------------------------------------------------------
def start_cluster(hosts: int, *, object_store_bytes: int = OBJECT_STORE_BYTES):
    """A head node (no CPUs: it runs Ray Train's controller and the registry, never a worker)
    plus ``hosts`` simulated hosts with one CPU each (:class:`~gemini_ckpt.ray.local.LocalCluster`),
    this process connected."""
    from ..ray.local import LocalCluster

    return LocalCluster(hosts, head_cpus=0, object_store_bytes=object_store_bytes).start()


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class DemoReport:
    options: DemoOptions
    run_dir: str
    seconds: float
    failure_step: Optional[int] = None  # last step finished before the host died
    failure_t: Optional[float] = None
    restored_step: Optional[int] = None
    restored_from: Optional[str] = None
    restore_s: Optional[float] = None
    recovery_s: Optional[float] = None  # failure -> first step after the restore
    bytes_local: int = 0
    bytes_peer: int = 0
    bytes_durable: int = 0
    durable_before_failure: Optional[int] = None
    stalls_s: list = field(default_factory=list)
    commit_s: list = field(default_factory=list)
    persisted: list = field(default_factory=list)
    reported: list = field(default_factory=list)
    ray_checkpoint: Optional[str] = None
    final_loss: Optional[float] = None
    timeline: Optional[str] = None
    final_digest: Optional[str] = None  # of the final model and optimizer state (rank 0)
    stages: list = field(default_factory=list)  # (seconds after the failure, what, whose) in order
    step_s: list = field(default_factory=list)  # rank 0's step times (save included), restarts left out
    after_persist_s: list = field(default_factory=list)  # the step after each persisted version

    @property
    def steps_lost(self) -> Optional[int]:
        if self.failure_step is None or self.restored_step is None:
            return None
        # The kill is asynchronous: training may finish (and commit) a step or two more first.
        return max(0, self.failure_step - self.restored_step)

    @property
    def steps_lost_durable_only(self) -> Optional[int]:
        if self.failure_step is None:
            return None
        base = -1 if self.durable_before_failure is None else self.durable_before_failure
        return self.failure_step - base

    def format(self) -> str:
        o = self.options
        lines = ["", "=" * 78, "gemini_ckpt demo: report", "=" * 78,
                 f"setup        {o.hosts} hosts x 1 rank (Ray Train, gloo, FSDP2), replicas={o.replicas}, "
                 f"every step to memory, every {o.persist_every}th to {os.path.relpath(self.run_dir)}"]
        if not o.failure:
            lines.append("failure      none (--no-failure)")
        if self.failure_step is not None:
            lines.append(f"failure      host {o.kill_host} killed (raylet and all its processes) after step "
                         f"{self.failure_step} finished, at t={self.failure_t:.1f}s; a replacement host joined")
        if self.restored_step is not None:
            where = f"local {_mb(self.bytes_local)}, peer {_mb(self.bytes_peer)}" if self.restored_from == "memory" \
                else f"{_mb(self.bytes_durable)}"
            lines.append(f"restored     step {self.restored_step} from {self.restored_from} ({where}, all ranks) "
                         f"in {self.restore_s:.2f}s (slowest rank)")
            if self.recovery_s is not None:
                lines.append(f"recovery     {self.recovery_s:.1f}s from the failure to the next step; seconds after it:")
                lines.append("             " + " > ".join(f"{what} {t:.1f} [{whose}]" for t, what, whose in self.stages))
        if self.steps_lost is not None:
            d = self.durable_before_failure
            redone = (f"redone: {self.restored_step + 1}..{self.failure_step}" if self.steps_lost
                      else "the newest finished step was committed in memory")
            then = f"newest durable version then: step {d}" if d is not None else "none yet: from scratch"
            lines.append(f"steps lost   {self.steps_lost} ({redone}); durable-only checkpointing every "
                         f"{o.persist_every} steps would have lost {self.steps_lost_durable_only} ({then})")
        elif o.failure:
            lines.append("steps lost   unknown: no restore was recorded")
        if self.stalls_s:
            ms = sorted(1e3 * s for s in self.stalls_s)
            lines.append(f"save stall   median {statistics.median(ms):.1f} ms, p95 {_pct(ms, 95):.1f} ms, "
                         f"max {ms[-1]:.1f} ms over {len(ms)} saves (rank 0; the copy into staging buffers, "
                         f"plus any wait for the previous version)")
        if self.commit_s:
            ms = sorted(1e3 * s for s in self.commit_s)
            lines.append(f"commit       median {statistics.median(ms):.0f} ms from save() to every copy acknowledged "
                         f"({len(ms)} versions)")
        if self.step_s:
            med = statistics.median(self.step_s)
            text = f"step time    median {1e3 * med:.0f} ms (rank 0, save included)"
            if self.after_persist_s:
                after = statistics.median(self.after_persist_s)
                text += (f"; the step after a persisted version median {1e3 * after:.0f} ms ({after / med:.2f}x, "
                         f"{len(self.after_persist_s)} versions)")
            lines.append(text)
        if self.persisted:
            lines.append(f"persisted    steps {', '.join(map(str, sorted(set(self.persisted))))}; "
                         f"Ray Train result.checkpoint = {self.ray_checkpoint}")
        if self.final_loss is not None:
            lines.append(f"final loss   {self.final_loss:.3f} (step {o.steps - 1})")
        if self.timeline:
            lines.append(f"timeline     {self.timeline}")
        lines.append(f"run time     {self.seconds:.1f}s")
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _pct(sorted_values: list, q: float) -> float:
    i = min(len(sorted_values) - 1, int(round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print, cluster=None) -> DemoReport:
    """Run the demo end to end. Starts and stops its own local cluster, unless ``cluster`` is
    given (a running :class:`~gemini_ckpt.ray.local.LocalCluster` of at least ``options.hosts``
    hosts, this process connected to it); then it is left running (with the replacement host in it)."""
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    started = time.time()
    run_name = time.strftime("gemini-demo-%Y%m%d-%H%M%S")
    run_dir = os.path.join(os.path.abspath(options.out), run_name)
    own_cluster = cluster is None
    with expected_deaths_hidden():
        if own_cluster:
            echo(f"starting a local Ray cluster: head + {options.hosts} hosts ...")
            cluster = start_cluster(options.hosts)
        try:
            events, t0, result = _train(options, run_name, cluster, echo)
        finally:
            if own_cluster:
                cluster.shutdown()
    report = _build_report(options, events, run_dir, t0, result)
    report.seconds = time.time() - started
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        for e in events:
            f.write(json.dumps({**e, "t": round(e["unix"] - t0, 4)}, default=str) + "\n")
    from .timeline import plot_timeline

    title = f"{options.hosts} hosts, 1 rank each, replicas={options.replicas}: " + (
        f"host {options.kill_host} killed after step {report.failure_step}, restored step "
        f"{report.restored_step} from {report.restored_from}" if options.failure else "no failure")
    report.timeline = plot_timeline([{**e, "t": e["unix"] - t0} for e in events],
                                    os.path.join(run_dir, "timeline.png"), title=title)
    with open(os.path.join(run_dir, "report.txt"), "w") as f:
        f.write(report.format().strip() + "\n")
    return report


def _train(options: DemoOptions, run_name: str, cluster, echo) -> tuple[list[dict], float, Any]:
    """Run ``fit()`` on a thread; the main thread (the only one allowed to add and remove
    nodes) prints progress and kills the host. Returns (events, start time, Result)."""
    import ray
    from ray.train import CheckpointConfig as RayCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .. import CheckpointConfig
    from ..integrations.ray_train import host_stores, ranks_on_hosts

    progress_name = f"{run_name}::progress"
    progress = (ray.remote(Progress).options(name=progress_name, namespace=RAY_NAMESPACE, num_cpus=0,
                                             resources={"node:__internal_head__": 0.001}).remote())
    ckpt_config = CheckpointConfig(replicas=options.replicas, keep_in_memory=2,
                                   persist_every=options.persist_every, timeout_s=60.0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"ckpt": ckpt_config, "steps": options.steps, "progress": progress_name},
        # rank r on host r after every restart, so the replacement of a lost host restores from its memory
        scaling_config=ScalingConfig(num_workers=options.hosts, label_selector=ranks_on_hosts(options.hosts)),
        run_config=RunConfig(name=run_name, storage_path=os.path.abspath(options.out),
                             failure_config=FailureConfig(max_failures=3),
                             checkpoint_config=RayCheckpointConfig(num_to_keep=3)))
    echo(f"training {options.steps} steps on {options.hosts} workers; "
         + (f"host {options.kill_host} will be killed after step {options.kill_at_step}"
            if options.failure else "no failure"))
    box: dict = {}

    def fit() -> None:
        try:
            with host_stores(ckpt_config, run_name=run_name):  # stopped when fit() ends
                box["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = exc

    t0 = time.time()
    thread = threading.Thread(target=fit, name="gemini-demo-fit", daemon=True)
    thread.start()
    events: list[dict] = []
    printer = _Printer(echo, t0)
    killed = not options.failure
    try:
        while True:
            alive = thread.is_alive()
            new = ray.get(progress.since.remote(len(events)), timeout=60)
            events.extend(new)
            for e in new:
                printer(e)
            if not killed and any(e["kind"] == "step" and e["step"] >= options.kill_at_step for e in new):
                events.append(_kill_host(cluster, options.kill_host, echo, t0))
                killed = True
            if not alive:
                break
            time.sleep(0.1)
    finally:
        ray.kill(progress)
    if "error" in box:
        raise box["error"]
    return events, t0, box["result"]


def _kill_host(cluster, i: int, echo, t0: float) -> dict:
    echo(f"[{time.time() - t0:6.1f}s] !!! killing host {i}: its raylet, Ray Train worker and host store die")
    t_kill = time.time()
    cluster.remove_hosts((i,), wait=False)
    cluster.add_host(i)
    echo(f"[{time.time() - t0:6.1f}s] replacement host {i} joined; Ray Train restarts the workers")
    return {"kind": "failure", "host": i, "unix": t_kill, "rank": None}


class _Printer:
    def __init__(self, echo, t0: float) -> None:
        self.echo, self.t0 = echo, t0
        self.committed: Optional[int] = None

    def __call__(self, e: dict) -> None:
        at = f"[{e['unix'] - self.t0:6.1f}s]"
        kind = e["kind"]
        if kind == "step":
            note = f"  (newest committed: {self.committed})" if self.committed is not None else ""
            self.echo(f"{at} step {e['step']:4d}  loss {e['loss']:.3f}  save stall {1e3 * e['stall_s']:5.1f} ms{note}")
        elif kind == "commit":
            self.committed = e["step"] if self.committed is None else max(self.committed, e["step"])
        elif kind == "persist":
            self.echo(f"{at} step {e['step']} persisted to {os.path.relpath(e['location'])}")
        elif kind == "restore" and e["rank"] == 0:
            self.committed = e["step"]
            self.echo(f"{at} restored step {e['step']} from {e['source']} in {e['seconds']:.2f}s "
                      f"(rank 0: local {_mb(e['bytes_local'])}, peer {_mb(e['bytes_peer'])})")
        elif kind == "start" and e["rank"] == 0:
            self.echo(f"{at} workers started (attempt {e['attempt'] + 1})")
        elif kind == "done" and e["rank"] == 0:
            self.echo(f"{at} training finished; durable versions reported to Ray Train by this attempt: "
                      f"steps {e['reported']}")


def _build_report(options: DemoOptions, events: list[dict], run_dir: str, t0: float, result) -> DemoReport:
    report = DemoReport(options=options, run_dir=run_dir, seconds=0.0)
    steps = [e for e in events if e["kind"] == "step"]
    failure = next((e for e in events if e["kind"] == "failure"), None)
    persists = [e for e in events if e["kind"] == "persist"]
    report.stalls_s = [e["stall_s"] for e in steps]
    report.commit_s = [e["latency_s"] for e in events if e["kind"] == "commit"]
    report.persisted = [e["step"] for e in persists]
    report.step_s, report.after_persist_s = step_times(steps, {e["step"] for e in persists})
    done = [e for e in events if e["kind"] == "done" and e["rank"] == 0]
    if done:
        report.final_loss = done[-1]["loss"]
        report.reported = done[-1]["reported"]
        report.persisted = sorted(set(report.persisted) | set(report.reported))  # + persist_on_close
    if result is not None and result.checkpoint is not None:
        report.ray_checkpoint = os.path.relpath(result.checkpoint.path)
    if result is not None and isinstance(result.return_value, dict):
        report.final_digest = result.return_value.get("digest")
    if failure is not None:
        report.failure_t = failure["unix"] - t0
        before = [e["step"] for e in steps if e["unix"] <= failure["unix"] and e["attempt"] == 0]
        report.failure_step = max(before) if before else None
        durable = [e["step"] for e in persists if e["unix"] <= failure["unix"]]
        report.durable_before_failure = max(durable) if durable else None
        restores = [e for e in events if e["kind"] == "restore" and e["unix"] > failure["unix"]]
        if restores:
            report.restored_step = restores[0]["step"]
            report.restored_from = restores[0]["source"]
            report.restore_s = max(e["seconds"] for e in restores)
            report.bytes_local = sum(e["bytes_local"] for e in restores)
            report.bytes_peer = sum(e["bytes_peer"] for e in restores)
            report.bytes_durable = sum(e["bytes_durable"] for e in restores)
            after = [e["unix"] for e in steps if e["unix"] > max(r["unix"] for r in restores)]
            if after:
                report.recovery_s = min(after) - failure["unix"]
            report.stages = recovery_stages(failure["unix"], events, restores, min(after) if after else None)
    return report


def step_times(steps: list[dict], persisted: set) -> tuple[list[float], list[float]]:
    """Rank 0's step times from its step events (the time between two consecutive steps of one
    attempt: compute and ``save()``), and those of the step right after each persisted version
    (when the persist and the report to Ray Train run in the background)."""
    by_step = {}
    for e in steps:
        if e.get("rank", 0) == 0:
            by_step[(e["attempt"], e["step"])] = e["unix"]
    times, after = [], []
    for (attempt, step), unix in sorted(by_step.items()):
        prev = by_step.get((attempt, step - 1))
        if prev is None:
            continue
        times.append(unix - prev)
        if step - 1 in persisted:
            after.append(unix - prev)
    return times, after


def recovery_stages(failure_unix: float, events: list[dict], restores: list[dict],
                    next_step_unix: Optional[float]) -> list[tuple[float, str, str]]:
    """The stages of one recovery, as ``(seconds after the failure, stage, whose)``: the library's
    (``gemini``: the host stores noticed the loss, made the copies again, seeded the replacement;
    the restore), Ray's (the node declared dead) and Ray Train's (its new workers in the training
    function); the slowest rank's times where ranks differ."""
    out: list[tuple[float, str, str]] = []
    recovery = next((r["recovery"][-1] for r in restores if r.get("recovery")), None)
    if recovery:
        for key, what, whose in (("noticed", "stores noticed", "gemini"), ("node_dead", "node dead", "Ray"),
                                 ("rereplicated", "copies made again", "gemini"),
                                 ("replacement_joined", "replacement joined", "cluster"),
                                 ("replacement_seeded", "replacement seeded", "gemini")):
            if recovery.get(key):
                out.append((recovery[key] - failure_unix, what, whose))
    starts = [e["unix"] for e in events if e["kind"] == "start" and e["unix"] > failure_unix]
    if starts:
        out.append((max(starts) - failure_unix, "workers started", "Ray Train"))
    timelines = [dict(r["timeline"]) for r in restores if r.get("timeline")]
    if timelines:
        out.append((max(t["called"] for t in timelines) - failure_unix, "restore called", "user code"))
        out.append((max(t["connected"] for t in timelines) - failure_unix, "connected", "gemini"))
        out.append((max(t["done"] for t in timelines) - failure_unix, "restored", "gemini"))
    if next_step_unix is not None:
        out.append((next_step_unix - failure_unix, "next step done", "user code"))
    return sorted(out)


# --- CLI -----------------------------------------------------------------------------------------
def add_demo_command(subcommands: argparse._SubParsersAction) -> None:
    """Register ``demo`` on the ``python -m gemini_ckpt`` parser."""
    d = DemoOptions()
    p = subcommands.add_parser(
        "demo", help="kill a host mid-run on a local Ray cluster and resume from peer memory",
        description="Train a tiny LM with Ray Train on simulated hosts, checkpoint every step to peer "
                    "memory, kill a host, resume from memory, and report what it cost.")
    p.add_argument("--hosts", type=int, default=d.hosts, help="simulated hosts (Ray nodes), one worker each")
    p.add_argument("--replicas", type=int, default=d.replicas, help="copies of each shard in memory")
    p.add_argument("--kill-host", type=int, default=d.kill_host, help="host to kill (0-based)")
    p.add_argument("--kill-at-step", type=int, default=d.kill_at_step, help="kill once this step is done")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--persist-every", type=int, default=d.persist_every, help="durable version every N steps")
    p.add_argument("--no-failure", action="store_true", help="run without killing a host")
    p.add_argument("--out", default=d.out, help="directory for durable versions, the report and the timeline")
    p.set_defaults(func=_run_cli)


def missing_extra() -> Optional[str]:
    """What the ``gemini_ckpt[demo]`` extra provides and is not installed, or None."""
    import importlib.util

    missing = [m for m in ("matplotlib", "torchdata") if importlib.util.find_spec(m) is None]
    return ", ".join(missing) or None


def _run_cli(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        print(f"error: the demo needs {missing} (the optional extra gemini_ckpt[demo]); install it with "
              f"`python -m pip install -c constraints.txt -e \".[demo]\"` in a checkout, or "
              f"`python -m pip install 'gemini_ckpt[demo]'`", file=sys.stderr)
        return 2
    try:
        options = DemoOptions(hosts=args.hosts, replicas=args.replicas, kill_host=args.kill_host,
                              kill_at_step=args.kill_at_step, steps=args.steps, persist_every=args.persist_every,
                              failure=not args.no_failure, out=args.out)
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
