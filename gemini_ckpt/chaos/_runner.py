"""Running scenarios: the :class:`Harness` (cluster, ranks, reference runs) and
:func:`run_scenario` (train, predict, strike, restart, restore, continue, check)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ._predict import (
    DURABLE,
    ERROR,
    FRESH,
    MEMORY,
    Prediction,
    Versions,
    make_placement,
    outcome_label,
    predict,
    versions_after,
)
from ._spec import (
    PERSIST_PHASES,
    STEP,
    ChaosConfig,
    CorruptDurable,
    CorruptReplica,
    DurableUnreachable,
    DurableWriteOutage,
    HookRule,
    KillStore,
    KillWorker,
    RemoveHosts,
    Scenario,
    SlowReplication,
)

StoreFactory = Callable[[Any, int, int], Any]
"""``store_factory(config, rank, world_size) -> Store``, called in each rank process; the store
is passed to ``Checkpointer(store=...)`` (e.g. a wrapper around ``connect_ray_store``)."""

PASS, MISMATCH, HARNESS_ERROR = "PASS", "MISMATCH", "ERROR"


class HarnessError(RuntimeError):
    """The harness could not run a scenario as written (not a verdict on the library)."""


# --- results -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One property checked after a scenario; ``ok`` is None when it did not apply."""

    name: str
    ok: Optional[bool]
    detail: str = ""


@dataclass
class ScenarioResult:
    """Everything one scenario predicted, observed and checked (``to_json`` for the report)."""

    scenario: Scenario
    prediction: Optional[Prediction] = None
    observed: dict = field(default_factory=dict)
    steps_lost: Optional[int] = None
    recovery_s: Optional[float] = None
    restore_s: Optional[float] = None
    checks: list[Check] = field(default_factory=list)
    error: Optional[str] = None
    duration_s: float = 0.0
    timings: dict = field(default_factory=dict)  # seconds per stage of the recovery
    notes: list[str] = field(default_factory=list)  # things worth knowing that are not a verdict

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return HARNESS_ERROR
        return PASS if all(c.ok is not False for c in self.checks) else MISMATCH

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def observed_label(self) -> str:
        if not self.observed:
            return "-"
        return outcome_label(self.observed.get("outcome"), self.observed.get("step"))

    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "name": s.name, "description": s.describe(), "placement": s.placement, "note": s.note,
            "at": {"step": s.at.step, "phase": s.at.phase, "rank": s.at.rank},
            "faults": [repr(f) for f in s.faults], "conditions": [repr(c) for c in s.conditions],
            "restart_hosts": list(s.restart_hosts) if s.restart_hosts is not None else None,
            "predicted": self.prediction.to_json() if self.prediction else None,
            "observed": self.observed, "observed_label": self.observed_label,
            "steps_lost": self.steps_lost, "recovery_s": self.recovery_s, "restore_s": self.restore_s,
            "timings": self.timings, "notes": self.notes,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "verdict": self.verdict, "error": self.error, "duration_s": round(self.duration_s, 2),
        }


@dataclass
class _Trace:
    """One job's records: step -> rank -> what ``RankWorker.run`` returned."""

    losses: dict[int, dict[int, float]] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    extras: dict[int, dict[int, dict]] = field(default_factory=dict)

    def add(self, records: dict[int, list[dict]]) -> None:
        for rank, recs in records.items():
            for rec in recs:
                if "loss" in rec:
                    self.losses.setdefault(rec["step"], {})[rank] = rec["loss"]
                    self.extras.setdefault(rec["step"], {})[rank] = rec["extra"]
                    self.digests[rec["step"]] = rec["digest"]


@dataclass
class Reference:
    """The uninterrupted run every scenario is compared with."""

    world_size: int
    initial_digest: str
    initial_extras: dict[int, dict]
    trace: _Trace
    full: dict[int, dict] = field(default_factory=dict)  # step -> full model/optim state
    opaque: dict[int, dict[int, dict]] = field(default_factory=dict)  # step -> rank -> opaque state
    seconds: float = 0.0


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
            run = _Job(self, "reference", job=job, persist=False)
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
                trace = _Trace()
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
            run = _Job(self, f"reference-ws{world_size}-from{key[2]}", job=job, persist=False)
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
                trace = _Trace()
                trace.add(records)
                run.expect_all(run.call(hosts, "close", timeout=cfg.timeout_s + 30), "close")
            finally:
                run.cleanup(hosts)
            self._resized[key] = {"trace": trace, "loaded": loaded}
        return self._resized[key]


def _stderr(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- one job on the pool -------------------------------------------------------------------------------
class _Job:
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
        stale = sorted(r for r, v in results.items() if isinstance(v, dict) and v.get("stale_plan_cache"))
        if stale:
            self.notes.append(f"ranks {stale} reused the DCP plan cache of a dead Checkpointer with the same "
                              f"id(); dropped it (see docs/chaos.md, findings)")
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
            problem = _err(r) or (r if isinstance(r, str) else None)
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


# --- one scenario ---------------------------------------------------------------------------------------
def _rules(s: Scenario, config: ChaosConfig) -> dict[int, list[HookRule]]:
    rules: dict[int, list[HookRule]] = {}
    f = s.at.step
    slow = s.condition(SlowReplication)
    if slow is not None:
        steps = slow.steps or tuple(range(0, f + 1))
        rules.setdefault(slow.rank, []).append(HookRule("replicate", None, "delay", slow.seconds, steps))
    if s.at.phase != STEP:
        rules.setdefault(s.at.rank, []).append(HookRule(s.at.phase, f, "pause"))
        if s.at.phase not in PERSIST_PHASES and config.persisted_by_policy(f):
            # Rank 0 would persist the version meanwhile; hold it so its fate follows the fault.
            rules.setdefault(0, []).append(HookRule("persist", f, "hold"))
    return rules


def _committed_on_all(records: dict[int, list[dict]]) -> list[int]:
    by_step: dict[int, list[bool]] = {}
    for recs in records.values():
        for rec in recs:
            by_step.setdefault(rec["step"], []).append(bool(rec.get("committed")))
    ranks = len(records)
    return sorted(st for st, oks in by_step.items() if len(oks) == ranks and all(oks))


def _durable_steps(root: str) -> list[int]:
    from .._fs_store import FsStore

    if not os.path.isdir(root):
        return []
    return FsStore(root).committed_steps()


def _flip_middle_byte(store, step: int, name: str) -> int:
    """Run inside a host store actor: flip one byte in the middle of its copy of ``name``."""
    record = store._versions[step].files[name]
    i = record.array.nbytes // 2
    record.array[i] ^= 0xFF
    return int(i)


def _corrupt_replica(namespace: str, node_id: str, step: int, name: str) -> int:
    import ray

    from .._cluster import find_store

    handle = find_store(namespace, node_id)
    if handle is None:
        raise HarnessError(f"no host store of namespace {namespace!r} on node {node_id[:12]} to corrupt")
    method = getattr(handle, "corrupt_for_test", None)
    if method is not None:
        return ray.get(method.remote(step, name), timeout=30)
    return ray.get(handle.__ray_call__.remote(_flip_middle_byte, step, name), timeout=30)


def _corrupt_file(path: str) -> int:
    with open(path, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        i = fh.tell() // 2
        fh.seek(i)
        b = fh.read(1)
        fh.seek(i)
        fh.write(bytes([b[0] ^ 0xFF]))
    return i


def run_scenario(scenario: Scenario, harness: Harness, *, job: Any = None,
                 store_factory: Optional[StoreFactory] = None) -> ScenarioResult:
    """Run one scenario on ``harness`` (started if needed) and check it (see
    :mod:`gemini_ckpt.chaos`). Never raises for what the scenario finds: a failed check makes
    the verdict ``MISMATCH``, a scenario the harness could not carry out ``ERROR``.

    ``job``: the training job (default: the harness's); its reference run is made once.
    ``store_factory``: replaces the faulty run's store (never the reference's), e.g. to check
    that the harness notices a broken store.
    """
    result = ScenarioResult(scenario=scenario)
    t_start = time.perf_counter()
    harness.start()
    try:
        harness.config.check(scenario)
        _run(scenario, harness, as_job(job) if job is not None else harness.job, store_factory, result)
    except Exception as exc:  # noqa: BLE001 - reported as the scenario's harness error
        result.error = _short(f"{type(exc).__name__}: {exc}", 1000)
    result.duration_s = time.perf_counter() - t_start
    harness.log(f"{scenario.name}: {result.verdict} predicted {result.prediction.label() if result.prediction else '-'}"
                f", observed {result.observed_label} ({result.duration_s:.1f}s)"
                + (f" {result.error}" if result.error else "")
                + "".join(f"\n    {c.name}: {c.detail}" for c in result.failed_checks())
                + "".join(f"\n    note: {n}" for n in result.notes))
    return result


def _run(s: Scenario, h: Harness, train_job: Any, store_factory: Optional[StoreFactory],
         result: ScenarioResult) -> None:
    cfg = h.config
    ref = h.reference(train_job)
    hosts = tuple(range(cfg.hosts))
    f = s.at.step
    p = make_placement(s.placement, cfg.hosts, cfg.replicas)
    outage = s.condition(DurableWriteOutage)
    unreachable = s.condition(DurableUnreachable) is not None
    job = _Job(h, s.name, job=train_job, placement=s.placement, store_factory=store_factory,
               chaos_fs=outage is not None or unreachable)
    outage_steps = outage.steps if outage else ()
    restart_hosts = s.restart_hosts if s.restart_hosts is not None else hosts
    checks = result.checks
    trace = _Trace()
    try:
        h.sim.ensure_hosts()
        h.pool.ensure(hosts)
        job.setup(hosts, rules=_rules(s, cfg))
        fresh = job.expect_all(job.call(hosts, "restore", timeout=cfg.timeout_s + 60), "restore")
        if any(r["step"] is not None for r in fresh.values()):
            raise HarnessError(f"a fresh namespace restored a version: {fresh}")

        # 1. train up to the fault
        before = list(range(0, f + 1 if s.at.phase == STEP else f))
        records = job.expect_all(job.run(hosts, before, outage_steps=outage_steps), "training before the fault")
        trace.add(records)
        committed = _committed_on_all(records)
        missing = sorted(set(before) - set(committed))
        if missing:
            first = next((r["error"] for recs in records.values() for r in recs if r.get("error")), "no error")
            raise HarnessError(f"steps {missing} were not committed before any fault: {_short(first)}")
        persisted = _durable_steps(job.durable_root)

        # 2. strike
        in_flight: dict[int, Any] = {}
        if s.at.phase != STEP:
            in_flight = job.run_async(hosts, [f], outage_steps=outage_steps)
            _wait_paused(h, hosts[s.at.rank], s, in_flight, cfg.timeout_s + 30)
        t_fault = time.perf_counter()
        corrupt_memory, corrupt_durable = _inject(s, h, job, hosts, committed, persisted)
        replace_s = time.perf_counter() - t_fault
        if in_flight:
            late = _let_go(s, h, cfg, hosts, in_flight)
            trace.add({r: v for r, v in late.items() if isinstance(v, list)})

        # 3. what the planner says should happen
        versions = versions_after(s, cfg, committed=committed, persisted=persisted, p=p, hosts=hosts)
        pred = predict(p, failed=s.failed_slots(), versions=versions, durable_available=not unreachable,
                       corrupt_memory=corrupt_memory, corrupt_durable=corrupt_durable)
        result.prediction = pred

        # 4. restart and restore
        t_restart = time.perf_counter()
        timings = result.timings
        timings["fault_s"] = replace_s
        timings["let_go_s"] = t_restart - t_fault - replace_s
        survivors = tuple(x for x in hosts if x not in s.removed_hosts() and x in h.pool.workers)
        h.pool.teardown(survivors)
        timings["teardown_s"] = time.perf_counter() - t_restart
        t = time.perf_counter()
        h.pool.ensure(restart_hosts)
        timings["workers_s"] = time.perf_counter() - t
        t = time.perf_counter()
        setup = job.setup(restart_hosts, storage_mode="unreachable" if unreachable else "ok", strict=False)
        timings["setup_s"] = time.perf_counter() - t
        errors = {r: _err(v) for r, v in setup.items() if _err(v)}
        restored: dict[int, Any] = {}
        if not errors:
            t = time.perf_counter()
            restored = job.call(restart_hosts, "restore", timeout=cfg.timeout_s + 60)
            timings["restore_s"] = time.perf_counter() - t
            errors = {r: _err(v) for r, v in restored.items() if _err(v)}
        for k in timings:
            timings[k] = round(timings[k], 2)
        # Detection, replacement hosts, restart and restore; not the harness's own waiting for
        # survivors stuck in a collective with a dead peer (a job controller kills those at once).
        result.recovery_s = round(replace_s + time.perf_counter() - t_restart, 2)
        observed = _observe(restored, errors)
        result.observed = observed
        if errors:
            result.steps_lost = None
        else:
            result.steps_lost = f - (observed["step"] if observed["step"] is not None else -1)
            result.restore_s = round(max(v["seconds"] for v in restored.values()), 3)
        if unreachable and not errors:
            job.call(restart_hosts, "set_storage", "ok", timeout=30)

        # 5. check what restore did
        checks.append(Check("prediction", (observed["outcome"], observed.get("step")) == (pred.outcome, pred.step),
                            f"predicted {pred.label()} ({pred.reason}); observed {result.observed_label}"
                            + (f": {observed.get('error')}" if observed.get("error") else "")))
        checks.extend(_check_pre_fault(trace, ref, before))
        durable_now = _durable_steps(job.durable_root)
        checks.append(Check("durable_tier", durable_now == list(versions.persisted),
                            f"complete durable versions {durable_now}, predicted {list(versions.persisted)}"))
        if errors:
            for name in ("agreed", "exact_restore", "committed_only", "continued", "final_state", "finished"):
                checks.append(Check(name, None, "restore failed"))
            return
        _check_restore(checks, restored, versions, ref, cfg.hosts)

        # 6. continue to the end and compare with the reference
        step0 = observed["step"]
        rest = list(range((step0 if step0 is not None else -1) + 1, cfg.steps))
        after = job.run(restart_hosts, rest)
        closed = job.call(restart_hosts, "close", timeout=cfg.timeout_s + 60)
        _check_continuation(checks, h, train_job, ref, after, closed, restart_hosts, step0, rest)
    finally:
        result.notes.extend(job.notes)
        job.cleanup(hosts + tuple(x for x in restart_hosts if x not in hosts))


def _let_go(s: Scenario, h: Harness, cfg: ChaosConfig, hosts: tuple[int, ...], in_flight: dict[int, Any],
            grace_s: float = 10.0) -> dict[int, Any]:
    """Release the ranks held at the fault's phase and collect what their in-flight step did.

    Survivors whose peers died sit in a collective until the process group's timeout; they are
    not waited for (the restart replaces them). Rank 0 is waited for when it may still be
    persisting the version in flight, so the durable tier ends up as the prediction assumes."""
    alive = {r: hosts[r] for r in range(len(hosts)) if hosts[r] in h.pool.workers}
    h.pool.collect({r: h.pool.workers[x].release.remote() for r, x in alive.items()}, timeout=10)
    out = h.pool.collect(in_flight, timeout=grace_s)
    persisting = s.at.phase in ("committed", "persist", "persist_commit") and cfg.persisted_by_policy(s.at.step)
    if persisting and 0 in alive and isinstance(out.get(0), TimeoutError):
        out.update(h.pool.collect({0: in_flight[0]}, timeout=cfg.timeout_s + 30))
    for r, v in out.items():
        if isinstance(v, TimeoutError) and r in alive:
            h.pool.forget(alive[r])  # stuck with a dead peer: replaced at the restart
    return out


def _wait_paused(h: Harness, host: int, s: Scenario, in_flight: dict, timeout: float) -> None:
    import ray

    deadline = time.monotonic() + timeout
    worker = h.pool.workers[host]
    while time.monotonic() < deadline:
        try:
            state = ray.get(worker.paused.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            state = None
        if state and state["step"] == s.at.step and state["phase"] == s.at.phase:
            return
        done, _ = ray.wait(list(in_flight.values()), num_returns=len(in_flight), timeout=0)
        if len(done) == len(in_flight):
            outcome = h.pool.collect(in_flight, timeout=1)
            raise HarnessError(f"phase {s.at.phase!r} of step {s.at.step} never ran on rank {s.at.rank}: {outcome}")
        time.sleep(0.1)
    raise HarnessError(f"rank {s.at.rank} did not reach phase {s.at.phase!r} of step {s.at.step} within {timeout}s")


def _inject(s: Scenario, h: Harness, job: _Job, hosts: tuple[int, ...], committed: list[int],
            persisted: list[int]) -> tuple[dict, set]:
    """Apply the faults; returns what was corrupted (memory: step -> owner -> slots; durable steps)."""
    import ray

    from .._cluster import find_store
    from .._dcp_storage import data_file_name
    from .._fs_store import step_dir_name

    corrupt_memory: dict[int, dict[int, set]] = {}
    corrupt_durable: set[int] = set()
    for fault in s.faults:
        if isinstance(fault, CorruptReplica):
            if not committed:
                raise HarnessError(f"{fault!r}: no committed version to corrupt yet")
            step = max(committed)
            _corrupt_replica(job.namespace, h.sim.node_id(fault.host), step, data_file_name(fault.owner))
            corrupt_memory.setdefault(step, {}).setdefault(fault.owner, set()).add(fault.host)
        elif isinstance(fault, CorruptDurable):
            if not persisted:
                raise HarnessError(f"{fault!r}: no persisted version to corrupt yet")
            step = max(persisted)
            _corrupt_file(os.path.join(job.durable_root, step_dir_name(step), data_file_name(fault.rank)))
            corrupt_durable.add(step)
    for fault in s.faults:
        if isinstance(fault, KillWorker):
            for rank in fault.ranks:
                h.pool.sigkill(hosts[rank])
    for fault in s.faults:
        if isinstance(fault, KillStore):
            for host in fault.hosts:
                handle = find_store(job.namespace, h.sim.node_id(host))
                if handle is not None:
                    ray.kill(handle, no_restart=True)
    removed = s.removed_hosts()
    if removed:
        h.sim.remove_hosts(removed)
        for host in removed:
            h.pool.forget(host)
        for host in s.replaced_hosts():
            h.sim.add_host(host)
    return corrupt_memory, corrupt_durable


def _short(text: str, limit: int = 400) -> str:
    """One line, at most ``limit`` characters (tracebacks stay in the logs)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _err(value: Any) -> Optional[str]:
    if isinstance(value, BaseException):
        cause = getattr(value, "cause", None)  # a RayTaskError: the rank's own exception
        if isinstance(cause, BaseException):
            value = cause
        return f"{type(value).__name__}: {value}"
    if isinstance(value, dict) and value.get("error"):
        return value["error"]
    return None


def _observe(restored: dict[int, Any], errors: dict[int, str]) -> dict:
    if errors:
        rank, message = sorted(errors.items())[0]
        return {"outcome": ERROR, "step": None, "error": _short(f"rank {rank}: {message}", 600)}
    r0 = restored[0]
    if r0["step"] is None:
        return {"outcome": FRESH, "step": None}
    return {"outcome": r0["source"], "step": r0["step"], "sources": {str(k): v for k, v in r0["sources"].items()},
            "bytes_read": r0["bytes_read"], "skipped_steps": r0["skipped_steps"],
            "saved_world_size": r0["saved_world_size"], "world_size": len(restored)}


def _check_pre_fault(trace: _Trace, ref: Reference, steps: list[int]) -> list[Check]:
    bad = [st for st in steps if trace.losses.get(st) != ref.trace.losses.get(st)
           or trace.digests.get(st) != ref.trace.digests.get(st)]
    return [Check("pre_fault", not bad, f"steps {bad} differ from the reference before any fault" if bad
                  else f"steps 0..{steps[-1] if steps else -1} equal the reference")]


def _check_restore(checks: list[Check], restored: dict[int, dict], versions: Versions, ref: Reference,
                   saved_world_size: int) -> None:
    pairs = {(v["step"], v["source"]) for v in restored.values()}
    checks.append(Check("agreed", len(pairs) == 1, f"ranks restored {sorted(pairs, key=str)}"))
    step, source = restored[0]["step"], restored[0]["source"]
    digests = {v["digest"] for v in restored.values()}
    expected = ref.initial_digest if step is None else ref.trace.digests.get(step)
    exact = digests == {expected}
    local_bad = []
    for rank, v in restored.items():
        want = ref.initial_extras.get(rank % saved_world_size) if step is None \
            else ref.trace.extras[step][rank % saved_world_size]
        if v["extra"] != want:
            local_bad.append(rank)
    detail = (f"model+optimizer state {'equals' if exact else 'differs from'} the reference at "
              f"{'the start' if step is None else f'step {step}'}")
    if local_bad:
        detail += f"; rank-local state of ranks {local_bad} differs"
    checks.append(Check("exact_restore", exact and not local_bad, detail))
    if step is None:
        checks.append(Check("committed_only", None, "fresh start"))
    else:
        known = versions.committed if source == MEMORY else versions.persisted if source == DURABLE else ()
        checks.append(Check("committed_only", step in known,
                            f"step {step} {'is' if step in known else 'is NOT'} a {source} version known "
                            f"committed {list(known)}"))


def _check_continuation(checks: list[Check], h: Harness, train_job: Any, ref: Reference, after: dict[int, Any],
                        closed: dict[int, Any], hosts: tuple[int, ...], step0: Optional[int], rest: list[int]) -> None:
    errors = {r: _err(v) for r, v in after.items() if _err(v)}
    records = {r: v for r, v in after.items() if isinstance(v, list)}
    for r, recs in records.items():
        for rec in recs:
            if rec.get("error"):
                errors[r] = f"step {rec['step']}: {rec['error']}"
            elif rec.get("persist_error"):
                errors[r] = f"step {rec['step']} was not persisted: {rec['persist_error']}"
    close_errors = {r: _err(v) or v for r, v in closed.items() if _err(v) or isinstance(v, str)}
    trace = _Trace()
    trace.add(records)
    if len(hosts) == ref.world_size:
        want = ref.trace
    else:
        want = h.resized_reference(len(hosts), step0, train_job)["trace"]
    done = all(len(recs) == len(rest) and all(rec.get("committed") for rec in recs) for recs in records.values())
    finished = done and len(records) == len(hosts) and not errors and not close_errors
    checks.append(Check("finished", finished, f"steps {rest[0] if rest else '-'}..{rest[-1] if rest else '-'} "
                        f"trained and committed, close() ok" if finished
                        else _short(f"errors {errors or close_errors}", 600)))
    bad = [st for st in rest if trace.losses.get(st) != want.losses.get(st)]
    checks.append(Check("continued", not bad and done,
                        f"losses of steps {bad} differ from the reference" if bad
                        else f"losses of {len(rest)} step(s) bit-identical to the reference"))
    last = rest[-1] if rest else None
    same = last is not None and trace.digests.get(last) == want.digests.get(last) \
        and trace.extras.get(last) == want.extras.get(last)
    checks.append(Check("final_state", same if last is not None else None,
                        "final model+optimizer digest and rank-local state equal the reference" if same
                        else f"final state differs (step {last})"))
