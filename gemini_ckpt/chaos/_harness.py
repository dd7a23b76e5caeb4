"""The :class:`Harness`: a local cluster of simulated hosts, one rank actor per host, and the
reference runs every scenario is compared with; and :class:`JobRun`, one training job on it."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

from ._results import HarnessError, Reference, Trace, err
from ._spec import ChaosConfig, HookRule

StoreFactory = Callable[[Any, int, int], Any]
"""``store_factory(config, rank, world_size) -> Store``, called in each rank process; the store
is passed to ``Checkpointer(store=...)`` (e.g. a wrapper around ``connect_ray_store``)."""


# --- the harness ---------------------------------------------------------------------------------------
def as_job(job: Any) -> Any:
    """A :class:`~gemini_ckpt.chaos.TrainJob` instance from a job, a job class, or None (TinyJob)."""
    from ._job import TinyJob

    if job is None:
        return TinyJob()
    if isinstance(job, type):
        job = job()
    if not (callable(getattr(job, "build", None)) and callable(getattr(job, "step", None))):
        raise TypeError(f"a chaos job needs build(rank, world_size, seed) -> TrainState and step(step) -> loss; "
                        f"got {type(job).__name__}")
    return job


class Harness:
    """A local cluster of simulated hosts, one training rank per host, and the reference runs.

    Example::

        with Harness(ChaosConfig(hosts=4)) as harness:
            result = run_scenario(Scenario(name="kill-1", at=At(step=2), faults=(KillWorker((1,)),)),
                                  harness)
            print(result.verdict, result.prediction.label(), result.observed_label)

    ``job``: the default :class:`~gemini_ckpt.chaos.TrainJob` (an instance or a class; default
    :class:`~gemini_ckpt.chaos.TinyJob`); ``run_scenario(..., job=...)`` may use another. The
    harness starts its own Ray cluster (this process must not be connected to Ray yet) and
    adds and removes hosts from the thread that called ``start``; ``close`` stops everything.
    """

    def __init__(self, config: Optional[ChaosConfig] = None, *, job: Any = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.config = config or ChaosConfig()
        if not isinstance(self.config, ChaosConfig):
            raise TypeError("Harness(config=...) must be a ChaosConfig")
        self.job = as_job(job)
        self.log = log or _stderr
        self.sim = None
        self.pool = None
        self.workdir: Optional[str] = None
        self._own_workdir = False
        self._references: dict[int, tuple[Any, Reference]] = {}  # id(job) -> (job, reference)
        self._resized: dict[tuple[int, int, int], dict] = {}

    def start(self) -> "Harness":
        if self.sim is not None:
            return self
        from ._sim import RankPool, SimCluster

        t0 = time.perf_counter()
        if self.config.workdir:
            os.makedirs(self.config.workdir, exist_ok=True)
            self.workdir = self.config.workdir
        else:
            self.workdir, self._own_workdir = tempfile.mkdtemp(prefix="gemini-chaos-"), True
        self.sim = SimCluster(self.config.hosts, object_store_bytes=self.config.object_store_bytes).start()
        self.pool = RankPool(self.sim)
        self.pool.ensure(tuple(range(self.config.hosts)))
        self.log(f"cluster up: head + {self.config.hosts} hosts, {self.config.hosts} ranks "
                 f"({time.perf_counter() - t0:.1f}s)")
        return self

    def close(self) -> None:
        try:
            if self.pool is not None:
                self.pool.kill_all()
            if self.sim is not None:
                self.sim.shutdown()
        finally:
            self.sim = self.pool = None
            if self._own_workdir and self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Harness":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def reference_seconds(self) -> float:
        """Seconds spent in reference runs so far."""
        return sum(ref.seconds for _, ref in self._references.values())

    # --- references ------------------------------------------------------------------------------
    def reference(self, job: Any = None) -> Reference:
        """The uninterrupted run of ``job`` (default: the harness's) at full world size, once."""
        job = self.job if job is None else job
        if id(job) not in self._references:
            self.start()
            t0 = time.perf_counter()
            cfg = self.config
            hosts = tuple(range(cfg.hosts))
            run = JobRun(self, "reference", job=job, persist=False)
            try:
                self.sim.ensure_hosts()
                self.pool.ensure(hosts)
                run.setup(hosts)
                restored = run.expect_all(run.call(hosts, "restore", timeout=cfg.timeout_s + 60), "restore")
                records = run.expect_all(run.run(hosts, list(range(cfg.steps)), capture=True), "run")
                for rank, recs in records.items():
                    for rec in recs:
                        if rec.get("error") or not rec.get("committed"):
                            raise HarnessError(f"the reference run failed at step {rec['step']} on rank {rank}: "
                                               f"{rec.get('error')}")
                trace = Trace()
                trace.add(records)
                ref = Reference(world_size=cfg.hosts, initial_digest=restored[0]["digest"],
                                initial_extras={r: v["extra"] for r, v in restored.items()}, trace=trace)
                for rank, recs in records.items():
                    for rec in recs:
                        ref.opaque.setdefault(rec["step"], {})[rank] = rec["opaque"]
                        if rank == 0:
                            ref.full[rec["step"]] = rec["full"]
                run.expect_all(run.call(hosts, "close", timeout=cfg.timeout_s + 30), "close")
            finally:
                run.cleanup(hosts)
            ref.seconds = time.perf_counter() - t0
            self._references[id(job)] = (job, ref)
            self.log(f"reference run of {type(job).__name__}: {cfg.steps} steps at world size {cfg.hosts} "
                     f"({ref.seconds:.1f}s)")
        return self._references[id(job)][1]

    def resized_reference(self, world_size: int, from_step: Optional[int], job: Any = None) -> dict:
        """The reference continuation at another world size: a job of ``world_size`` ranks loads
        the reference's state of ``from_step`` directly (not through gemini_ckpt) and trains on."""
        job = self.job if job is None else job
        key = (id(job), world_size, -1 if from_step is None else from_step)
        if key not in self._resized:
            ref = self.reference(job)
            cfg = self.config
            hosts = tuple(range(world_size))
            run = JobRun(self, f"reference-ws{world_size}-from{key[2]}", job=job, persist=False)
            try:
                self.sim.ensure_hosts()
                self.pool.ensure(hosts)
                run.setup(hosts)
                loaded: dict[int, Any] = {}
                if from_step is not None:
                    refs = {r: self.pool.workers[h].load_reference.remote(
                        ref.full[from_step], ref.opaque[from_step][r % ref.world_size], r % ref.world_size, from_step)
                        for r, h in enumerate(hosts)}
                    loaded = run.expect_all(self.pool.collect(refs, timeout=cfg.timeout_s + 30), "load")
                    if any(v["digest"] != ref.trace.digests[from_step] for v in loaded.values()):
                        raise HarnessError(f"loading the reference state of step {from_step} at world size "
                                           f"{world_size} did not reproduce it")
                start = -1 if from_step is None else from_step
                records = run.expect_all(run.run(hosts, list(range(start + 1, cfg.steps))), "run")
                trace = Trace()
                trace.add(records)
                run.expect_all(run.call(hosts, "close", timeout=cfg.timeout_s + 30), "close")
            finally:
                run.cleanup(hosts)
            self._resized[key] = {"trace": trace, "loaded": loaded}
        return self._resized[key]


def _stderr(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- one job on the pool -------------------------------------------------------------------------------
class JobRun:
    """One training job (a namespace, a durable directory) on some hosts of the pool."""

    def __init__(self, harness: Harness, label: str, *, job: Any, placement: str = "group", persist: bool = True,
                 store_factory: Optional[StoreFactory] = None, chaos_fs: bool = False) -> None:
        self.h = harness
        self.job = job
        self.namespace = f"chaos-{label}-{uuid.uuid4().hex[:8]}"
        self.durable_root = os.path.join(harness.workdir, self.namespace)
        self.placement = placement
        self.persist = persist
        self.store_factory = store_factory
        self.chaos_fs = chaos_fs
        self.world_size = 0
        self.notes: list[str] = []

    def _config(self) -> dict:
        cfg = self.h.config
        out = {"store": "ray", "namespace": self.namespace, "replicas": cfg.replicas, "placement": self.placement,
               "keep_in_memory": cfg.keep_in_memory, "timeout_s": float(cfg.timeout_s),
               "host_memory_budget_bytes": cfg.host_memory_budget_bytes}
        if self.persist:
            out.update(persist_every=cfg.persist_every, keep_durable=cfg.keep_durable)
            if not self.chaos_fs:
                out["durable_uri"] = self.durable_root
        return out

    def setup(self, hosts: tuple[int, ...], *, rules: Optional[dict[int, list[HookRule]]] = None,
              storage_mode: str = "ok", strict: bool = True) -> dict[int, Any]:
        from ._sim import free_port

        cfg = self.h.config
        os.makedirs(self.durable_root, exist_ok=True)
        port = free_port()
        self.world_size = len(hosts)
        refs = {}
        for rank, host in enumerate(hosts):
            spec = {"rank": rank, "world_size": len(hosts), "port": port, "config": self._config(),
                    "job": self.job, "seed": cfg.seed, "timeout_s": float(cfg.timeout_s),
                    "durable_root": self.durable_root, "chaos_fs": self.chaos_fs and self.persist,
                    "storage_mode": storage_mode, "keep_durable": cfg.keep_durable,
                    "rules": (rules or {}).get(rank, []), "store_factory": self.store_factory}
            refs[rank] = self.h.pool.workers[host].setup.remote(spec)
        results = self.h.pool.collect(refs, timeout=cfg.timeout_s + 120)
        if strict:
            self.expect_all(results, "setup")
        return results

    def call(self, hosts: tuple[int, ...], method: str, *args, timeout: float) -> dict[int, Any]:
        """By rank."""
        refs = {rank: getattr(self.h.pool.workers[host], method).remote(*args) for rank, host in enumerate(hosts)}
        return self.h.pool.collect(refs, timeout=timeout)

    def run_async(self, hosts: tuple[int, ...], steps: list[int], **kwargs) -> dict[int, Any]:
        return {rank: self.h.pool.workers[host].run.remote(steps, **kwargs) for rank, host in enumerate(hosts)}

    def run(self, hosts: tuple[int, ...], steps: list[int], **kwargs) -> dict[int, Any]:
        refs = self.run_async(hosts, steps, **kwargs)
        return self.h.pool.collect(refs, timeout=self.run_timeout(len(steps)))

    def run_timeout(self, steps: int) -> float:
        return self.h.config.timeout_s + 30.0 * max(1, steps)

    @staticmethod
    def expect_all(results: dict[int, Any], what: str) -> dict[int, Any]:
        """``results`` unless a rank failed (an exception, an error record, or an error string
        from ``close``): then :class:`HarnessError`."""
        for rank, r in sorted(results.items()):
            problem = err(r) or (r if isinstance(r, str) else None)
            if problem:
                raise HarnessError(f"{what} failed on rank {rank}: {problem}")
        return results

    def cleanup(self, hosts: tuple[int, ...]) -> None:
        from .._cluster import shutdown_host_stores

        try:
            self.h.pool.teardown(tuple(h for h in hosts if h in self.h.pool.workers))
        finally:
            try:
                shutdown_host_stores(self.namespace)
            finally:
                shutil.rmtree(self.durable_root, ignore_errors=True)
