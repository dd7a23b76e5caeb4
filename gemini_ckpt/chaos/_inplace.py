"""In-place recovery under faults: a Ray Train job (the demo's FSDP2 loop, one worker per host)
with ``recoverable`` and ``torch_config``, struck while it trains; Ray Train replaces only the
failed workers and the others recover in their own processes.

Each :class:`InPlaceScenario` is checked for:

- the run finished, and its final state equals an uninterrupted run's, bit for bit;
- every rank restored the same version, from the tier the placement planner predicts for the
  hosts lost (memory, for every scenario here), and that version is the newest one committed
  before the fault or one in flight then (never older, never one not saved);
- the workers not struck kept their processes (when the scenario expects them to);
- how long the recovery took (failure -> next step), as a timing, not a verdict.

Run with ``python -m gemini_ckpt chaos --matrix inplace`` (and in ``--matrix full``).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from ._ray_run import detection, fit_on_thread, progress_actor
from ._results import Check, short

STEPS, KILL_AT, PERSIST_EVERY = 16, 7, 5


@dataclass(frozen=True)
class InPlaceScenario:
    """``fault`` (``kill``: SIGKILL, ``stop``: SIGSTOP, ``host``: the host is removed and, with
    ``replace_after_s``, a replacement joins that many seconds later) hits ``ranks`` at once after
    step ``KILL_AT``; ``then``: a second fault during the recovery, ``("kill", rank)`` one second
    after the first, or ``("restore", rank)``: that rank's replacement SIGKILLs itself inside its
    ``restore()``. ``kept``: the workers expected to keep their processes (default: the others)."""

    name: str
    fault: str
    ranks: tuple[int, ...]
    then: Optional[tuple[str, int]] = None
    replace_after_s: float = 0.0
    kept: Optional[tuple[int, ...]] = None
    also_kept: Optional[tuple[int, ...]] = None  # another outcome the check accepts (a race the note names)
    reform_timeout_s: float = 60.0
    note: str = ""

    def describe(self) -> str:
        what = {"kill": "SIGKILL", "stop": "SIGSTOP", "host": "lose the host of"}[self.fault]
        text = f"{what} rank(s) {', '.join(map(str, self.ranks))} after step {KILL_AT}"
        if self.fault == "host":
            text += f", replacement after {self.replace_after_s:.0f}s"
        if self.then is not None:
            text += {
                "kill": f"; SIGKILL rank {self.then[1]} during the reform",
                "restore": f"; rank {self.then[1]}'s replacement dies inside restore()",
            }[self.then[0]]
        return text


SCENARIOS = (
    InPlaceScenario("inplace-kill-rank-0", "kill", (0,), note="the process group's store is not on a worker"),
    InPlaceScenario("inplace-kill-rank-2", "kill", (2,)),
    InPlaceScenario("inplace-kill-two-hosts", "kill", (1, 3), note="two replacements, one reform"),
    InPlaceScenario(
        "inplace-kill-during-reform",
        "kill",
        (2,),
        then=("kill", 3),
        note="a survivor dies while the others wait for the first replacement",
    ),
    InPlaceScenario("inplace-replacement-dies-in-restore", "kill", (1,), then=("restore", 1)),
    InPlaceScenario("inplace-hang", "stop", (2,), note="found by Ray Train's health check after 5 s"),
    InPlaceScenario("inplace-host-lost", "host", (1,)),
    InPlaceScenario(
        "inplace-host-lost-late-replacement",
        "host",
        (1,),
        replace_after_s=25.0,
        kept=(),
        also_kept=(0, 2, 3),
        reform_timeout_s=12.0,
        note="no node for the lost host until after the survivors' wait: they end, and every worker "
        "is replaced once a node joins (or, when the lost host's rank arrived at the next round before "
        "it died, that round fails to form after 20 s, and the survivors wait for the replacement in a "
        "newer one, keeping their processes)",
    ),
)
CI_SCENARIOS = ("inplace-kill-during-reform",)


@dataclass
class InPlaceResult:
    scenario: InPlaceScenario
    checks: list[Check] = field(default_factory=list)
    restored: Optional[int] = None
    recovery_s: Optional[float] = None
    error: Optional[str] = None
    duration_s: float = 0.0

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "ERROR"
        return "PASS" if all(c.ok is not False for c in self.checks) else "MISMATCH"

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "name": s.name,
            "description": s.describe(),
            "note": s.note,
            "verdict": self.verdict,
            "restored": self.restored,
            "recovery_s": self.recovery_s,
            "error": self.error,
            "duration_s": round(self.duration_s, 2),
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def _fit(cluster, workdir: str, *, name: str, scenario: Optional[InPlaceScenario], log) -> tuple:
    """One run; returns (Result or error, events, failure unix time or None, when the struck
    processes were gone or None)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .. import CheckpointConfig
    from ..demo.job import train_loop
    from ..integrations.ray_train import ranks_on_hosts, recoverable, torch_config

    hosts = len(cluster.present())
    progress_name = f"{name}::progress"
    progress = progress_actor(name)
    first = os.path.join(workdir, f"{name}.fault")
    config = {
        "ckpt": CheckpointConfig(replicas=2, keep_in_memory=2, persist_every=PERSIST_EVERY, timeout_s=60.0),
        "steps": STEPS,
        "progress": progress_name,
        "step_sleep": 0.05,
    }
    if scenario is not None and scenario.then is not None and scenario.then[0] == "restore":
        config["kill_in_restore"] = {
            "rank": scenario.then[1],
            "after": first,
            "marker": os.path.join(workdir, f"{name}.restore-kill"),
        }
    reform = scenario.reform_timeout_s if scenario is not None else 60.0
    with detection():
        trainer = TorchTrainer(
            recoverable(train_loop),
            torch_config=torch_config(reform_timeout_s=reform),
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=hosts, label_selector=ranks_on_hosts(hosts)),
            run_config=RunConfig(name=name, storage_path=workdir, failure_config=FailureConfig(max_failures=-1)),
        )
        thread, box = fit_on_thread(trainer, config["ckpt"], name)
        return _watch(cluster, scenario, thread, progress, box, name=name, first=first, log=log)


def _watch(cluster, scenario, thread, progress, box, *, name: str, first: str, log) -> tuple:
    """Strike the run as the scenario says, from the main thread, until it ends."""
    import ray

    events: list[dict] = []
    failure: Optional[float] = None
    settled: Optional[float] = None
    replace_at: Optional[float] = None
    deadline = time.monotonic() + 600
    try:
        while thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the run did not finish within 600s")
            events += ray.get(progress.since.remote(len(events)), timeout=60)
            if (
                scenario is not None
                and failure is None
                and any(e["kind"] == "step" and e["step"] >= KILL_AT for e in events)
            ):
                failure, settled = _strike(cluster, scenario, events, log)
                with open(first, "w") as f:
                    f.write(str(failure))
                if scenario.fault == "host":
                    replace_at = failure + scenario.replace_after_s
                if scenario.then is not None and scenario.then[0] == "kill":
                    time.sleep(1.0)
                    _signal(events, scenario.then[1], signal.SIGKILL, log)
            if replace_at is not None and time.time() >= replace_at:
                for host in scenario.ranks:
                    cluster.add_host(host)
                log(f"   replacement host(s) {list(scenario.ranks)} joined")
                replace_at = None
            time.sleep(0.05)
        thread.join()
        events += ray.get(progress.since.remote(len(events)), timeout=60)
    finally:
        ray.kill(progress)
    return box.get("result", box.get("error")), events, failure, settled


def _strike(cluster, scenario: InPlaceScenario, events: list[dict], log) -> tuple[float, float]:
    """Strike; returns (when it began, when the struck workers were gone). A lost host's workers
    outlive its raylet by a moment, and a step they finish then may still commit."""
    pids = [_pid(events, rank) for rank in scenario.ranks]
    t = time.time()
    if scenario.fault == "host":
        cluster.remove_hosts(scenario.ranks, wait=False)
        log(f"   lost host(s) {list(scenario.ranks)}")
    else:
        for rank in scenario.ranks:
            _signal(events, rank, signal.SIGKILL if scenario.fault == "kill" else signal.SIGSTOP, log)
    if scenario.fault != "stop":
        import psutil

        deadline = time.monotonic() + 10.0
        while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
    return t, time.time()


def _pid(events: list[dict], rank: int) -> int:
    return [e["pid"] for e in events if e["kind"] == "start" and e["rank"] == rank][-1]


def _signal(events: list[dict], rank: int, signum, log) -> None:
    pid = _pid(events, rank)
    log(f"   {signal.Signals(signum).name} rank {rank} (pid {pid})")
    try:
        os.kill(pid, signum)  # the simulated hosts are processes of this machine
    except ProcessLookupError:
        pass


def check(
    scenario: InPlaceScenario,
    outcome,
    events: list[dict],
    failure: float,
    reference: str,
    hosts: int,
    settled: Optional[float] = None,
) -> InPlaceResult:
    import placement

    res = InPlaceResult(scenario)
    finished = outcome is not None and not isinstance(outcome, BaseException)
    res.checks.append(Check("finished", finished, "" if finished else short(repr(outcome))))
    if finished:
        digest = outcome.return_value.get("digest") if isinstance(outcome.return_value, dict) else None
        res.checks.append(
            Check(
                "bit-identical",
                digest == reference,
                f"final state {str(digest)[:12]} vs uninterrupted {reference[:12]}",
            )
        )
    restores = [e for e in events if e["kind"] == "restore" and e["unix"] > failure]
    last = {}
    for e in restores:  # each rank's last restore (a rank that died in its restore tried again)
        last[e["rank"]] = e
    steps = {e["step"] for e in last.values()}
    res.restored = min(steps) if steps else None
    lost = set(scenario.ranks) if scenario.fault == "host" else set()
    predicted = (
        "memory" if placement.survives(placement.make("group", hosts=hosts, replicas=2), failed=lost) else "durable"
    )
    sources = {e["source"] for e in last.values()}
    res.checks.append(
        Check(
            "one version",
            len(last) == hosts and len(steps) == 1,
            f"{len(last)} of {hosts} ranks restored steps {sorted(steps)}",
        )
    )
    res.checks.append(Check("tier as predicted", sources == {predicted}, f"{sorted(sources)}, predicted {predicted}"))
    committed = [e["step"] for e in events if e["kind"] == "commit" and e["unix"] < failure]
    saved = [e["step"] for e in events if e["kind"] == "step" and e["unix"] < max(failure, settled or failure)]
    newest_committed = max(committed, default=-1)
    ok = res.restored is not None and newest_committed <= res.restored <= max(saved, default=-1)
    res.checks.append(
        Check(
            "newest committed",
            ok,
            f"restored {res.restored}; committed before the fault "
            f"{newest_committed}, saved {max(saved, default=-1)} before "
            f"the struck workers were gone",
        )
    )
    before = {e["rank"]: e["pid"] for e in events if e["kind"] == "start" and e["unix"] < failure}
    after = {e["rank"]: e["pid"] for e in events if e["kind"] == "start" and e["unix"] > failure}
    struck = set(scenario.ranks) | ({scenario.then[1]} if scenario.then else set())
    kept = set(range(hosts)) - struck if scenario.kept is None else set(scenario.kept)
    actual = {r for r in range(hosts) if before.get(r) is not None and before.get(r) == after.get(r)}
    also = set(scenario.also_kept) if scenario.also_kept is not None else None
    res.checks.append(
        Check(
            "survivors kept their processes",
            actual == kept or actual == also,
            f"kept {sorted(actual)}, expected {sorted(kept)}" + (f" or {sorted(also)}" if also is not None else ""),
        )
    )
    next_steps = [
        e["unix"] for e in events if e["kind"] == "step" and restores and e["unix"] > max(r["unix"] for r in restores)
    ]
    res.recovery_s = round(min(next_steps) - failure, 2) if next_steps else None
    return res


def run_inplace(scenarios=SCENARIOS, *, cluster=None, log: Optional[Callable[[str], None]] = None) -> list:
    """Run ``scenarios`` (plus one uninterrupted reference run) on ``cluster`` (a running
    :class:`~gemini_ckpt.testing.cluster.LocalCluster`, this process connected) or a new one."""
    from ..testing.cluster import LocalCluster

    log = log or (lambda message: print(message, flush=True))
    own = cluster is None
    if own:
        cluster = LocalCluster(4, head_cpus=0).start()
    workdir = tempfile.mkdtemp(prefix="gemini_chaos_inplace_")
    results = []
    try:
        hosts = len(cluster.present())
        log("== reference: the uninterrupted run")
        outcome, _, _, _ = _fit(cluster, workdir, name=f"ref-{uuid.uuid4().hex[:6]}", scenario=None, log=log)
        if isinstance(outcome, BaseException):
            raise outcome
        reference = outcome.return_value["digest"]
        for scenario in scenarios:
            log(f"== {scenario.name}: {scenario.describe()}")
            cluster.ensure_hosts()
            t0 = time.monotonic()
            name = f"{scenario.name}-{uuid.uuid4().hex[:6]}"
            try:
                outcome, events, failure, settled = _fit(cluster, workdir, name=name, scenario=scenario, log=log)
                res = check(scenario, outcome, events, failure, reference, hosts, settled)
            except Exception as exc:  # noqa: BLE001 - the scenario could not run: say why, go on
                res = InPlaceResult(scenario, error=short(f"{type(exc).__name__}: {exc}"))
            res.duration_s = time.monotonic() - t0
            log(
                f"   {res.verdict}: restored {res.restored}, failure -> next step {res.recovery_s}s"
                + "".join(f"; {c.name}: {c.detail}" for c in res.checks if c.ok is False)
            )
            results.append(res)
    finally:
        if own:
            cluster.shutdown()
    return results


def format_table(results: list) -> str:
    rows = [f"{'scenario':40s} {'verdict':9s} {'restored':>8s} {'recovery':>9s}  detail"]
    for r in results:
        bad = "; ".join(f"{c.name}: {c.detail}" for c in r.checks if c.ok is False) or (r.error or "")
        rec = f"{r.recovery_s:.1f}s" if r.recovery_s is not None else "-"
        rows.append(f"{r.scenario.name:40s} {r.verdict:9s} {str(r.restored):>8s} {rec:>9s}  {bad}")
    return "\n".join(rows)


def write_json(results: list, path: str) -> None:
    """Add the in-place results to the JSON report at ``path`` (``"inplace"``), or write one."""
    import json

    report = {}
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    report["inplace"] = [r.to_json() for r in results]
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
