"""The demo's driver: starts the local cluster, runs ``fit()`` with Ray Train, prints progress,
kills a host and writes the report, the events and the timeline under ``--out``.

How the failure is injected: rank 0 sends its progress to a small actor on the head node;
the driver polls it and removes the node once rank 0 has finished ``--kill-at-step``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Optional

from ..cli.quiet import expected_deaths_hidden
from .job import RAY_NAMESPACE, Progress, train_loop
from .options import DemoOptions
from .report import DemoReport, build_report, mb

OBJECT_STORE_BYTES = 96 << 20


# --- the cluster ---------------------------------------------------------------------------------
def start_cluster(hosts: int, *, object_store_bytes: int = OBJECT_STORE_BYTES, network: str = "loopback",
                  link: str | None = None):
    """A head node (no CPUs: it runs Ray Train's controller and the registry, never a worker)
    plus ``hosts`` simulated hosts with one CPU each (:class:`~gemini_ckpt.ray.local.LocalCluster`),
    this process connected."""
    from ..ray.local import LocalCluster

    return LocalCluster(hosts, head_cpus=0, object_store_bytes=object_store_bytes, network=network,
                        link=link).start()


# --- the driver ----------------------------------------------------------------------------------
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
            where = "" if options.network == "loopback" else \
                f", each in its own network namespace{f' on a {options.link} link' if options.link else ''}"
            echo(f"starting a local Ray cluster: head + {options.hosts} hosts{where} ...")
            cluster = start_cluster(options.hosts, network=options.network, link=options.link)
        try:
            events, t0, result = _train(options, run_name, cluster, echo)
        finally:
            if own_cluster:
                cluster.shutdown()
    report = build_report(options, events, run_dir, t0, result)
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
                      f"(rank 0: local {mb(e['bytes_local'])}, peer {mb(e['bytes_peer'])})")
        elif kind == "start" and e["rank"] == 0:
            self.echo(f"{at} workers started (attempt {e['attempt'] + 1})")
        elif kind == "done" and e["rank"] == 0:
            self.echo(f"{at} training finished; durable versions reported to Ray Train by this attempt: "
                      f"steps {e['reported']}")
