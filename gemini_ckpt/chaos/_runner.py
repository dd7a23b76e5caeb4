"""Running one scenario: train, strike, predict, restart, restore, continue, check."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from ._harness import Harness, as_job
from ._jobrun import JobRun, StoreFactory
from ._predict import (
    make_placement,
    predict,
    versions_after,
)
from ._results import (
    Check,
    HarnessError,
    InfraError,
    ScenarioResult,
    Trace,
    err,
    infrastructure,
    short,
)
from ._checks import check_continuation, check_pre_fault, check_restore, observe
from ._inject import inject, let_go, store_of, wait_paused, ray_get
from ._network import Links
from ._faults import (
    DurableUnreachable,
    DurableWriteOutage,
    NanInState,
    SlowReplication,
)
from ._phases import (
    PERSIST_PHASES,
    STEP,
    STORE_PHASES,
    HookRule,
)
from ._spec import (
    ChaosConfig,
    Scenario,
)


# --- one scenario ---------------------------------------------------------------------------------------
def _rules(s: Scenario, config: ChaosConfig) -> dict[int, list[HookRule]]:
    rules: dict[int, list[HookRule]] = {}
    f = s.at.step
    slow = s.condition(SlowReplication)
    if slow is not None:
        steps = slow.steps or tuple(range(0, f + 1))
        rules.setdefault(slow.rank, []).append(HookRule("replicate", None, "delay", slow.seconds, steps))
    if s.at.phase != STEP:
        if s.at.phase not in STORE_PHASES:
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
    from ..durable.fs import FsStore

    if not os.path.isdir(root):
        return []
    return FsStore(root).committed_steps()


def _lose_during_restore(
    h: Harness, job: JobRun, s: Scenario, restart_hosts: tuple[int, ...], lost: tuple[int, ...], unreachable: bool
) -> dict[int, Any]:
    """Start the restore, remove ``lost`` while their ranks are inside it (held at its
    ``restore`` phase), replace them, and start the job once more (the survivors' restore waits
    on a dead rank: their processes are replaced, as a job controller would)."""
    cfg = h.config
    pending = {rank: h.pool.workers[x].restore.remote() for rank, x in enumerate(restart_hosts)}
    deadline = time.monotonic() + cfg.timeout_s + 60
    for x in lost:
        while True:
            state = ray_get(h.pool.workers[x].paused.remote(), timeout=10)
            if state and state.get("phase") == "restore":
                break
            if time.monotonic() > deadline:
                raise HarnessError(f"the rank on host {x} did not reach its restore within {cfg.timeout_s + 60:.0f}s")
            time.sleep(0.1)
    with infrastructure(f"removing hosts {list(lost)} during their restore and adding replacements"):
        h.sim.remove_hosts(lost)
        for x in lost:
            h.pool.forget(x)
            h.sim.add_host(x)
    job.kill(tuple(x for x in restart_hosts if x not in lost))
    del pending
    with infrastructure(f"starting rank processes on hosts {list(restart_hosts)} again"):
        h.pool.ensure(restart_hosts)
    return job.setup(restart_hosts, storage_mode="unreachable" if unreachable else "ok", strict=False)


def _check_unhealthy_skipped(s: Scenario, restored: dict[int, Any], errors: dict[int, str]) -> Check:
    """Restore must name each poisoned version newer than what it loaded among the steps it
    skipped (with the health check's reason), on every rank."""
    if errors:
        return Check("unhealthy_skipped", None, "restore failed")
    bad = []
    for rank, v in sorted(restored.items()):
        want = {x for x in s.unhealthy_steps() if v["step"] is None or x > v["step"]}
        if not want <= set(v.get("skipped_steps") or ()):
            bad.append(rank)
    return Check(
        "unhealthy_skipped",
        not bad,
        f"ranks {bad} did not report the unhealthy step(s) {list(s.unhealthy_steps())} as skipped"
        if bad
        else f"every rank skipped the unhealthy step(s) {list(s.unhealthy_steps())}",
    )


def run_scenario(
    scenario: Scenario, harness: Harness, *, job: Any = None, store_factory: Optional[StoreFactory] = None
) -> ScenarioResult:
    """Run one scenario on ``harness`` (started if needed) and check it (see
    :mod:`gemini_ckpt.chaos`). Never raises for what the scenario finds: a failed check makes
    the verdict ``MISMATCH``; a scenario the harness's own machinery could not carry out (a
    rank process, the rendezvous, the job's ``build``, the simulated cluster failed)
    ``INFRA-ERROR``; any other reason it could not be carried out ``ERROR``. Whatever happens,
    the scenario's job is torn down before this returns (its rank processes replaced when they
    may be in any doubt), so the next scenario starts clean.

    ``job``: the training job (default: the harness's); its reference run is made once.
    ``store_factory``: replaces the faulty run's store (never the reference's), e.g. to check
    that the harness notices a broken store.
    """
    result = ScenarioResult(scenario=scenario)
    t_start = time.perf_counter()
    harness.start()
    try:
        harness.config.check(scenario)
        left = harness.sweep()
        if left:
            result.notes.append(f"removed host stores left over from before this scenario: {left}")
        _run(scenario, harness, as_job(job) if job is not None else harness.job, store_factory, result)
    except Exception as exc:  # noqa: BLE001 - reported as the scenario's harness error
        from ray.exceptions import RayError  # a Ray call of the harness's own failed

        result.error = short(f"{type(exc).__name__}: {exc}", 1000)
        result.infra = isinstance(exc, (InfraError, RayError))
    result.duration_s = time.perf_counter() - t_start
    harness.log(
        f"{scenario.name}: {result.verdict} predicted {result.prediction.label() if result.prediction else '-'}"
        f", observed {result.observed_label} ({result.duration_s:.1f}s)"
        + (f" {result.error}" if result.error else "")
        + "".join(f"\n    {c.name}: {c.detail}" for c in result.failed_checks())
        + "".join(f"\n    note: {n}" for n in result.notes)
    )
    return result


def _run(
    s: Scenario, h: Harness, train_job: Any, store_factory: Optional[StoreFactory], result: ScenarioResult
) -> None:
    cfg = h.config
    ref = h.reference(train_job)
    hosts = tuple(range(cfg.hosts))
    f = s.at.step
    p = make_placement(s.placement, cfg.hosts, cfg.replicas, cfg.domains)
    outage = s.condition(DurableWriteOutage)
    unreachable = s.condition(DurableUnreachable) is not None
    job = JobRun(
        h,
        s.name,
        job=train_job,
        placement=s.placement,
        store_factory=store_factory,
        chaos_fs=outage is not None or unreachable,
    )
    outage_steps = outage.steps if outage else ()
    restart_hosts = s.restart_hosts if s.restart_hosts is not None else hosts
    checks = result.checks
    trace = Trace()
    links = Links(s, h)
    ok = False
    try:
        h.ensure(hosts)
        job.setup(hosts, rules=_rules(s, cfg))
        fresh = job.expect_all(job.call(hosts, "restore", timeout=cfg.timeout_s + 60), "restore")
        if any(r["step"] is not None for r in fresh.values()):
            raise HarnessError(f"a fresh namespace restored a version: {fresh}")

        # 1. train up to the fault (a slow or flapping link meanwhile)
        links.start()
        t_train = time.perf_counter()
        before = list(range(0, f + 1 if s.at.phase == STEP else f))
        nan = s.condition(NanInState)
        poison = {"poison_steps": s.unhealthy_steps()} if nan is not None else {}
        if poison:  # only the poisoned rank's state goes bad
            refs = {
                rank: h.pool.workers[x].run.remote(
                    before, outage_steps=outage_steps, **(poison if rank == nan.rank else {})
                )
                for rank, x in enumerate(hosts)
            }
            records = job.expect_all(
                h.pool.collect(refs, timeout=job.run_timeout(len(before))), "training before the fault"
            )
        else:
            records = job.expect_all(job.run(hosts, before, outage_steps=outage_steps), "training before the fault")
        trace.add(records)
        result.timings["train_before_s"] = round(time.perf_counter() - t_train, 2)
        checks.extend(links.settle())
        committed = _committed_on_all(records)
        missing = sorted(set(before) - set(committed))
        if missing:
            first = next((r["error"] for recs in records.values() for r in recs if r.get("error")), "no error")
            raise HarnessError(f"steps {missing} were not committed before any fault: {short(first)}")
        persisted = _durable_steps(job.durable_root)

        # 2. strike
        in_flight: dict[int, Any] = {}
        if s.at.phase in STORE_PHASES:
            ray_get(store_of(job.namespace, h.sim.node_id(hosts[s.at.rank])).hold_vote.remote(f))
        if s.at.phase != STEP:
            in_flight = job.run_async(hosts, [f], outage_steps=outage_steps)
            wait_paused(h, hosts[s.at.rank], s, in_flight, cfg.timeout_s + 30, job.namespace)
        t_fault = time.perf_counter()
        corrupt_memory, corrupt_durable = inject(s, h, job, hosts, committed, persisted)
        links.partition()
        result.timings.update({f"declared_dead_{x}_s": c["dead_s"] for x, c in links.cut.items()})
        replace_s = time.perf_counter() - t_fault
        if in_flight:
            late = let_go(s, h, cfg, hosts, in_flight, job.namespace)
            trace.add({r: v for r, v in late.items() if isinstance(v, list)})

        # 3. what the planner says should happen
        versions = versions_after(s, cfg, committed=committed, persisted=persisted, p=p, hosts=hosts)
        pred = predict(
            p,
            failed=s.failed_slots(),
            versions=versions,
            durable_available=not unreachable,
            corrupt_memory=corrupt_memory,
            corrupt_durable=corrupt_durable,
        )
        result.prediction = pred

        # 4. restart and restore
        t_restart = time.perf_counter()
        timings = result.timings
        timings["fault_s"] = replace_s
        timings["let_go_s"] = t_restart - t_fault - replace_s
        dead = s.dead_ranks(hosts)
        survivors = tuple(x for r, x in enumerate(hosts) if r not in dead and x in h.pool.workers)
        h.pool.teardown(survivors)
        timings["teardown_s"] = time.perf_counter() - t_restart
        t = time.perf_counter()
        with infrastructure(f"starting rank processes on hosts {list(restart_hosts)}"):
            h.pool.ensure(restart_hosts)
        timings["workers_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lost_again = s.lost_in_restore()
        rules = {rank: [HookRule("restore", None, "pause")] for rank, x in enumerate(restart_hosts) if x in lost_again}
        setup = job.setup(restart_hosts, storage_mode="unreachable" if unreachable else "ok", strict=False, rules=rules)
        errors = {r: err(v) for r, v in setup.items() if err(v)}
        if lost_again and not errors:
            setup = _lose_during_restore(h, job, s, restart_hosts, lost_again, unreachable)
            errors = {r: err(v) for r, v in setup.items() if err(v)}
        timings["setup_s"] = time.perf_counter() - t
        restored: dict[int, Any] = {}
        if not errors:
            t = time.perf_counter()
            restored = job.call(restart_hosts, "restore", timeout=cfg.timeout_s + 60)
            timings["restore_s"] = time.perf_counter() - t
            errors = {r: err(v) for r, v in restored.items() if err(v)}
        links.reconnect()  # the partitioned host comes back into a job that restarted without it
        for k in timings:
            timings[k] = round(timings[k], 2)
        # Detection, replacement hosts, restart and restore; not the harness's own waiting for
        # survivors stuck in a collective with a dead peer (a job controller kills those at once).
        result.recovery_s = round(replace_s + time.perf_counter() - t_restart, 2)
        observed = observe(restored, errors)
        result.observed = observed
        if errors:
            result.steps_lost = None
        else:
            result.steps_lost = f - (observed["step"] if observed["step"] is not None else -1)
            result.restore_s = round(max(v["seconds"] for v in restored.values()), 3)
        if unreachable and not errors:
            job.call(restart_hosts, "set_storage", "ok", timeout=30)

        # 5. check what restore did
        checks.append(
            Check(
                "prediction",
                (observed["outcome"], observed.get("step")) == (pred.outcome, pred.step),
                f"predicted {pred.label()} ({pred.reason}); observed {result.observed_label}"
                + (f": {observed.get('error')}" if observed.get("error") else ""),
            )
        )
        # A poisoned step differs from the reference by design; the ones before it must not.
        checks.extend(check_pre_fault(trace, ref, [x for x in before if x not in s.unhealthy_steps()]))
        if s.unhealthy_steps():
            checks.append(_check_unhealthy_skipped(s, restored, errors))
        durable_now = _durable_steps(job.durable_root)
        checks.append(
            Check(
                "durable_tier",
                durable_now == list(versions.persisted),
                f"complete durable versions {durable_now}, predicted {list(versions.persisted)}",
            )
        )
        if errors:
            for name in ("agreed", "exact_restore", "committed_only", "continued", "final_state", "finished"):
                checks.append(Check(name, None, "restore failed"))
            checks.extend(links.check_fenced())
            ok = True
            return
        check_restore(checks, restored, versions, ref, cfg.hosts)

        # 6. continue to the end and compare with the reference
        step0 = observed["step"]
        rest = list(range((step0 if step0 is not None else -1) + 1, cfg.steps))
        t = time.perf_counter()
        after = job.run(restart_hosts, rest)
        result.timings["continue_s"] = round(time.perf_counter() - t, 2)
        closed = job.call(restart_hosts, "close", timeout=cfg.timeout_s + 60)
        # Before the comparison: a resized reference run replaces hosts Ray declared dead.
        checks.extend(links.check_fenced())
        check_continuation(checks, h, train_job, ref, after, closed, restart_hosts, step0, rest)
        ok = True
    finally:
        result.notes.extend(job.notes)
        # After a failure the ranks may be anywhere (held at a phase, inside a collective):
        # their processes are killed rather than asked to leave.
        try:
            job.cleanup(hosts + tuple(x for x in restart_hosts if x not in hosts), kill=not ok)
        finally:
            links.restore()
