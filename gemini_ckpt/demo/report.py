"""The demo's report: what the events of one run say about the failure, the restore and
what they cost (:class:`DemoReport`, built by :func:`build_report`), and the step times and
recovery stages it is made of."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Optional

from .options import DemoOptions


@dataclass
class DemoReport:
    options: DemoOptions
    run_dir: str
    seconds: float
    failure_step: Optional[int] = None  # last step finished before the host died
    failure_t: Optional[float] = None
    restored_step: Optional[int] = None
    restored_from: Optional[str] = None
    restore_s: Optional[float] = None
    recovery_s: Optional[float] = None  # failure -> first step after the restore
    bytes_local: int = 0
    bytes_peer: int = 0
    bytes_durable: int = 0
    durable_before_failure: Optional[int] = None
    stalls_s: list = field(default_factory=list)
    commit_s: list = field(default_factory=list)
    persisted: list = field(default_factory=list)
    reported: list = field(default_factory=list)
    ray_checkpoint: Optional[str] = None
    final_loss: Optional[float] = None
    timeline: Optional[str] = None
    final_digest: Optional[str] = None  # of the final model and optimizer state (rank 0)
    stages: list = field(default_factory=list)  # (seconds after the failure, what, whose) in order
    step_s: list = field(default_factory=list)  # rank 0's step times (save included), restarts left out
    after_persist_s: list = field(default_factory=list)  # the step after each persisted version
    kept_processes: Optional[int] = None  # in place: workers that recovered in their own process
    world_after: Optional[int] = None  # the workers the run went on with (an elastic run: fewer)
    grow: Optional[dict] = None  # an elastic run grown back: joined_t, started_t, step, lost, next_t, world

    @property
    def failure_text(self) -> str:
        o = self.options
        return {
            "host": f"host {o.kill_host} killed (raylet and all its processes)",
            "process": f"the training worker of host {o.kill_host} SIGKILLed",
            "hang": f"the training worker of host {o.kill_host} SIGSTOPped (hung)",
        }[o.fault]

    @property
    def steps_lost(self) -> Optional[int]:
        if self.failure_step is None or self.restored_step is None:
            return None
        # The kill is asynchronous: training may finish (and commit) a step or two more first.
        return max(0, self.failure_step - self.restored_step)

    @property
    def steps_lost_durable_only(self) -> Optional[int]:
        if self.failure_step is None:
            return None
        base = -1 if self.durable_before_failure is None else self.durable_before_failure
        return self.failure_step - base

    def format(self) -> str:
        o = self.options
        lines = [
            "",
            "=" * 78,
            "gemini_ckpt demo: report",
            "=" * 78,
            f"setup        {o.hosts} hosts x 1 rank (Ray Train, gloo, FSDP2), replicas={o.replicas}, "
            f"every step to memory, every {o.persist_every}th to {os.path.relpath(self.run_dir)}",
        ]
        if not o.failure:
            lines.append("failure      none (--no-failure)")
        if self.failure_step is not None:
            joined = (
                ("; a replacement host joined" if o.replacement else "; no host took its place")
                if o.fault == "host"
                else ""
            )
            lines.append(
                f"failure      {self.failure_text} after step {self.failure_step} finished, at "
                f"t={self.failure_t:.1f}s{joined}"
            )
            if o.elastic and self.world_after is not None:
                lines.append(
                    f"elastic      went on with {self.world_after} of {o.hosts} workers (ScalingConfig num_workers="
                    f"({o.min_workers}, {o.hosts})), {self.kept_processes} in their own processes, ranks "
                    f"renumbered; every rank restored the version resharded to {self.world_after}"
                )
            elif self.kept_processes is not None:
                lines.append(
                    f"in place     {self.kept_processes} of {o.hosts} workers kept their processes (Ray Train "
                    f"replaced only the failed one); every rank rolled back in its own process"
                    if o.in_place
                    else "full restart (Ray Train restarted every worker)"
                )
        if self.restored_step is not None:
            where = (
                f"local {mb(self.bytes_local)}, peer {mb(self.bytes_peer)}"
                if self.restored_from == "memory"
                else f"{mb(self.bytes_durable)}"
            )
            lines.append(
                f"restored     step {self.restored_step} from {self.restored_from} ({where}, all ranks) "
                f"in {self.restore_s:.2f}s (slowest rank)"
            )
            if self.recovery_s is not None:
                lines.append(
                    f"recovery     {self.recovery_s:.1f}s from the failure to the next step; seconds after it:"
                )
                lines.append(
                    "             " + " > ".join(f"{what} {t:.1f} [{whose}]" for t, what, whose in self.stages)
                )
        if self.grow is not None:
            g = self.grow
            lines.append(
                f"grew back    host {o.kill_host} joined again at t={g['joined_t']:.1f}s; the run grew back to "
                f"{g['world']} workers {g['started_t'] - g['joined_t']:.1f}s later (Ray Train's elastic resize: "
                f"every worker restarted), restored step {g['step']} from {g['source']} ({g['lost']} steps lost), "
                f"next step {g['next_t'] - g['started_t']:.1f}s after the restart"
                if g.get("next_t") is not None
                else f"grew back    host {o.kill_host} joined again at t={g['joined_t']:.1f}s; "
                f"the run did not grow back before it ended"
            )
        if self.steps_lost is not None:
            d = self.durable_before_failure
            redone = (
                f"redone: {self.restored_step + 1}..{self.failure_step}"
                if self.steps_lost
                else "the newest finished step was committed in memory"
            )
            then = f"newest durable version then: step {d}" if d is not None else "none yet: from scratch"
            lines.append(
                f"steps lost   {self.steps_lost} ({redone}); durable-only checkpointing every "
                f"{o.persist_every} steps would have lost {self.steps_lost_durable_only} ({then})"
            )
        elif o.failure:
            lines.append("steps lost   unknown: no restore was recorded")
        if self.stalls_s:
            ms = sorted(1e3 * s for s in self.stalls_s)
            lines.append(
                f"save stall   median {statistics.median(ms):.1f} ms, p95 {_pct(ms, 95):.1f} ms, "
                f"max {ms[-1]:.1f} ms over {len(ms)} saves (rank 0; the copy into staging buffers, "
                f"plus any wait for the previous version)"
            )
        if self.commit_s:
            ms = sorted(1e3 * s for s in self.commit_s)
            lines.append(
                f"commit       median {statistics.median(ms):.0f} ms from save() to every copy acknowledged "
                f"({len(ms)} versions)"
            )
        if self.step_s:
            med = statistics.median(self.step_s)
            text = f"step time    median {1e3 * med:.0f} ms (rank 0, save included)"
            if self.after_persist_s:
                after = statistics.median(self.after_persist_s)
                text += (
                    f"; the step after a persisted version median {1e3 * after:.0f} ms ({after / med:.2f}x, "
                    f"{len(self.after_persist_s)} versions)"
                )
            lines.append(text)
        if self.persisted:
            lines.append(
                f"persisted    steps {', '.join(map(str, sorted(set(self.persisted))))}; "
                f"Ray Train result.checkpoint = {self.ray_checkpoint}"
            )
        if self.final_loss is not None:
            lines.append(f"final loss   {self.final_loss:.3f} (step {o.steps - 1})")
        if self.timeline:
            lines.append(f"timeline     {self.timeline}")
        lines.append(f"run time     {self.seconds:.1f}s")
        return "\n".join(lines)


def mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _pct(sorted_values: list, q: float) -> float:
    i = min(len(sorted_values) - 1, int(round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def build_report(options: DemoOptions, events: list[dict], run_dir: str, t0: float, result) -> DemoReport:
    report = DemoReport(options=options, run_dir=run_dir, seconds=0.0)
    steps = [e for e in events if e["kind"] == "step"]
    failure = next((e for e in events if e["kind"] == "failure"), None)
    persists = [e for e in events if e["kind"] == "persist"]
    report.stalls_s = [e["stall_s"] for e in steps]
    report.commit_s = [e["latency_s"] for e in events if e["kind"] == "commit"]
    report.persisted = [e["step"] for e in persists]
    report.step_s, report.after_persist_s = step_times(steps, {e["step"] for e in persists})
    done = [e for e in events if e["kind"] == "done" and e["rank"] == 0]
    if done:
        report.final_loss = done[-1]["loss"]
        report.reported = done[-1]["reported"]
        report.persisted = sorted(set(report.persisted) | set(report.reported))  # + persist_on_close
    if result is not None and result.checkpoint is not None:
        report.ray_checkpoint = os.path.relpath(result.checkpoint.path)
    if result is not None and isinstance(result.return_value, dict):
        report.final_digest = result.return_value.get("digest")
    if failure is not None:
        report.failure_t = failure["unix"] - t0
        before = [e["step"] for e in steps if e["unix"] <= failure["unix"] and e["attempt"] == 0]
        report.failure_step = max(before) if before else None
        durable = [e["step"] for e in persists if e["unix"] <= failure["unix"]]
        report.durable_before_failure = max(durable) if durable else None
        restores = [e for e in events if e["kind"] == "restore" and e["unix"] > failure["unix"]]
        later = [e for e in restores if e["attempt"] != restores[0]["attempt"]] if restores else []
        restores = [e for e in restores if e["attempt"] == restores[0]["attempt"]]  # this failure's recovery
        if restores:
            report.world_after = restores[0].get("world")
            report.restored_step = restores[0]["step"]
            report.restored_from = restores[0]["source"]
            report.restore_s = max(e["seconds"] for e in restores)
            report.bytes_local = sum(e["bytes_local"] for e in restores)
            report.bytes_peer = sum(e["bytes_peer"] for e in restores)
            report.bytes_durable = sum(e["bytes_durable"] for e in restores)
            after = [e["unix"] for e in steps if e["unix"] > max(r["unix"] for r in restores)]
            if after:
                report.recovery_s = min(after) - failure["unix"]
            done_at = max(r["unix"] for r in restores)
            this = [e for e in events if e["unix"] <= done_at]  # a later recovery's (a grow's) come after
            report.stages = recovery_stages(failure["unix"], this, restores, min(after) if after else None)
        # Each rank's process after the failure, from its restore (every recovery ends in one) or
        # its start: one lost progress event must not miscount the workers kept.
        first_pids = {e["rank"]: e["pid"] for e in events if e["kind"] == "start" and e["unix"] < failure["unix"]}
        after_pids = {e["rank"]: e["pid"] for e in restores if "pid" in e}  # every rank restores
        if not after_pids:
            after_pids = {
                e["rank"]: e["pid"]
                for e in events
                if e["kind"] == "start" and e["unix"] > failure["unix"] and "pid" in e
            }
        report.kept_processes = sum(1 for rank, pid in after_pids.items() if first_pids.get(rank) == pid)
        if options.elastic:  # the ranks were renumbered: processes, not ranks
            report.kept_processes = len(set(first_pids.values()) & set(after_pids.values()))
        joined = next((e for e in events if e["kind"] == "host_joined"), None)
        if joined is not None:
            report.grow = grown(joined, later, steps, t0)
    return report


def grown(joined: dict, later: list[dict], steps: list[dict], t0: float) -> dict:
    """An elastic run's growth back once the lost host joined again: when, from which step."""
    out = {"joined_t": joined["unix"] - t0}
    back = [e for e in later if e["unix"] > joined["unix"] and e.get("world", 0) > 0]
    if not back:
        return out
    attempt = back[0]["attempt"]
    back = [e for e in back if e["attempt"] == attempt]
    before = [e["step"] for e in steps if e["attempt"] < attempt]
    starts = [e["unix"] for e in steps if e["attempt"] == attempt]
    return {
        **out,
        "world": back[0]["world"],
        "step": back[0]["step"],
        "source": back[0]["source"],
        "lost": max(0, max(before, default=-1) - back[0]["step"]),
        "started_t": min(e["t_start"] for e in back) - t0,
        "next_t": min(starts) - t0 if starts else None,
    }


def step_times(steps: list[dict], persisted: set) -> tuple[list[float], list[float]]:
    """Rank 0's step times from its step events (the time between two consecutive steps of one
    attempt: compute and ``save()``), and those of the step right after each persisted version
    (when the persist and the report to Ray Train run in the background)."""
    by_step = {}
    for e in steps:
        if e.get("rank", 0) == 0:
            by_step[(e["attempt"], e["step"])] = e["unix"]
    times, after = [], []
    for (attempt, step), unix in sorted(by_step.items()):
        prev = by_step.get((attempt, step - 1))
        if prev is None:
            continue
        times.append(unix - prev)
        if step - 1 in persisted:
            after.append(unix - prev)
    return times, after


def recovery_stages(
    failure_unix: float, events: list[dict], restores: list[dict], next_step_unix: Optional[float]
) -> list[tuple[float, str, str]]:
    """The stages of one recovery, as ``(seconds after the failure, stage, whose)``: the library's
    (``gemini``: the host stores noticed the loss, made the copies again, seeded the replacement;
    the restore), Ray's (the node declared dead) and Ray Train's (its new workers in the training
    function); the slowest rank's times where ranks differ."""
    out: list[tuple[float, str, str]] = []
    recovery = next((r["recovery"][-1] for r in restores if r.get("recovery")), None)
    if recovery:
        for key, what, whose in (
            ("noticed", "stores noticed", "gemini"),
            ("node_dead", "node dead", "Ray"),
            ("rereplicated", "copies made again", "gemini"),
            ("replacement_joined", "replacement joined", "cluster"),
            ("replacement_seeded", "replacement seeded", "gemini"),
        ):
            if recovery.get(key):
                out.append((recovery[key] - failure_unix, what, whose))
    starts = [e for e in events if e["kind"] == "start" and e["unix"] > failure_unix]
    in_place = [e["in_place"] for e in starts if e.get("in_place")]
    survivors = [dict(i["stages"]) for i in in_place if i.get("recoveries")]
    if survivors:  # in place: who noticed, the replacement's start, the process group formed again
        out.append((min(s["noticed"] for s in survivors) - failure_unix, "survivors noticed", "gemini"))
        # the newcomers: started after the failure, as new processes or in a warm spare started before it
        new = [e for e in starts if e.get("in_place") and not e["in_place"].get("recoveries")]
        fresh = [e for e in new if e.get("process_t", 0) > failure_unix]
        if fresh:
            out.append((max(e["process_t"] for e in fresh) - failure_unix, "replacement process", "Ray Train"))
        if new:
            out.append(
                (
                    max(e["in_place"]["entered"] for e in new) - failure_unix,
                    "replacement in train fn" + ("" if len(fresh) == len(new) else " (warm spare)"),
                    "Ray Train",
                )
            )
        formed = [dict(i["stages"]).get("formed") for i in in_place]
        if all(formed):
            out.append((max(formed) - failure_unix, "group formed", "gemini"))
    elif starts:
        out.append((max(e["unix"] for e in starts) - failure_unix, "workers started", "Ray Train"))
    timelines = [dict(r["timeline"]) for r in restores if r.get("timeline")]
    if timelines:
        out.append((max(t["called"] for t in timelines) - failure_unix, "restore called", "user code"))
        out.append((max(t["connected"] for t in timelines) - failure_unix, "connected", "gemini"))
        out.append((max(t["done"] for t in timelines) - failure_unix, "restored", "gemini"))
    if next_step_unix is not None:
        out.append((next_step_unix - failure_unix, "next step done", "user code"))
    return sorted(out)
