"""What one failure costs a job: GEMINI's wasted time per failure, this library against
durable-only checkpointing of the same job, with the same host loss.

The job: Ray Train on a local cluster of 4 simulated hosts, one FSDP2 rank per host (the demo's
tiny LM plus a sharded ballast buffer, so that each rank's state is ``--mb`` MB), a step of
``--step-s`` seconds (the model's compute is a sleep: the CPU stays free for background work,
as on a GPU host), host 1 removed hard (raylet and every process on it) at the midpoint of a
durable interval, a replacement host added at once, ``FailureConfig(max_failures=1)``.

Three runs of that job, one failure each:

- **gemini_ckpt**: every step saved in memory (``replicas=2``), every ``--persist-every``-th to
  local disk (in the background, from the host stores; the failure is recovered from memory),
  with ``--staging`` (default ``overlap``: the parameters, optimizer state and ballast are
  copied while the next step's forward and backward run, which is where a step spends its
  ``--step-s``: the optimizer step and the save come after it).
- **durable only**: stock ``torch.distributed.checkpoint.save`` (synchronous: training waits)
  every ``N`` steps to a storage throttled to ``--storage-mbps`` MB/s per host (an fsspec
  filesystem that sleeps to hold the rate on every read and write, used through DCP's fsspec
  writer and reader), the stock ``dcp.load`` from it after the failure. ``N`` is Young/Daly's
  interval for the stated MTBF, ``sqrt(2 C MTBF)`` with ``C`` the save time measured first.
- **no checkpointing**: the same job without any checkpointing (it restarts from step 0): how
  long Ray Train alone takes from the failure to the first step after it.

Per failure, for the stated ``--mtbf-s`` (the job's mean time between failures):

- *checkpoint overhead*: what checkpointing stalled training over one MTBF: every step's
  ``save()`` stall, plus any wait of the next ``optimizer.step()`` for an overlapped copy
  (gemini_ckpt: the first ``WARM_UP`` saves after the failure, which plan and make the segments
  the attempt reuses, once per failure, then the mean of the saves before it, measured),
  ``MTBF / (N step)`` durable saves of ``C``, the measured mean (durable only);
- *work lost*: the steps done since the version that was restored (measured);
- *retrieval*: the restore's wall time on the slowest rank (measured);
- *restart*: from the failure to the new workers entering the training function (Ray Train);

wasted = overhead + lost + retrieval (+ restart). GEMINI's headline compares the first sum.

Usage::

    python benchmarks/bench_recovery.py                   # 256 MB per rank, 2 s steps, MTBF 1 h
    python benchmarks/bench_recovery.py --quick           # 16 MB per rank, short steps and MTBF

Writes ``benchmarks/results/recovery.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from _common import write_report  # noqa: E402

HOSTS = 4
KILL_HOST = 1
WARM_UP = 8  # gemini_ckpt's first saves: the plan, and the staging and replica segments a run reuses
TARGET = 13.0  # GEMINI: >13x less time wasted per failure than checkpointing to remote storage
RAY_NAMESPACE = "gemini_bench_recovery"


# --- the throttled storage (durable only) -------------------------------------------------------
def register_throttled(rate_bytes_s: float) -> str:
    """Register the ``throttled://`` fsspec protocol (a local directory read and written at
    ``rate_bytes_s`` per process, the bandwidth a host gets from remote storage); returns it."""
    import fsspec
    from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

    class _Bucket:
        def __init__(self, rate: float) -> None:
            self.rate, self.lock, self.t = rate, threading.Lock(), time.monotonic()

        def take(self, n: int) -> None:
            with self.lock:
                self.t = max(self.t, time.monotonic()) + n / self.rate
                wait = self.t - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    bucket = _Bucket(rate_bytes_s)

    class ThrottledFile(LocalFileOpener):
        def write(self, data):
            bucket.take(memoryview(data).nbytes)
            return super().write(data)

        def read(self, *args):
            out = self.f.read(*args)
            bucket.take(len(out))
            return out

        def readinto(self, b):
            n = self.f.readinto(b)
            bucket.take(n or 0)
            return n

    class ThrottledFS(LocalFileSystem):
        protocol = "throttled"

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            if path.startswith("throttled://"):
                path = path[len("throttled://") :]
            return super()._strip_protocol(path)

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            path = self._strip_protocol(path)
            if self.auto_mkdir and "w" in mode:
                self.makedirs(self._parent(path), exist_ok=True)
            return ThrottledFile(path, mode, fs=self, **kwargs)

    fsspec.register_implementation("throttled", ThrottledFS, clobber=True)
    return "throttled://"


# --- the training function (every Ray Train worker) ----------------------------------------------
def train_loop(config: dict) -> dict:
    import ray.train
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gemini_ckpt import TrainState
    from gemini_ckpt.toy import build_training, lm_loss
    from gemini_ckpt.integrations import ray_train as gray

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    progress = ray.get_actor(config["progress"], namespace=RAY_NAMESPACE)

    def emit(kind: str, **fields) -> None:
        progress.emit.remote({"kind": kind, "rank": rank, "unix": time.time(), **fields})

    emit("start", pid=os.getpid(), world=world)
    mesh = init_device_mesh("cpu", (world,))
    t = build_training(seed=0, total_steps=config["steps"], dataset_size=512, mesh=mesh)
    # The state a large model would have: ``mb`` MB per rank of sharded (frozen) weights at HOSTS
    # ranks (more per rank at fewer: an elastic run resized), saved with it; like every parameter,
    # only an optimizer step may change them. (Built shard by shard: a full tensor on every rank
    # would be world x mb MB each, at once.)
    total = HOSTS * config["mb"] * 2**18
    chunk = -(-total // world)
    local = torch.ones(max(0, min(chunk, total - rank * chunk)))
    t.model.register_parameter(
        "ballast",
        torch.nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([total]), stride=(1,)),
            requires_grad=False,
        ),
    )
    mode = config["mode"]
    batches = t.batches()
    start, restored = 0, None
    ckpt = None
    if mode in ("gemini", "inplace"):
        ckpt = gray.checkpointer(
            TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler), config["ckpt"]
        )
        t0 = time.time()
        result = ckpt.restore()
        if result is not None:
            start = result.step + 1
            restored = {
                "step": result.step,
                "world": world,
                "path": result.path,
                "seconds": time.time() - t0,
                "source": result.source,
                "bytes": result.bytes_read,
                "timeline": [list(m) for m in result.timeline],
                "recovery": [dict(r) for r in result.recovery],
            }
    elif mode == "durable":
        register_throttled(config["rate"])
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        root = config["root"]
        done = (
            sorted(
                int(d) for d in os.listdir(root) if d.isdigit() and os.path.exists(os.path.join(root, d, ".metadata"))
            )
            if os.path.isdir(root)
            else []
        )
        if done:
            t0 = time.time()
            msd, osd = get_state_dict(t.model, t.optimizer)
            sd = {"model": msd, "optim": osd, "sched": t.scheduler.state_dict()}
            dcp.load(sd, storage_reader=FsspecReader(f"throttled://{root}/{done[-1]}"))
            set_state_dict(t.model, t.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = done[-1] + 1
            restored = {"step": done[-1], "world": world, "seconds": time.time() - t0, "source": "durable"}
    if restored is not None:
        emit("restore", **restored)
    for _ in range(start):  # the data the restored steps consumed (the loader is not saved here)
        next(batches)
    t_loop = time.time()
    for step in range(start, config["steps"]):
        t_step = time.time()
        stalled = ckpt.stats.total_stall_s if ckpt is not None else 0.0
        loss = lm_loss(t.model, next(batches))
        loss.backward()
        t_compute = time.time()
        time.sleep(max(0.0, config["step_s"] - (time.time() - t_step)))  # the rest of forward/backward: GPU compute
        t.optimizer.step()  # with staging="overlap", waits for the previous version's copy
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        stall, phases = 0.0, ()
        if mode in ("gemini", "inplace"):
            ckpt.save(step)
            phases = ckpt.stats.last_phases
            stall = ckpt.stats.total_stall_s - stalled  # save() and any wait of the optimizer step for its copy
        elif mode == "durable" and (step + 1) % config["interval"] == 0:
            t0 = time.perf_counter()
            msd, osd = get_state_dict(t.model, t.optimizer)
            dcp.save(
                {"model": msd, "optim": osd, "sched": t.scheduler.state_dict()},
                storage_writer=FsspecWriter(f"throttled://{config['root']}/{step}"),
            )
            stall = time.perf_counter() - t0
        if step == start:  # where an attempt's first step goes, on every rank (the slowest holds the rest back)
            emit(
                "first",
                step=step,
                loop_unix=t_loop,
                compute_s=t_compute - t_step,
                save_s=time.time() - t_step - config["step_s"] if mode != "none" else 0.0,
                step_end_unix=time.time(),
                save_phases={n: round(t, 3) for n, t in phases},
            )
        if rank == 0:
            emit("step", step=step, stall_s=stall, world=world)
    if ckpt is not None:
        ckpt.close()
    emit("done")
    return {"rank": rank}


class Progress:
    """Events of one run, in arrival order (an actor on the head node)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def since(self, index: int) -> list[dict]:
        return self.events[index:]


# --- one run ------------------------------------------------------------------------------------
def run(
    cluster,
    mode: str,
    *,
    steps: int,
    kill_at: int,
    mb: int,
    step_s: float,
    interval: int,
    rate: float,
    workdir: str,
    persist_every: int,
    timeout: float,
    staging: str = "overlap",
    fault: str = "host",
) -> dict:
    """One job with one failure after step ``kill_at`` (``fault``: host ``KILL_HOST`` lost, or
    its training worker SIGKILLed); its events, the failure time."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from gemini_ckpt import CheckpointConfig
    from gemini_ckpt.integrations.ray_train import (
        detection_env,
        host_stores,
        ranks_on_hosts,
        recoverable,
        torch_config,
        warm_runtime_env,
    )

    name = f"recovery-{mode}-{os.getpid()}-{int(time.time())}"
    progress = (
        ray.remote(Progress)
        .options(name=name, namespace=RAY_NAMESPACE, num_cpus=0, resources={"node:__internal_head__": 0.001})
        .remote()
    )
    # Four simulated hosts share this machine's memory: each store gets an explicit budget (the
    # default, a fraction of the machine's RAM per store, would let four of them take it all).
    ckpt = CheckpointConfig(
        replicas=2,
        keep_in_memory=2,
        persist_every=persist_every,
        timeout_s=120.0,
        durable_uri=os.path.join(workdir, name, "gemini"),
        staging=staging,
        host_memory_budget_bytes=max(1 << 30, 12 * mb << 20),
    )
    config = {
        "mode": mode,
        "steps": steps,
        "mb": mb,
        "step_s": step_s,
        "interval": interval,
        "rate": rate,
        "root": os.path.join(workdir, name, "dcp"),
        "ckpt": ckpt,
        "progress": name,
    }
    # every Train worker process imports torch, Ray Train and what train_loop imports as it starts (all
    # modes alike): the in-place mode's warm spares are ready when a worker is replaced; a full restart
    # starts new processes
    run_config = RunConfig(
        name=name,
        storage_path=workdir,
        failure_config=FailureConfig(max_failures=1),
        worker_runtime_env=warm_runtime_env(
            "torch.distributed.device_mesh",
            "torch.distributed.tensor",
            "torchdata.stateful_dataloader",
            "gemini_ckpt.toy",
        ),
    )
    # rank r on host r after the restart too (every mode): the replacement's rank reads its own host's memory;
    # with no replacement, an elastic run (one rank per host, on any host, at least half of them)
    scaling = (
        ScalingConfig(
            num_workers=(HOSTS // 2, HOSTS), placement_strategy="STRICT_SPREAD", elastic_resize_monitor_interval_s=60
        )
        if fault == "host-alone"
        else ScalingConfig(num_workers=HOSTS, label_selector=ranks_on_hosts(HOSTS))
    )
    # in place: Ray Train replaces only the failed worker (polled every 0.25 s); the others recover in
    # their own processes. Every other mode: Ray Train's full restart (its default 2 s poll).
    for key, value in detection_env(poll_s=0.25).items():
        if mode == "inplace":
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    trainer = TorchTrainer(
        recoverable(train_loop) if mode == "inplace" else train_loop,
        train_loop_config=config,
        torch_config=torch_config() if mode == "inplace" else None,
        scaling_config=scaling,
        run_config=run_config,
    )
    box: dict = {}

    def fit() -> None:
        try:
            with host_stores(ckpt, run_config=run_config):
                box["result"] = trainer.fit()
                box["stores"] = _store_memory(name) if mode in ("gemini", "inplace") else None
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    events: list[dict] = []
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: the run did not finish within {timeout:.0f}s")
            events += ray.get(progress.since.remote(len(events)), timeout=60)
            if failure is None and any(e["kind"] == "step" and e["step"] >= kill_at for e in events):
                if fault in ("host", "host-alone"):
                    failure = time.time()
                    cluster.remove_hosts((KILL_HOST,), wait=False)
                    if fault == "host":
                        cluster.add_host(KILL_HOST)
                else:  # the simulated hosts are processes of this machine (rank r on host r)
                    pid = [e["pid"] for e in events if e["kind"] == "start" and e["rank"] == KILL_HOST][-1]
                    failure = time.time()
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        thread.join()
        events += ray.get(progress.since.remote(len(events)), timeout=60)
    finally:
        ray.kill(progress)
    if "error" in box:
        raise box["error"]
    return {"events": events, "failure_unix": failure, "stores": box.get("stores")}


def _store_memory(namespace: str) -> dict:
    """What each host store holds at the end of the run (after the failure and the restart)."""
    from gemini_ckpt.cli.status import cluster_status

    ns = cluster_status(namespace)[namespace]
    return {
        "held_bytes": {h.slot: h.held_bytes for h in ns.hosts},
        "reserved_bytes": {h.slot: h.reserved_bytes for h in ns.hosts},
        "memory": {h.slot: h.memory for h in ns.hosts},
        "versions": sorted({v.step for v in ns.versions}),
    }


def measure(mode: str, out: dict, step_s: float) -> dict:
    """The components of one run's failure (see the module docstring)."""
    events, failure = out["events"], out["failure_unix"]
    steps = [e for e in events if e["kind"] == "step"]
    before = [e for e in steps if e["unix"] <= failure]
    starts = [e["unix"] for e in events if e["kind"] == "start" and e["unix"] > failure]
    restores = [e for e in events if e["kind"] == "restore" and e["unix"] > failure]
    restart_s = max(starts) - failure if starts else None
    restored_step = restores[0]["step"] if restores else -1
    failed_at = max(e["step"] for e in before)
    back = max(starts) if starts else failure  # the new attempt's steps come after its workers started
    after = [e["unix"] for e in steps if e["unix"] > back]
    stalls = [e["stall_s"] for e in sorted(before, key=lambda e: e["step"]) if e["stall_s"] > 0]
    # the attempt after the failure: its first saves are the warm-up this failure cost
    stalls_after = [
        e["stall_s"]
        for e in sorted((e for e in steps if e["unix"] > back), key=lambda e: e["step"])
        if e["stall_s"] > 0
    ]
    pids_before = {e["rank"]: e.get("pid") for e in events if e["kind"] == "start" and e["unix"] <= failure}
    pids_after = {e["rank"]: e.get("pid") for e in events if e["kind"] == "start" and e["unix"] > failure}
    durable_read = sum((e.get("bytes") or {}).get("durable", 0) for e in restores if e.get("source") == "memory")
    return {
        "kept_processes": sorted(r for r, pid in pids_after.items() if pids_before.get(r) == pid),
        # processes, not ranks: an elastic shrink renumbers the survivors
        "kept_pids": len(set(pids_after.values()) & set(pids_before.values())),
        "world_after": restores[0].get("world") if restores else None,
        "restore_path": restores[0].get("path") if restores else None,
        "durable_bytes_read_from_memory_restore": durable_read,
        "mode": mode,
        "failed_after_step": failed_at,
        "restored_step": restored_step,
        "lost_steps": failed_at - restored_step,
        "lost_s": (failed_at - restored_step) * step_s,
        "retrieval_s": max((e["seconds"] for e in restores), default=0.0),
        "restart_s": restart_s,
        "first_step_after_s": (min(after) - failure) if after else None,
        "stall_median_s": statistics.median(stalls) if stalls else 0.0,
        # gemini_ckpt's first WARM_UP saves of an attempt plan and make the segments it reuses: the
        # run's first attempt's, and (charged per failure) those of the attempt after the failure;
        # the mean of the others is the steady cost of a save
        "stall_warm_up_first_s": sum(stalls[:WARM_UP]) if mode in ("gemini", "inplace") else 0.0,
        "stall_warm_up_s": (sum(stalls_after[:WARM_UP]) if len(stalls_after) >= WARM_UP else sum(stalls[:WARM_UP]))
        if mode in ("gemini", "inplace")
        else 0.0,
        "stall_mean_s": statistics.fmean(
            stalls[WARM_UP:] if mode in ("gemini", "inplace") and len(stalls) > WARM_UP else stalls
        )
        if stalls
        else 0.0,
        "stall_top": sorted(((round(e["stall_s"], 4), e["step"]) for e in before if e["stall_s"] > 0), reverse=True)[
            :8
        ],
        "saves": len(stalls),
        "restore_timeline": restores[0].get("timeline") if restores else None,
        # every rank's restore stages, in seconds after the failure (the slowest holds the rest back)
        "restore_stages": {
            str(e["rank"]): [(n, round(t - failure, 3)) for n, t in e["timeline"]]
            for e in restores
            if e.get("timeline")
        },
        "restore_bytes": {str(e["rank"]): e.get("bytes") for e in restores},
        # what the host stores did meanwhile (seconds after the failure): noticed, node dead,
        # copies made again, replacement joined and seeded
        "recovery_stages": {
            k: round(v - failure, 3)
            for e in restores[:1]
            for r in e.get("recovery", [])[-1:]
            for k, v in r.items()
            if isinstance(v, float) and v > failure
        },
        "first_step_parts": _first_step_parts(events, failure),
    }


def _first_step_parts(events: list[dict], failure: float) -> Optional[dict]:
    """The new attempt's way to its first step, per rank, in seconds after the failure: workers
    in the training function, restore done, loop entered, first step's compute and save done."""
    parts: dict = {}
    for e in events:
        if e["unix"] <= failure:
            continue
        row = parts.setdefault(e["rank"], {})
        if e["kind"] == "start":
            row["start"] = round(e["unix"] - failure, 2)
        elif e["kind"] == "restore":
            row["restored"] = round(e["unix"] - failure, 2)
        elif e["kind"] == "first":
            row.update(
                loop=round(e["loop_unix"] - failure, 2),
                compute_s=round(e["compute_s"], 3),
                save_s=round(e["save_s"], 3),
                step_done=round(e["step_end_unix"] - failure, 2),
            )
            if e.get("save_phases"):
                row["save_phases"] = e["save_phases"]
    return {str(r): parts[r] for r in sorted(parts)} or None


def wasted(row: dict, *, mtbf_s: float, step_s: float, interval: int) -> dict:
    """Per failure, over one MTBF (see the module docstring)."""
    # over one MTBF: the run's first save (it plans), then the mean of the others
    if row["mode"] in ("gemini", "inplace"):
        saves = mtbf_s / step_s
    elif row["mode"] == "durable":
        saves = mtbf_s / (interval * step_s)
    else:
        saves = 0
    if row["mode"] in ("gemini", "inplace") and saves:
        overhead = row["stall_warm_up_s"] + (saves - WARM_UP) * row["stall_mean_s"]
    else:  # durable: every save does the same work
        overhead = saves * row["stall_mean_s"]
    without = overhead + row["lost_s"] + row["retrieval_s"]
    return {**row, "overhead_s": overhead, "wasted_s": without, "wasted_with_restart_s": without + row["restart_s"]}


def restart_comparison(runs: list[dict]) -> dict:
    """Per mode, over every run (``--repeat``): failure -> next step and failure -> workers back in
    the training function, each run's and the median; and what gemini_ckpt adds to the median
    failure -> next step of the job without checkpointing."""
    out: dict = {}
    for mode in sorted({r["mode"] for r in runs}):
        first = [r["first_step_after_s"] for r in runs if r["mode"] == mode and r["first_step_after_s"] is not None]
        back = [r["restart_s"] for r in runs if r["mode"] == mode and r["restart_s"] is not None]
        # a host fault: the next step after Ray declared the lost node dead (issue target: <= 6 s)
        dead = [
            round(r["first_step_after_s"] - r["recovery_stages"]["node_dead"], 3)
            for r in runs
            if r["mode"] == mode and r["first_step_after_s"] is not None and "node_dead" in r.get("recovery_stages", {})
        ]
        out[mode] = {
            "first_step_after_s": first,
            "restart_s": back,
            "median_first_step_after_s": statistics.median(first) if first else None,
            "median_restart_s": statistics.median(back) if back else None,
        }
        if dead:
            out[mode]["after_node_dead_s"] = dead
            out[mode]["median_after_node_dead_s"] = statistics.median(dead)
    g, n = out.get("gemini", {}), out.get("none", {})
    if g.get("median_first_step_after_s") is not None and n.get("median_first_step_after_s") is not None:
        out["library_adds_median_s"] = g["median_first_step_after_s"] - n["median_first_step_after_s"]
        out["library_adds_to_workers_back_median_s"] = g["median_restart_s"] - n["median_restart_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="state per rank in MB (ballast included)")
    ap.add_argument("--step-s", type=float, default=2.0, help="seconds per training step")
    ap.add_argument("--mtbf-s", type=float, default=3600.0, help="the job's mean time between failures")
    ap.add_argument("--storage-mbps", type=float, default=100.0, help="remote storage bandwidth per host, MB/s")
    ap.add_argument("--persist-every", type=int, default=50, help="gemini_ckpt: a durable version every N steps")
    ap.add_argument("--quick", action="store_true", help="16 MB per rank, 0.3 s steps, MTBF 2 min")
    ap.add_argument(
        "--modes",
        default="none,gemini,inplace,durable",
        help="which runs (comma-separated): none (no checkpointing), gemini (full restart), inplace "
        "(gemini_ckpt with in-place recovery), durable (stock DCP, Young/Daly)",
    )
    ap.add_argument(
        "--fault",
        choices=("host", "host-alone", "process"),
        default="host",
        help="host: host 1 is lost (raylet and every process) and a replacement joins; host-alone: host 1 is "
        "lost and no host takes its place (an elastic run, 2 to 4 workers: it goes on with 3); process: its "
        "training worker is SIGKILLed",
    )
    ap.add_argument(
        "--staging",
        default="overlap",
        choices=("overlap", "copy"),
        help="gemini_ckpt's CheckpointConfig.staging (overlap: the copy runs beside the next step)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the modes this many times, alternating (the restart comparison takes medians: "
        "Ray Train's own restart varies by seconds from one failure to the next)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
            "recovery.json",
        ),
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.step_s, args.mtbf_s, args.persist_every = 16, 0.3, 120.0, 20
    rate = args.storage_mbps * 1e6
    # C, the durable save's stall: the state at the storage's rate, plus its setup; estimated
    # first from the bytes, then replaced by the measured median (the interval stays as run).
    estimate_c = args.mb * 1e6 / rate + 0.5
    interval = max(4, round(math.sqrt(2 * estimate_c * args.mtbf_s) / args.step_s))
    kill_at = interval + interval // 2  # the midpoint of the second durable interval
    steps = kill_at + max(6, interval // 2)

    from gemini_ckpt.testing.cluster import LocalCluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    workdir = tempfile.mkdtemp(prefix="gemini_bench_recovery_", dir=os.environ.get("BENCH_DISK_DIR"))
    cluster = LocalCluster(HOSTS, head_cpus=0, object_store_bytes=128 << 20).start()
    rows, repeats, failed = [], [], []
    try:
        for mode in [m for _ in range(max(1, args.repeat)) for m in args.modes.split(",")]:
            what = {
                "host": f"host {KILL_HOST} lost",
                "host-alone": f"host {KILL_HOST} lost, no replacement",
                "process": f"the worker of host {KILL_HOST} SIGKILLed",
            }[args.fault]
            print(f"== {mode}: {steps} steps of {args.step_s}s, {what} after step {kill_at}", flush=True)
            try:
                out = run(
                    cluster,
                    mode,
                    steps=steps,
                    kill_at=kill_at,
                    mb=args.mb,
                    step_s=args.step_s,
                    interval=interval,
                    rate=rate,
                    workdir=workdir,
                    persist_every=args.persist_every,
                    timeout=600 + 3 * steps * args.step_s,
                    staging=args.staging,
                    fault=args.fault,
                )
            except Exception as exc:  # noqa: BLE001 - one run failed (say, the 4 hosts' memory): keep the others
                print(f"   {mode}: the run failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                failed.append({"mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
                cluster.ensure_hosts()
                continue
            row = wasted(measure(mode, out, args.step_s), mtbf_s=args.mtbf_s, step_s=args.step_s, interval=interval)
            repeats.append(row)
            if any(r["mode"] == mode for r in rows):  # a repeat: only the restart comparison takes it
                dead = row.get("recovery_stages", {}).get("node_dead")
                print(
                    f"   failure -> next step {row['first_step_after_s']:.1f}s, workers back {row['restart_s']:.1f}s"
                    + (f", node dead at {dead:.1f}s" if dead is not None else ""),
                    flush=True,
                )
                cluster.ensure_hosts()
                continue
            rows.append(row)
            print(f"   after the failure, per rank (s): {rows[-1]['first_step_parts']}", flush=True)
            if out.get("stores"):
                rows[-1]["stores_at_end"] = out["stores"]
                print(f"   host stores at the end: {out['stores']}", flush=True)
            cluster.ensure_hosts()
    finally:
        cluster.shutdown()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    by = {r["mode"]: r for r in rows}
    restarts = restart_comparison(repeats)
    if not {"none", "gemini", "durable"} <= set(by):  # --modes: a partial run has no ratios
        partial = {"fault": args.fault, "state_mb_per_rank": args.mb, "step_s": args.step_s, "rows": rows}
        partial["restarts"], partial["failed_runs"] = restarts, failed
        partial["repeats"] = repeats
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(partial, f, indent=2, default=str)
        print(json.dumps(rows, indent=2, default=str))
        print(json.dumps(restarts, indent=2))
        print(f"wrote {args.out}")
        return 0
    g, d, n = by["gemini"], by["durable"], by["none"]
    result = {
        "question": "time wasted per failure: gemini_ckpt (every step in memory) vs durable-only at Young/Daly",
        "hosts": HOSTS,
        "state_mb_per_rank": args.mb,
        "gemini_staging": args.staging,
        "step_s": args.step_s,
        "mtbf_s": args.mtbf_s,
        "storage_mb_per_s_per_host": args.storage_mbps,
        "durable_interval_steps": interval,
        "young_daly_interval_s": interval * args.step_s,
        "kill_after_step": kill_at,
        "steps": steps,
        "ratio_without_restart": d["wasted_s"] / g["wasted_s"] if g["wasted_s"] else None,
        "ratio_with_restart": d["wasted_with_restart_s"] / g["wasted_with_restart_s"],
        "target_ratio": TARGET,
        "restart_to_first_step_with_library_s": g["first_step_after_s"],
        "restart_to_first_step_without_checkpointing_s": n["first_step_after_s"],
        "library_adds_to_the_restart_s": (g["first_step_after_s"] - n["first_step_after_s"])
        if g["first_step_after_s"] is not None and n["first_step_after_s"] is not None
        else None,
        "rows": rows,
        "restarts": restarts,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
    }
    result["target_met"] = (result["ratio_without_restart"] or 0) >= TARGET
    result["fault"] = args.fault
    if "inplace" in by:
        i = by["inplace"]
        result["ratio_with_restart_inplace"] = d["wasted_with_restart_s"] / i["wasted_with_restart_s"]
        full = restarts.get("gemini", {}).get("median_first_step_after_s")
        inplace = restarts.get("inplace", {}).get("median_first_step_after_s")
        if full and inplace:
            result["inplace_vs_full_restart"] = {
                "median_first_step_after_full_s": full,
                "median_first_step_after_inplace_s": inplace,
                "sooner": full / inplace,
            }
    # For ``placement advise --from-bench``: what a restart and a restore cost here.
    result["costs"] = {
        "restart_host_s": g["restart_s"],
        "restore_peer_s": g["retrieval_s"],
        "durable_save_s": d["stall_median_s"],
        "restore_durable_s": d["retrieval_s"],
    }
    return write_report(args.out, result, _markdown(result))


def _markdown(r: dict) -> str:
    lines = [
        f"{r['hosts']} simulated hosts, {r['state_mb_per_rank']} MB per rank, {r['step_s']}s steps, MTBF "
        f"{r['mtbf_s']:.0f}s, remote storage {r['storage_mb_per_s_per_host']:.0f} MB/s per host; durable-only "
        f"every {r['durable_interval_steps']} steps (Young/Daly); host lost after step {r['kill_after_step']}",
        "",
        "| per failure | overhead (s) | work lost (s) | retrieval (s) | wasted (s) | Ray Train restart (s) "
        "| wasted incl. restart (s) | failure -> next step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    staging = r.get("gemini_staging", "copy")
    names = {
        "gemini": f"gemini_ckpt, every step, replicas=2, staging={staging}, full restart",
        "inplace": f"gemini_ckpt, every step, replicas=2, staging={staging}, in place",
        "durable": "durable only (stock DCP, Young/Daly)",
        "none": "no checkpointing (restart only)",
    }
    for row in r["rows"]:
        first = row["first_step_after_s"]
        lines.append(
            f"| {names[row['mode']]} | {row['overhead_s']:.2f} | {row['lost_s']:.2f} "
            f"({row['lost_steps']} steps) | {row['retrieval_s']:.2f} | {row['wasted_s']:.2f} "
            f"| {row['restart_s']:.1f} | {row['wasted_with_restart_s']:.1f} "
            f"| {first:.1f} |"
            if first is not None
            else "| - |"
        )
    lines.append("")
    ratio = r["ratio_without_restart"]
    lines.append(
        f"wasted per failure, durable-only / gemini_ckpt: {ratio:.1f}x without the restart "
        f"(target >= {r['target_ratio']:.0f}x: {'met' if r['target_met'] else 'NOT met'}), "
        f"{r['ratio_with_restart']:.2f}x with it"
    )
    if "ratio_with_restart_inplace" in r:
        lines.append(
            f"with in-place recovery: {r['ratio_with_restart_inplace']:.1f}x with the restart "
            f"(the survivors' processes kept: ranks {r['rows'][[x['mode'] for x in r['rows']].index('inplace')]['kept_processes']})"
        )
    if "inplace_vs_full_restart" in r:
        c = r["inplace_vs_full_restart"]
        lines.append(
            f"failure -> next step, medians: in place {c['median_first_step_after_inplace_s']:.1f}s, full "
            f"restart {c['median_first_step_after_full_s']:.1f}s: {c['sooner']:.1f}x sooner"
        )
    rs = r.get("restarts", {})
    if "library_adds_median_s" in rs:
        g, n = rs["gemini"], rs["none"]
        lines.append(
            f"failure -> next step, median of {len(g['first_step_after_s'])} failures each: "
            f"{g['median_first_step_after_s']:.1f}s with gemini_ckpt, {n['median_first_step_after_s']:.1f}s "
            f"without checkpointing: the library adds {rs['library_adds_median_s']:+.1f}s "
            f"({rs['library_adds_to_workers_back_median_s']:+.1f}s of it before the workers are back)"
        )
    if r["library_adds_to_the_restart_s"] is not None:
        lines.append(
            f"failure -> next step: {r['restart_to_first_step_with_library_s']:.1f}s with gemini_ckpt, "
            f"{r['restart_to_first_step_without_checkpointing_s']:.1f}s without checkpointing: the library "
            f"adds {r['library_adds_to_the_restart_s']:+.1f}s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
