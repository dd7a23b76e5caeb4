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

from ._results import HarnessError, InfraError, Reference, Trace, err, infrastructure
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

    def ensure(self, hosts: tuple[int, ...]) -> None:
        """Every simulated host back, and a live rank process on each of ``hosts``."""
        with infrastructure(f"bringing up hosts and rank processes {list(hosts)}"):
            self.sim.ensure_hosts()
            self.pool.ensure(hosts)

    def sweep(self) -> list[str]:
        """Kill every gemini_ckpt actor (host stores, registries) left in the cluster; between
        scenarios there should be none. Returns the namespaces that had some."""
        from .._cluster import named_actors, shutdown_host_stores

        with infrastructure("removing leftover host stores"):
            left = sorted(named_actors())
            for namespace in left:
                shutdown_host_stores(namespace)
        return left

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
                ok = True
            finally:
                run.cleanup(hosts, kill=not ok)
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
            ok = False
            try:
                self.ensure(hosts)
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
                ok = True
            finally:
                run.cleanup(hosts, kill=not ok)
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
        self.rendezvous: Optional[Rendezvous] = None

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
        """Start the job on ``hosts`` (rank ``i`` on ``hosts[i]``) in a new process group.

        By rank: :meth:`RankWorker.setup`'s answer. A rank that failed in its rendezvous or its
        job's ``build``, died or did not answer is the harness's failure: every rank process of
        this start is killed (replaced at the next :meth:`Harness.ensure`) and
        :class:`InfraError` is raised. A rank whose ``Checkpointer`` could not be built is the
        library's: :class:`HarnessError` when ``strict``, else in the answer."""
        cfg = self.h.config
        os.makedirs(self.durable_root, exist_ok=True)
        self.close_rendezvous()
        with infrastructure("starting the rendezvous store"):
            self.rendezvous = Rendezvous(len(hosts), cfg.timeout_s)
        self.world_size = len(hosts)
        refs = {}
        with infrastructure("starting the job on the rank processes"):
            for rank, host in enumerate(hosts):
                spec = {"rank": rank, "world_size": len(hosts), "rendezvous": self.rendezvous.address,
                        "config": self._config(), "job": self.job, "seed": cfg.seed,
                        "timeout_s": float(cfg.timeout_s), "durable_root": self.durable_root,
                        "chaos_fs": self.chaos_fs and self.persist, "storage_mode": storage_mode,
                        "keep_durable": cfg.keep_durable, "rules": (rules or {}).get(rank, []),
                        "store_factory": self.store_factory}
                refs[rank] = self.h.pool.workers[host].setup.remote(spec)
        timeout = cfg.timeout_s + 120
        results = _collect_until_infra_failure(refs, timeout=timeout)
        stuck = [r for r, v in results.items() if isinstance(v, TimeoutError) and not isinstance(v, _Abandoned)]
        if stuck:
            stages = self.h.pool.collect({r: self.h.pool.workers[hosts[r]].setup_stage.remote() for r in stuck},
                                         timeout=10)
            for r, stage in stages.items():
                if stage == "checkpointer":  # the library under test hangs: an observation, not ours
                    results[r] = {"error": f"building the Checkpointer did not finish within {timeout:.0f}s",
                                  "stage": stage}
                    self.kill((hosts[r],))
        failed = {r: why for r, v in results.items() if (why := infra_problem(v))}
        if failed:
            self.kill(hosts)
            self.close_rendezvous()
            rank = min(failed, key=lambda r: (isinstance(results[r], TimeoutError), r))
            raise InfraError(f"{self.namespace}: the job could not start on {len(hosts)} ranks: rank {rank} "
                             f"(host {hosts[rank]}): {failed[rank]}; its rank processes are replaced")
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

    def kill(self, hosts: tuple[int, ...]) -> None:
        """Kill the rank processes of ``hosts`` (new ones start at the next :meth:`Harness.ensure`)."""
        for host in hosts:
            self.h.pool.forget(host)

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            rendezvous, self.rendezvous = self.rendezvous, None
            rendezvous.close()

    def cleanup(self, hosts: tuple[int, ...], *, kill: bool = False) -> None:
        """Stop the job whatever state it is in: its ranks leave the process group (or, with
        ``kill`` or when they cannot, their processes are killed), the rendezvous port is
        released, the namespace's host stores and the durable directory are removed."""
        from .._cluster import shutdown_host_stores

        try:
            present = tuple(h for h in hosts if h in self.h.pool.workers)
            if kill:
                self.kill(present)
            else:
                self.h.pool.teardown(present)
        finally:
            try:
                self.close_rendezvous()
                shutdown_host_stores(self.namespace)
            finally:
                shutil.rmtree(self.durable_root, ignore_errors=True)


class Rendezvous:
    """The rendezvous of one job start: a ``torch.distributed.TCPStore`` served by the driver,
    bound to port 0 so that the port it listens on is chosen by the kernel at ``bind`` and
    stays ours until :meth:`close`. Ranks connect to :attr:`address` as clients.

    (A port found free and released again before the process group binds it can be taken in
    between by any process on the machine: EADDRINUSE. Nothing here picks a port in advance.)
    """

    HOST = "127.0.0.1"

    def __init__(self, world_size: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(self.HOST, 0, world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.port: int = self._store.port

    @property
    def address(self) -> tuple[str, int]:
        return (self.HOST, self.port)

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Stop serving and release the port (the store's last reference is dropped)."""
        self._store = None


def infra_problem(answer: Any) -> Optional[str]:
    """Why a rank's answer to ``setup`` is the harness's failure rather than the library's
    (None when it is not): the rank died or did not answer, or failed in its rendezvous or
    in the job's ``build``."""
    if isinstance(answer, BaseException):
        return err(answer)
    if isinstance(answer, dict) and answer.get("error") and answer.get("stage") in ("rendezvous", "build"):
        return f"{answer['stage']} failed: {answer['error']}"
    return None


def _collect_until_infra_failure(refs: dict[int, Any], *, timeout: float) -> dict[int, Any]:
    """Like ``RankPool.collect``, but stops waiting at the first rank that failed for the
    harness's reasons (its peers would only wait for it until the rendezvous times out); the
    ranks not heard from are answered with ``TimeoutError`` (``_Abandoned`` when it stopped
    early)."""
    import ray
    from ray.exceptions import RayError

    rank_of = {ref: rank for rank, ref in refs.items()}
    pending = list(refs.values())
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        stop = False
        for ref in ready:
            try:
                out[rank_of[ref]] = ray.get(ref)
            except RayError as exc:
                out[rank_of[ref]] = exc
            stop = stop or infra_problem(out[rank_of[ref]]) is not None
        if stop:
            break
    for ref in pending:
        out[rank_of[ref]] = (TimeoutError(f"no answer within {timeout:.0f}s") if time.monotonic() >= deadline
                             else _Abandoned("not waited for: another rank failed to start"))
    return dict(sorted(out.items()))


class _Abandoned(TimeoutError):
    """A rank not waited for once another one failed to start."""
