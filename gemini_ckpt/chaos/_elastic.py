"""Elastic runs under faults: the demo's FSDP2 loop on Ray Train with ``ScalingConfig(num_workers=
(min, hosts))``, one rank per host on any host (no pinning), ``recoverable`` and ``torch_config``;
hosts are lost with no node to take their place, come back, or are lost again during a resize.

Each :class:`ElasticScenario` is checked for:

- the run finished at the world size expected (or, below ``min_workers``, ended with the
  library's error naming it, after the bounded wait);
- every resize restored one version on every rank, from the tier the placement planner predicts
  (memory while a copy of every shard lives; the durable tier with ``replicas=1``), the newest
  committed before the fault (never older);
- the whole model and optimizer state each rank holds after every resize equals the version's as
  it was saved (at the other world size), bit for bit;
- at a shrink, the survivors kept their processes;
- how long the shrink took (failure -> next step), as a timing, not a verdict.

Run with ``python -m gemini_ckpt chaos --matrix elastic`` (and in ``--matrix full``).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import RecoveryGaveUpError
from ._inplace import InPlaceResult
from ._ray_run import detection, fit_on_thread, progress_actor
from ._results import Check, short

STEPS, KILL_AT, PERSIST_EVERY = 70, 7, 5
RETURN_AFTER_S = 3.0


@dataclass(frozen=True)
class ElasticScenario:
    """Host ``hosts[0]`` (and the others of ``hosts`` at once) is lost after step ``KILL_AT`` with
    no node to take its place; ``returns``: it joins again ``RETURN_AFTER_S`` later; ``then``:
    ``("shrunk", h)`` lose host ``h`` once the run went on without the first, ``("growing", h)``
    lose host ``h`` as the run grows back. ``world``: the workers the run ends with (None: it
    gives up, below ``min_workers``)."""

    name: str
    hosts: tuple[int, ...]
    world: Optional[int]
    min_workers: int = 2
    returns: bool = False
    then: Optional[tuple[str, int]] = None
    replicas: int = 2
    note: str = ""

    @property
    def fault(self) -> str:  # what InPlaceResult's report reads
        return "host"

    def describe(self) -> str:
        text = f"lose host(s) {', '.join(map(str, self.hosts))} after step {KILL_AT}, no replacement"
        if self.returns:
            text += f", back after {RETURN_AFTER_S:.0f}s"
        if self.then is not None:
            text += {"shrunk": "; lose host {} after the shrink", "growing": "; lose host {} as the run grows back"}[
                self.then[0]
            ].format(self.then[1])
        text += f" (min_workers={self.min_workers}, replicas={self.replicas})"
        return text


SCENARIOS = (
    ElasticScenario("elastic-shrink", (1,), world=3),
    ElasticScenario("elastic-shrink-twice-to-min", (1,), world=2, then=("shrunk", 2)),
    ElasticScenario("elastic-grow-back", (1,), world=4, returns=True),
    ElasticScenario("elastic-loss-during-grow", (1,), world=3, returns=True, then=("growing", 3)),
    ElasticScenario(
        "elastic-below-min", (1, 2), world=None, min_workers=3, note="waits reform_timeout_s, then ends the run"
    ),
    ElasticScenario(
        "elastic-only-copy-lost", (1,), world=3, replicas=1, note="the lost host held the only copy: the durable tier"
    ),
)
REFORM_S = 12.0


def _fit(cluster, workdir: str, *, name: str, scenario: ElasticScenario, log) -> tuple:
    """One run; returns (Result or error, events, failure unix time)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .. import CheckpointConfig
    from ..demo.job import train_loop
    from ..integrations.ray_train import recoverable, torch_config

    hosts = len(cluster.present())
    progress_name = f"{name}::progress"
    progress = progress_actor(name)
    config = {
        "ckpt": CheckpointConfig(
            replicas=scenario.replicas, keep_in_memory=2, persist_every=PERSIST_EVERY, timeout_s=60.0
        ),
        "steps": STEPS,
        "progress": progress_name,
        "step_sleep": 0.05,
        "full_digests": True,
    }
    with detection():
        trainer = TorchTrainer(
            recoverable(train_loop),
            torch_config=torch_config(reform_timeout_s=REFORM_S, replace_within_s=1.0),
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=(scenario.min_workers, hosts),
                placement_strategy="STRICT_SPREAD",
                elastic_resize_monitor_interval_s=3.0,
            ),
            run_config=RunConfig(name=name, storage_path=workdir, failure_config=FailureConfig(max_failures=-1)),
        )
        thread, box = fit_on_thread(trainer, config["ckpt"], name)
        return _watch(cluster, scenario, thread, progress, box, name=name, log=log)


def _watch(cluster, scenario: ElasticScenario, thread, progress, box, *, name: str, log) -> tuple:
    """Strike the run as the scenario says, from the main thread (the only one that may add and
    remove hosts), until it ends."""
    import ray

    events: list[dict] = []
    failure: Optional[float] = None
    returns_at: Optional[float] = None
    then_done = scenario.then is None
    deadline = time.monotonic() + 600
    try:
        while thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the run did not finish within 600s")
            events += ray.get(progress.since.remote(len(events)), timeout=60)
            if failure is None and any(e["kind"] == "step" and e["step"] >= KILL_AT for e in events):
                failure = time.time()
                cluster.remove_hosts(scenario.hosts, wait=False)
                log(f"   lost host(s) {list(scenario.hosts)}")
                if scenario.returns:
                    returns_at = failure + RETURN_AFTER_S
            if returns_at is not None and time.time() >= returns_at:
                for host in scenario.hosts:
                    cluster.add_host(host)
                log(f"   host(s) {list(scenario.hosts)} joined again")
                returns_at = None
            if not then_done and failure is not None and _then_due(scenario, events, failure):
                cluster.remove_hosts((scenario.then[1],), wait=False)
                log(f"   lost host {scenario.then[1]} ({scenario.then[0]})")
                then_done = True
            time.sleep(0.05)
        thread.join()
        events += ray.get(progress.since.remote(len(events)), timeout=60)
    finally:
        ray.kill(progress)
    return box.get("result", box.get("error")), events, failure


def _then_due(scenario: ElasticScenario, events: list[dict], failure: float) -> bool:
    after = [e for e in events if e["unix"] > failure]
    if scenario.then[0] == "shrunk":  # two steps done by the smaller group
        restored = [e for e in after if e["kind"] == "restore"]
        return bool(restored) and sum(1 for e in after if e["kind"] == "step" and e["unix"] > restored[0]["unix"]) >= 2
    # growing: the grown group's workers are starting (a world larger than the shrunk one's)
    worlds = [e["world"] for e in after if e["kind"] == "start" and "world" in e]
    return len(set(worlds)) > 1 and worlds[-1] == max(worlds)


def check(scenario: ElasticScenario, outcome, events: list[dict], failure: Optional[float]) -> InPlaceResult:
    res = InPlaceResult(scenario)  # type: ignore[arg-type] - the same report for both kinds
    if failure is None:
        res.error = "the fault was never injected"
        return res
    gave_up = isinstance(outcome, BaseException)
    if scenario.world is None:
        # Ray Train wraps the controller's own failure (ControllerError.controller_failure)
        cause = getattr(outcome, "controller_failure", outcome)
        ok = isinstance(cause, RecoveryGaveUpError) and "min_workers" in str(cause)
        res.checks.append(Check("ended below min_workers", ok, short(f"{type(cause).__name__}: {cause}")))
        return res
    res.checks.append(Check("finished", not gave_up, short(repr(outcome)) if gave_up else ""))
    restores = sorted((e for e in events if e["kind"] == "restore" and e["unix"] > failure), key=lambda e: e["unix"])
    recoveries: list[list[dict]] = []
    for e in restores:  # each recovery: every rank's restore of one version at one world size, once
        last = recoveries[-1] if recoveries else None
        if (
            last is not None
            and (last[0]["world"], last[0]["step"]) == (e["world"], e["step"])
            and e["rank"] not in {x["rank"] for x in last}
        ):
            last.append(e)
        else:
            recoveries.append([e])
    last_world = recoveries[-1][0]["world"] if recoveries else None
    res.checks.append(
        Check("world size", last_world == scenario.world, f"ended at {last_world}, expected {scenario.world}")
    )
    saved = {(e["step"], e["world"]): e["digest"] for e in events if e["kind"] == "saved_full"}
    whole = {(e["step"], e["world"]): e["digest"] for e in events if e["kind"] == "restored_full"}
    durable_expected = scenario.replicas == 1
    for i, rec in enumerate(recoveries):
        step, world = rec[0]["step"], rec[0]["world"]
        sources = {e["source"] for e in rec}
        tier = "durable" if durable_expected and i == 0 else "memory"
        res.checks.append(
            Check(
                f"resize {i + 1}: one version, from {tier}",
                len(rec) == world and sources == {tier},
                f"{len(rec)} of {world} ranks restored step {step} from {sorted(sources)}",
            )
        )
        matches = [w for (s, w), d in saved.items() if s == step and d == whole.get((step, world))]
        res.checks.append(
            Check(
                f"resize {i + 1}: state equals the version's",
                bool(matches),
                f"step {step} at {world} ranks: the whole state restored "
                f"{'equals' if matches else 'differs from'} the one saved",
            )
        )
    if recoveries and not durable_expected:
        committed = [e["step"] for e in events if e["kind"] == "commit" and e["unix"] < failure]
        first = recoveries[0][0]["step"]
        res.restored = first
        res.checks.append(
            Check(
                "newest committed",
                first >= max(committed, default=-1),
                f"restored {first}, committed {max(committed, default=-1)}",
            )
        )
        before = {e["pid"] for e in events if e["kind"] == "start" and e["unix"] < failure}
        kept = {e["pid"] for e in recoveries[0]} & before
        res.checks.append(
            Check("survivors kept their processes", len(kept) == recoveries[0][0]["world"], f"{len(kept)} kept")
        )
        after = [e["unix"] for e in events if e["kind"] == "step" and e["unix"] > max(r["unix"] for r in recoveries[0])]
        res.recovery_s = round(min(after) - failure, 2) if after else None
    elif recoveries:
        res.restored = recoveries[0][0]["step"]
    return res


def run_elastic(scenarios=SCENARIOS, *, cluster=None, log: Optional[Callable[[str], None]] = None) -> list:
    """Run ``scenarios`` on ``cluster`` (a running :class:`~gemini_ckpt.testing.cluster.LocalCluster`
    of 4 hosts, this process connected) or a new one."""
    from ..testing.cluster import LocalCluster

    log = log or (lambda message: print(message, flush=True))
    own = cluster is None
    if own:
        cluster = LocalCluster(4, head_cpus=0).start()
    workdir = tempfile.mkdtemp(prefix="gemini_chaos_elastic_")
    results = []
    try:
        for scenario in scenarios:
            log(f"== {scenario.name}: {scenario.describe()}")
            cluster.ensure_hosts()
            t0 = time.monotonic()
            name = f"{scenario.name}-{uuid.uuid4().hex[:6]}"
            try:
                outcome, events, failure = _fit(cluster, workdir, name=name, scenario=scenario, log=log)
                res = check(scenario, outcome, events, failure)
            except Exception as exc:  # noqa: BLE001 - the scenario could not run: say why, go on
                res = InPlaceResult(scenario, error=short(f"{type(exc).__name__}: {exc}"))  # type: ignore[arg-type]
            res.duration_s = time.monotonic() - t0
            log(
                f"   {res.verdict}: restored {res.restored}, failure -> next step {res.recovery_s}s"
                + "".join(f"; {c.name}: {c.detail}" for c in res.checks if c.ok is False)
            )
            results.append(res)
    finally:
        if own:
            cluster.shutdown()
        else:
            cluster.ensure_hosts()
    return results
