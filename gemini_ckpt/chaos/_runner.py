"""Running one scenario: train, strike, predict, restart, restore, continue, check."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from ._harness import Harness, JobRun, StoreFactory, as_job
from ._predict import DURABLE, ERROR, FRESH, MEMORY, Versions, make_placement, predict, versions_after
from ._results import Check, HarnessError, InfraError, Reference, ScenarioResult, Trace, err, infrastructure, short
from ._spec import (
    PERSIST_PHASES,
    STEP,
    STORE_PHASES,
    ChaosConfig,
    CorruptDurable,
    CorruptReplica,
    DurableUnreachable,
    DurableWriteOutage,
    HookRule,
    KillStore,
    KillWorker,
    Scenario,
    SlowReplication,
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
    from .._fs_store import FsStore

    if not os.path.isdir(root):
        return []
    return FsStore(root).committed_steps()


def _store(namespace: str, node_id: str):
    from .._cluster import find_store

    handle = find_store(namespace, node_id)
    if handle is None:
        raise HarnessError(f"no host store of namespace {namespace!r} on node {node_id[:12]}")
    return handle


def _corrupt_replica(namespace: str, node_id: str, step: int, rank: int) -> int:
    """Flip a byte in the middle of the biggest tensor item of that store's copy of rank
    ``rank``'s shard (every tensor item is read at restore)."""
    import ray

    from ..stores.shards import ShardPlan

    handle = _store(namespace, node_id)
    held = ray.get(handle.shard_info.remote(step, [rank]), timeout=30)
    if rank not in held:
        raise HarnessError(f"the host store on node {node_id[:12]} holds no copy of rank {rank}'s shard of "
                           f"step {step}")
    item = max(ShardPlan.decode(held[rank][0]).tensors, key=lambda t: t.nbytes)
    return ray.get(handle.corrupt_for_test.remote(step, rank, item.at + item.nbytes // 2), timeout=30)


def ray_get(ref, timeout: float = 30.0):
    import ray

    return ray.get(ref, timeout=timeout)


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
    job = JobRun(h, s.name, job=train_job, placement=s.placement, store_factory=store_factory,
                 chaos_fs=outage is not None or unreachable)
    outage_steps = outage.steps if outage else ()
    restart_hosts = s.restart_hosts if s.restart_hosts is not None else hosts
    checks = result.checks
    trace = Trace()
    ok = False
    try:
        h.ensure(hosts)
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
            raise HarnessError(f"steps {missing} were not committed before any fault: {short(first)}")
        persisted = _durable_steps(job.durable_root)

        # 2. strike
        in_flight: dict[int, Any] = {}
        if s.at.phase in STORE_PHASES:
            ray_get(_store(job.namespace, h.sim.node_id(hosts[s.at.rank])).hold_vote.remote(f))
        if s.at.phase != STEP:
            in_flight = job.run_async(hosts, [f], outage_steps=outage_steps)
            _wait_paused(h, hosts[s.at.rank], s, in_flight, cfg.timeout_s + 30, job.namespace)
        t_fault = time.perf_counter()
        corrupt_memory, corrupt_durable = _inject(s, h, job, hosts, committed, persisted)
        replace_s = time.perf_counter() - t_fault
        if in_flight:
            late = _let_go(s, h, cfg, hosts, in_flight, job.namespace)
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
        dead = s.dead_ranks(hosts)
        survivors = tuple(x for r, x in enumerate(hosts) if r not in dead and x in h.pool.workers)
        h.pool.teardown(survivors)
        timings["teardown_s"] = time.perf_counter() - t_restart
        t = time.perf_counter()
        with infrastructure(f"starting rank processes on hosts {list(restart_hosts)}"):
            h.pool.ensure(restart_hosts)
        timings["workers_s"] = time.perf_counter() - t
        t = time.perf_counter()
        setup = job.setup(restart_hosts, storage_mode="unreachable" if unreachable else "ok", strict=False)
        timings["setup_s"] = time.perf_counter() - t
        errors = {r: err(v) for r, v in setup.items() if err(v)}
        restored: dict[int, Any] = {}
        if not errors:
            t = time.perf_counter()
            restored = job.call(restart_hosts, "restore", timeout=cfg.timeout_s + 60)
            timings["restore_s"] = time.perf_counter() - t
            errors = {r: err(v) for r, v in restored.items() if err(v)}
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
            ok = True
            return
        _check_restore(checks, restored, versions, ref, cfg.hosts)

        # 6. continue to the end and compare with the reference
        step0 = observed["step"]
        rest = list(range((step0 if step0 is not None else -1) + 1, cfg.steps))
        after = job.run(restart_hosts, rest)
        closed = job.call(restart_hosts, "close", timeout=cfg.timeout_s + 60)
        _check_continuation(checks, h, train_job, ref, after, closed, restart_hosts, step0, rest)
        ok = True
    finally:
        result.notes.extend(job.notes)
        # After a failure the ranks may be anywhere (held at a phase, inside a collective):
        # their processes are killed rather than asked to leave.
        job.cleanup(hosts + tuple(x for x in restart_hosts if x not in hosts), kill=not ok)


def _let_go(s: Scenario, h: Harness, cfg: ChaosConfig, hosts: tuple[int, ...], in_flight: dict[int, Any],
            namespace: str, grace_s: float = 3.0) -> dict[int, Any]:
    """Release the ranks held at the fault's phase and collect what their in-flight step did.

    Survivors whose peers died sit in a collective until the process group's timeout; they are
    not waited for (the restart replaces them). Rank 0 is waited for when it may still be
    persisting the version in flight, so the durable tier ends up as the prediction assumes."""
    dead = s.dead_ranks(hosts)  # their hosts already run replacement workers
    alive = {r: hosts[r] for r in range(len(hosts)) if r not in dead and hosts[r] in h.pool.workers}
    if s.at.phase in STORE_PHASES and hosts[s.at.rank] not in s.failed_slots():
        # The held vote goes out only once the registry knows of every store the faults took:
        # then the coordinator decides with that knowledge, as it would had the vote been slower.
        _wait_known_dead(namespace, s.failed_slots(), timeout=cfg.timeout_s)
        try:
            ray_get(_store(namespace, h.sim.node_id(hosts[s.at.rank])).release_vote.remote())
        except Exception:  # noqa: BLE001 - the store died with its host: nothing to let go
            pass
    h.pool.collect({r: h.pool.workers[x].release.remote() for r, x in alive.items()}, timeout=10)
    out = h.pool.collect(in_flight, timeout=grace_s)
    persisting = s.at.phase in ("committed", "persist", "persist_commit") and cfg.persisted_by_policy(s.at.step)
    if persisting and 0 in alive and isinstance(out.get(0), TimeoutError):
        out.update(h.pool.collect({0: in_flight[0]}, timeout=cfg.timeout_s + 30))
    for r, v in out.items():
        if isinstance(v, TimeoutError) and r in alive:
            h.pool.forget(alive[r])  # stuck with a dead peer: replaced at the restart
    return out


def _wait_known_dead(namespace: str, slots, timeout: float) -> None:
    from .._cluster import find_registry

    registry = find_registry(namespace)
    deadline = time.monotonic() + timeout
    while slots and registry is not None and time.monotonic() < deadline:
        table = ray_get(registry.table.remote()) or {}
        if set(slots) <= set(table.get("dead", ())):
            return
        time.sleep(0.2)


def _wait_paused(h: Harness, host: int, s: Scenario, in_flight: dict, timeout: float, namespace: str) -> None:
    import ray

    deadline = time.monotonic() + timeout
    worker = h.pool.workers[host]
    store = _store(namespace, h.sim.node_id(host)) if s.at.phase in STORE_PHASES else None
    while time.monotonic() < deadline:
        try:
            if store is not None:
                held = ray.get(store.held.remote(), timeout=10)
                state = {"step": held, "phase": s.at.phase} if held is not None else None
            else:
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


def _inject(s: Scenario, h: Harness, job: JobRun, hosts: tuple[int, ...], committed: list[int],
            persisted: list[int]) -> tuple[dict, set]:
    """Apply the faults; returns what was corrupted (memory: step -> owner -> slots; durable steps)."""
    import ray

    from .._cluster import find_store
    from ..persister import data_file_name
    from .._fs_store import step_dir_name

    corrupt_memory: dict[int, dict[int, set]] = {}
    corrupt_durable: set[int] = set()
    for fault in s.faults:
        if isinstance(fault, CorruptReplica):
            if not committed:
                raise HarnessError(f"{fault!r}: no committed version to corrupt yet")
            step = max(committed)
            _corrupt_replica(job.namespace, h.sim.node_id(fault.host), step, fault.owner)
            corrupt_memory.setdefault(step, {}).setdefault(fault.owner, set()).add(fault.host)
        elif isinstance(fault, CorruptDurable):
            if not persisted:
                raise HarnessError(f"{fault!r}: no persisted version to corrupt yet")
            step = max(persisted)
            _corrupt_file(os.path.join(job.durable_root, step_dir_name(step), data_file_name(fault.rank)))
            corrupt_durable.add(step)
    killed = tuple(hosts[rank] for fault in s.faults if isinstance(fault, KillWorker) for rank in fault.ranks)
    for host in killed:
        h.pool.sigkill(host)
    h.pool.respawn(killed)
    for fault in s.faults:
        if isinstance(fault, KillStore):
            for host in fault.hosts:
                handle = find_store(job.namespace, h.sim.node_id(host))
                if handle is not None:
                    ray.kill(handle, no_restart=True)
    removed = s.removed_hosts()
    if removed:
        with infrastructure(f"removing hosts {list(removed)} and adding replacements"):
            h.sim.remove_hosts(removed)
            for host in removed:
                h.pool.forget(host)
            for host in s.replaced_hosts():
                h.sim.add_host(host)
            h.pool.respawn(s.replaced_hosts())
    return corrupt_memory, corrupt_durable


def _observe(restored: dict[int, Any], errors: dict[int, str]) -> dict:
    if errors:
        rank, message = sorted(errors.items())[0]
        return {"outcome": ERROR, "step": None, "error": short(f"rank {rank}: {message}", 600)}
    r0 = restored[0]
    if r0["step"] is None:
        return {"outcome": FRESH, "step": None}
    return {"outcome": r0["source"], "step": r0["step"], "sources": {str(k): v for k, v in r0["sources"].items()},
            "bytes_read": r0["bytes_read"], "skipped_steps": r0["skipped_steps"],
            "saved_world_size": r0["saved_world_size"], "world_size": len(restored)}


def _check_pre_fault(trace: Trace, ref: Reference, steps: list[int]) -> list[Check]:
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
    errors = {r: err(v) for r, v in after.items() if err(v)}
    records = {r: v for r, v in after.items() if isinstance(v, list)}
    for r, recs in records.items():
        for rec in recs:
            if rec.get("error"):
                errors[r] = f"step {rec['step']}: {rec['error']}"
            elif rec.get("persist_error"):
                errors[r] = f"step {rec['step']} was not persisted: {rec['persist_error']}"
    close_errors = {r: err(v) or v for r, v in closed.items() if err(v) or isinstance(v, str)}
    trace = Trace()
    trace.add(records)
    if len(hosts) == ref.world_size:
        want = ref.trace
    else:
        want = h.resized_reference(len(hosts), step0, train_job)["trace"]
    done = all(len(recs) == len(rest) and all(rec.get("committed") for rec in recs) for recs in records.values())
    finished = done and len(records) == len(hosts) and not errors and not close_errors
    checks.append(Check("finished", finished, f"steps {rest[0] if rest else '-'}..{rest[-1] if rest else '-'} "
                        f"trained and committed, close() ok" if finished
                        else short(f"errors {errors or close_errors}", 600)))
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
