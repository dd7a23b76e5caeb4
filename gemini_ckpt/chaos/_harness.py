"""The :class:`Harness`: a local cluster of simulated hosts, one rank actor per host, and the
reference runs every scenario is compared with (one job on it: :mod:`._jobrun`)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from ._results import HarnessError, Reference, Trace, infrastructure
from ._spec import ChaosConfig
from ._jobrun import JobRun


# --- the harness ---------------------------------------------------------------------------------------
def as_job(job: Any) -> Any:
    """A :class:`~gemini_ckpt.chaos.TrainJob` instance from a job, a job class, or None (TinyJob)."""
    from ._job import TinyJob

    if job is None:
        return TinyJob()
    if isinstance(job, type):
        job = job()
    if not (callable(getattr(job, "build", None)) and callable(getattr(job, "step", None))):
        raise TypeError(
            f"a chaos job needs build(rank, world_size, seed) -> TrainState and step(step) -> loss; "
            f"got {type(job).__name__}"
        )
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
    harness starts its own Ray cluster (this process must not be connected to Ray yet), or uses
    ``cluster`` (a running :class:`~gemini_ckpt.testing.cluster.LocalCluster` of ``config.hosts``
    hosts, left running by ``close``), and adds and removes hosts from the thread that called
    ``start``; ``close`` stops what it started.
    """

    def __init__(
        self,
        config: Optional[ChaosConfig] = None,
        *,
        job: Any = None,
        log: Optional[Callable[[str], None]] = None,
        cluster: Any = None,
    ) -> None:
        self.config = config or ChaosConfig()
        if not isinstance(self.config, ChaosConfig):
            raise TypeError("Harness(config=...) must be a ChaosConfig")
        self.job = as_job(job)
        self.log = log or _stderr
        self._cluster = cluster  # a running LocalCluster to use instead of starting one
        self.sim = None
        self.pool = None
        self.workdir: Optional[str] = None
        self._own_workdir = False
        self._references: dict[int, tuple[Any, Reference]] = {}  # id(job) -> (job, reference)
        self._resized: dict[tuple[int, int, int], dict] = {}

    def start(self) -> "Harness":
        if self.sim is not None:
            return self
        from ..testing.cluster import LocalCluster
        from ._sim import RAY_NAMESPACE, RankPool

        t0 = time.perf_counter()
        if self.config.workdir:
            os.makedirs(self.config.workdir, exist_ok=True)
            self.workdir = self.config.workdir
        else:
            self.workdir, self._own_workdir = tempfile.mkdtemp(prefix="gemini-chaos-"), True
        if self._cluster is not None:
            if self._cluster.hosts != self.config.hosts:
                raise ValueError(
                    f"Harness(cluster=...) has {self._cluster.hosts} hosts but ChaosConfig.hosts is "
                    f"{self.config.hosts}; pass a cluster of that size or no cluster"
                )
            if self._cluster.network != self.config.network:
                raise ValueError(
                    f"Harness(cluster=...) runs network={self._cluster.network!r} but ChaosConfig.network "
                    f"is {self.config.network!r}; pass a matching cluster or no cluster"
                )
            self.sim = self._cluster
            self.sim.ensure_hosts()
        else:
            self.sim = LocalCluster(
                self.config.hosts,
                head_cpus=1,
                object_store_bytes=self.config.object_store_bytes,
                namespace=RAY_NAMESPACE,
                labels=self.config.host_labels,
                network=self.config.network,
                link=self.config.link,
            ).start()
        self.pool = RankPool(self.sim)
        self.pool.ensure(tuple(range(self.config.hosts)))
        where = (
            ""
            if self.sim.net is None
            else f", each in its own network namespace{f' ({self.config.link} links)' if self.config.link else ''}"
        )
        self.log(
            f"cluster up: head + {self.config.hosts} hosts{where}, {self.config.hosts} ranks "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        return self

    def close(self) -> None:
        try:
            if self.pool is not None:
                self.pool.kill_all()
            if self.sim is not None:
                if self.sim is self._cluster:
                    self.sim.sweep()  # someone else's cluster: leave it running, without our actors
                else:
                    self.sim.shutdown()
        finally:
            self.sim = self.pool = None
            if self._own_workdir and self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def rendezvous_host(self) -> str:
        """The address ranks reach the driver at: the head's bridge address when every host has
        its own network namespace, loopback otherwise."""
        net = self.sim.net if self.sim is not None else None
        return net.head_address if net is not None else "127.0.0.1"

    def __enter__(self) -> "Harness":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def ensure(self, hosts: tuple[int, ...]) -> None:
        """Every simulated host back, and a live rank process on each of ``hosts``."""
        with infrastructure(f"bringing up hosts and rank processes {list(hosts)}"):
            self.sim.ensure_hosts()
            self.pool.ensure(hosts)

    def sweep(self) -> list[str]:
        """Kill every gemini_ckpt actor (host stores, registries) left in the cluster; between
        scenarios there should be none. Returns the namespaces that had some."""
        with infrastructure("removing leftover host stores"):
            return self.sim.sweep()

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
            ok = False
            try:
                self.ensure(hosts)
                run.setup(hosts)
                restored = run.expect_all(run.call(hosts, "restore", timeout=cfg.timeout_s + 60), "restore")
                records = run.expect_all(run.run(hosts, list(range(cfg.steps)), capture=True), "run")
                for rank, recs in records.items():
                    for rec in recs:
                        if rec.get("error") or not rec.get("committed"):
                            raise HarnessError(
                                f"the reference run failed at step {rec['step']} on rank {rank}: {rec.get('error')}"
                            )
                trace = Trace()
                trace.add(records)
                ref = Reference(
                    world_size=cfg.hosts,
                    initial_digest=restored[0]["digest"],
                    initial_extras={r: v["extra"] for r, v in restored.items()},
                    trace=trace,
                )
                for rank, recs in records.items():
                    for rec in recs:
                        ref.opaque.setdefault(rec["step"], {})[rank] = rec["opaque"]
                        if rank == 0:
                            ref.full[rec["step"]] = rec["full"]
                run.expect_all(run.call(hosts, "close", timeout=cfg.timeout_s + 30), "close")
                ok = True
            finally:
                run.cleanup(hosts, kill=not ok)
            ref.seconds = time.perf_counter() - t0
            self._references[id(job)] = (job, ref)
            self.log(
                f"reference run of {type(job).__name__}: {cfg.steps} steps at world size {cfg.hosts} "
                f"({ref.seconds:.1f}s)"
            )
        return self._references[id(job)][1]

    def resized_reference(
        self, world_size: int, from_step: Optional[int], job: Any = None, hosts: Optional[tuple[int, ...]] = None
    ) -> dict:
        """The reference continuation at another world size: a job of ``world_size`` ranks loads
        the reference's state of ``from_step`` directly (not through gemini_ckpt) and trains on.
        ``hosts``: where it runs (default ``0..world_size-1``; a scenario passes the hosts its job
        restarted on, so a host it left out, e.g. one partitioned, is not brought back for it)."""
        job = self.job if job is None else job
        key = (id(job), world_size, -1 if from_step is None else from_step)
        if key not in self._resized:
            ref = self.reference(job)
            cfg = self.config
            hosts = tuple(range(world_size)) if hosts is None else tuple(hosts)
            if len(hosts) != world_size:
                raise ValueError(f"resized_reference: {len(hosts)} hosts {list(hosts)} for world size {world_size}")
            run = JobRun(self, f"reference-ws{world_size}-from{key[2]}", job=job, persist=False)
            ok = False
            try:
                self.ensure(hosts)
                run.setup(hosts)
                loaded: dict[int, Any] = {}
                if from_step is not None:
                    refs = {
                        r: self.pool.workers[h].load_reference.remote(
                            ref.full[from_step],
                            ref.opaque[from_step][r % ref.world_size],
                            r % ref.world_size,
                            from_step,
                        )
                        for r, h in enumerate(hosts)
                    }
                    loaded = run.expect_all(self.pool.collect(refs, timeout=cfg.timeout_s + 30), "load")
                    if any(v["digest"] != ref.trace.digests[from_step] for v in loaded.values()):
                        raise HarnessError(
                            f"loading the reference state of step {from_step} at world size "
                            f"{world_size} did not reproduce it"
                        )
                start = -1 if from_step is None else from_step
                records = run.expect_all(run.run(hosts, list(range(start + 1, cfg.steps))), "run")
                trace = Trace()
                trace.add(records)
                run.expect_all(run.call(hosts, "close", timeout=cfg.timeout_s + 30), "close")
                ok = True
            finally:
                run.cleanup(hosts, kill=not ok)
            self._resized[key] = {"trace": trace, "loaded": loaded}
        return self._resized[key]


def _stderr(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
