"""The demo's driver: starts the local cluster, runs ``fit()`` with Ray Train, prints progress,
kills a host and writes the report, the events and the timeline under ``--out``.

How the failure is injected: rank 0 sends its progress to a small actor on the head node;
the driver polls it and removes the node once rank 0 has finished ``--kill-at-step``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable, Optional

from ..cli.quiet import expected_deaths_hidden
from .job import RAY_NAMESPACE, Progress, train_loop
from .options import DemoOptions
from .report import DemoReport, build_report, mb

# what train_loop imports beyond torch, Ray Train and gemini_ckpt's integration (warm_runtime_env adds those)
WARM_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torchdata.stateful_dataloader",
    "gemini_ckpt.toy",
    "gemini_ckpt.demo.job",
)

OBJECT_STORE_BYTES = 96 << 20


# --- the cluster ---------------------------------------------------------------------------------
def start_cluster(
    hosts: int, *, object_store_bytes: int = OBJECT_STORE_BYTES, network: str = "loopback", link: str | None = None
):
    """A head node (no CPUs: it runs Ray Train's controller and the registry, never a worker)
    plus ``hosts`` simulated hosts with one CPU each (:class:`~gemini_ckpt.testing.cluster.LocalCluster`),
    this process connected."""
    from ..testing.cluster import LocalCluster

    return LocalCluster(hosts, head_cpus=0, object_store_bytes=object_store_bytes, network=network, link=link).start()


# --- the driver ----------------------------------------------------------------------------------
def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print, cluster=None) -> DemoReport:
    """Run the demo end to end. Starts and stops its own local cluster, unless ``cluster`` is
    given (a running :class:`~gemini_ckpt.testing.cluster.LocalCluster` of at least ``options.hosts``
    hosts, this process connected to it); then it is left running (with the replacement host in it)."""
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    started = time.time()
    run_name = time.strftime("gemini-demo-%Y%m%d-%H%M%S")
    run_dir = os.path.join(os.path.abspath(options.out), run_name)
    own_cluster = cluster is None
    with expected_deaths_hidden():
        if own_cluster:
            where = (
                ""
                if options.network == "loopback"
                else f", each in its own network namespace{f' on a {options.link} link' if options.link else ''}"
            )
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
        f"{report.failure_text} after step {report.failure_step}, restored step {report.restored_step} from "
        f"{report.restored_from} ({'in place' if options.in_place else 'full restart'})"
        if options.failure
        else "no failure"
    )
    stages = (
        []
        if report.failure_t is None
        else [
            {"kind": "stage", "t": report.failure_t + after, "what": what, "whose": whose}
            for after, what, whose in report.stages
        ]
    )
    report.timeline = plot_timeline(
        [{**e, "t": e["unix"] - t0} for e in events] + stages, os.path.join(run_dir, "timeline.png"), title=title
    )
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
    from ..integrations.ray_train import (
        detection_env,
        host_stores,
        ranks_on_hosts,
        recoverable,
        torch_config,
        warm_runtime_env,
    )

    progress_name = f"{run_name}::progress"
    progress = (
        ray.remote(Progress)
        .options(name=progress_name, namespace=RAY_NAMESPACE, num_cpus=0, resources={"node:__internal_head__": 0.001})
        .remote()
    )
    ckpt_config = CheckpointConfig(
        replicas=options.replicas, keep_in_memory=2, persist_every=options.persist_every, timeout_s=60.0
    )
    if options.in_place:  # Ray Train's controller reads them from this process's environment at fit()
        os.environ.update(detection_env(poll_s=0.25, hang_s=options.hang_s))
    trainer = TorchTrainer(
        recoverable(train_loop) if options.in_place else train_loop,
        torch_config=torch_config(reform_timeout_s=60.0, replace_within_s=REPLACE_WITHIN_S, spares=options.spares)
        if options.in_place
        else None,
        train_loop_config={
            "ckpt": ckpt_config,
            "steps": options.steps,
            "progress": progress_name,
            "full_digests": options.full_digests,
            "checkpoint": options.checkpoint,
        },
        scaling_config=_scaling(options, ScalingConfig, ranks_on_hosts),
        run_config=RunConfig(
            name=run_name,
            storage_path=os.path.abspath(options.out),
            # each Train worker (a warm spare too) imports what train_loop does as it starts
            worker_runtime_env=warm_runtime_env(*WARM_MODULES) if options.in_place else None,
            failure_config=FailureConfig(max_failures=-1 if options.in_place else 3),
            checkpoint_config=RayCheckpointConfig(num_to_keep=3),
        ),
    )
    echo(
        f"training {options.steps} steps on {options.hosts} workers; "
        + (
            f"{FAULT_TEXT[options.fault if options.replacement else 'host-alone'].format(host=options.kill_host)} "
            f"after step {options.kill_at_step}; "
            + ("only the failed worker is replaced (in place)" if options.in_place else "every worker restarts")
            if options.failure
            else "no failure"
        )
    )
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
    returns_at = None
    read = 0  # the progress actor's events read so far (the driver adds its own to ``events``)
    try:
        while True:
            alive = thread.is_alive()
            new = ray.get(progress.since.remote(read), timeout=60)
            read += len(new)
            events.extend(new)
            for e in new:
                printer(e)
            if not killed and any(e["kind"] == "step" and e["step"] >= options.kill_at_step for e in new):
                events.append(_inject(options, cluster, events, echo, t0))
                killed = True
                if options.host_returns_s is not None:
                    returns_at = time.time() + options.host_returns_s
            if returns_at is not None and time.time() >= returns_at:
                returns_at = None
                cluster.add_host(options.kill_host)
                echo(f"[{time.time() - t0:6.1f}s] host {options.kill_host} joined again")
                events.append({"kind": "host_joined", "host": options.kill_host, "unix": time.time(), "rank": None})
            if not alive:
                break
            time.sleep(0.1)
    finally:
        ray.kill(progress)
    if "error" in box:
        raise box["error"]
    return events, t0, box["result"]


REPLACE_WITHIN_S = 2.0  # an elastic run: how long a lost host's place is kept for a node to take it
ELASTIC_MONITOR_S = 5.0  # how often Ray Train looks for hosts to grow back onto (its default: 60 s)


def _scaling(options: DemoOptions, ScalingConfig, ranks_on_hosts):
    """The demo's ``ScalingConfig``: rank r on host r after every restart (so the replacement of a
    lost host restores from its memory), or for an elastic run one rank per host, on any host."""
    if options.elastic:
        return ScalingConfig(
            num_workers=(options.min_workers, options.hosts),
            placement_strategy="STRICT_SPREAD",
            elastic_resize_monitor_interval_s=ELASTIC_MONITOR_S,
        )
    return ScalingConfig(num_workers=options.hosts, label_selector=ranks_on_hosts(options.hosts))


FAULT_TEXT = {
    "host": "host {host} will be killed",
    "host-alone": "host {host} will be killed, and no host takes its place",
    "process": "the worker on host {host} will be SIGKILLed",
    "hang": "the worker on host {host} will be SIGSTOPped",
}


def _inject(options: DemoOptions, cluster, events: list[dict], echo, t0: float) -> dict:
    """The failure (main thread: the only one that may remove and add hosts)."""
    i = options.kill_host
    if options.fault == "host":
        echo(f"[{time.time() - t0:6.1f}s] !!! killing host {i}: its raylet, Ray Train worker and host store die")
        t_kill = time.time()
        cluster.remove_hosts((i,), wait=False)
        if options.replacement:
            cluster.add_host(i)
            echo(f"[{time.time() - t0:6.1f}s] replacement host {i} joined")
        else:
            echo(f"[{time.time() - t0:6.1f}s] no host takes its place: the run goes on with {options.hosts - 1}")
        return {"kind": "failure", "fault": "host", "host": i, "unix": t_kill, "rank": None}
    # rank i runs on host i (ranks_on_hosts); its newest process, from the workers' start events
    pid = [e["pid"] for e in events if e["kind"] == "start" and e["rank"] == i][-1]
    signum = signal.SIGKILL if options.fault == "process" else signal.SIGSTOP
    echo(
        f"[{time.time() - t0:6.1f}s] !!! {signal.Signals(signum).name} to the training worker of host {i} "
        f"(rank {i}, pid {pid})"
    )
    t_kill = time.time()
    os.kill(pid, signum)  # the local cluster's hosts are processes of this machine
    return {"kind": "failure", "fault": options.fault, "host": i, "unix": t_kill, "rank": i, "pid": pid}


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
            self.echo(
                f"{at} restored step {e['step']} from {e['source']} in {e['seconds']:.2f}s "
                f"(rank 0: local {mb(e['bytes_local'])}, peer {mb(e['bytes_peer'])})"
            )
        elif kind == "start" and e["rank"] == 0:
            self.echo(f"{at} workers started (attempt {e['attempt'] + 1})")
        elif kind == "done" and e["rank"] == 0:
            self.echo(
                f"{at} training finished; durable versions reported to Ray Train by this attempt: steps {e['reported']}"
            )
