"""Steady state: what in-place recovery's readiness costs while nothing fails.

    python benchmarks/bench_steady.py [--quick] [--steps 250] [--repeat 2] [--modes inplace,restart,none]

The README demo's job (4 simulated hosts, FSDP2, every step checkpointed to peer memory) without a
failure, in these modes, alternating, each on a fresh local cluster (a mode's warm spares must not
outlive its run into the next one's):

- ``inplace``: the default in-place setup (``gray.torch_config()`` with its warm spares,
  ``gray.warm_runtime_env``, ``gray.recoverable``);
- ``inplace-nospares``: the same with ``torch_config(spares=0)`` (what the spares cost);
- ``restart``: Ray Train's plain restart (no in-place recovery), the same checkpointing;
- ``none``: the same job without checkpointing.

Per run: rank 0's step time median over steps 0-50 and 50-end, the commit and save-stall
medians, and the CPU each kind of process used (cores, from /proc) in both windows. Per mode: the
medians over runs, and the ratios against ``restart``. Output: results/steady.json and a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import RESULTS, machine, table, write_report  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MODES = ("inplace", "inplace-nospares", "restart", "none")
HOSTS = 4
EARLY = 50  # steps 0..EARLY are the early window (the spares' start falls in it)
TICK = os.sysconf("SC_CLK_TCK")
SHORT = {"step_ms_early": "early", "step_ms_late": "late", "commit_ms": "commit", "stall_ms": "stall"}


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (kind of process, CPU seconds so far), for every process on this machine."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(pid)] = (_kind(cmd), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def _kind(cmd: str) -> str:
    if cmd.startswith("ray::"):  # an actor's or an idle worker's title: its class
        return cmd.split()[0].split(".")[0]
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if name in cmd:
            return name
    return "other"


def cores_between(a: dict, b: dict, seconds: float) -> dict[str, float]:
    """CPU cores each kind used between two :func:`cpu_by_process` samples (a process that
    started between them counts from zero; one that ended is lost: short-lived ones undercount)."""
    used: collections.Counter = collections.Counter()
    for pid, (kind, cpu) in b.items():
        before = a.get(pid)
        used[kind] += cpu - (before[1] if before is not None and before[0] == kind else 0.0)
    return {k: round(v / seconds, 3) for k, v in used.most_common() if v / seconds >= 0.005}


class Sampler:
    """Samples every process's CPU time once a second on a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-steady-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), cpu_by_process()))
            if self._stop.wait(1.0):
                return

    def nearest(self, t: float) -> tuple[float, dict]:
        return min(self.samples, key=lambda s: abs(s[0] - t))


def one_run(mode: str, steps: int, workdir: str) -> dict:
    from gemini_ckpt.demo import driver
    from gemini_ckpt.demo.options import DemoOptions

    options = DemoOptions(
        hosts=HOSTS,
        failure=False,
        steps=steps,
        in_place=mode.startswith("inplace"),
        spares=0 if mode == "inplace-nospares" else 1,
        checkpoint=mode != "none",
        out=workdir,
    )
    cluster = driver.start_cluster(HOSTS)
    try:
        with Sampler() as sampler:
            events, _t0, _result = driver._train(options, f"steady-{mode}-{time.time_ns()}", cluster, lambda _: None)
    finally:
        cluster.shutdown()
    steps_ev = sorted((e for e in events if e["kind"] == "step"), key=lambda e: e["unix"])
    gaps = [(b["step"], b["unix"] - a["unix"]) for a, b in zip(steps_ev, steps_ev[1:])]
    early = [g for s, g in gaps if s <= EARLY]
    late = [g for s, g in gaps if s > EARLY]
    commits = [e["latency_s"] for e in events if e["kind"] == "commit"]
    row = {
        "mode": mode,
        "steps": len(steps_ev),
        "step_ms_early": 1e3 * statistics.median(early),
        "step_ms_late": 1e3 * statistics.median(late) if late else None,
        "commit_ms": 1e3 * statistics.median(commits) if commits else None,
        "stall_ms": 1e3 * statistics.median(e["stall_s"] for e in steps_ev) if mode != "none" else None,
    }
    first, mid, last = (
        steps_ev[0]["unix"],
        next(e["unix"] for e in steps_ev if e["step"] >= EARLY),
        steps_ev[-1]["unix"],
    )
    (ta, a), (tb, b), (tc, c) = sampler.nearest(first), sampler.nearest(mid), sampler.nearest(last)
    row["cores_early"] = cores_between(a, b, max(tb - ta, 1e-3))
    row["cores_late"] = cores_between(b, c, max(tc - tb, 1e-3))
    return row


def summarize(rows: list[dict]) -> dict:
    by: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        by[mode] = {
            key: statistics.median(r[key] for r in mine) if all(r[key] is not None for r in mine) else None
            for key in ("step_ms_early", "step_ms_late", "commit_ms", "stall_ms")
        }
        by[mode]["runs"] = len(mine)
    base = by.get("restart")
    if base:
        for mode, m in by.items():
            m["vs_restart"] = {
                key: round(m[key] / base[key], 3)
                for key in ("step_ms_early", "step_ms_late", "commit_ms", "stall_ms")
                if m.get(key) is not None and base.get(key)
            }
    return by


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="120 steps, one run per mode")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--repeat", type=int, default=2, help="runs per mode (alternating)")
    p.add_argument("--modes", default="inplace,restart,inplace-nospares,none")
    p.add_argument("--out", default=str(RESULTS / "steady.json"))
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    steps, repeat = (120, 1) if args.quick else (args.steps, args.repeat)
    if steps <= EARLY + 10:
        p.error(f"--steps must be above {EARLY + 10} (steps 0-{EARLY} are the early window)")
    workdir = tempfile.mkdtemp(prefix="gemini_bench_steady_", dir=os.environ.get("BENCH_DISK_DIR"))
    rows = []
    try:
        for r in range(repeat):
            for mode in modes:
                print(f"== {mode} (run {r + 1} of {repeat}): {steps} steps, {HOSTS} hosts, no failure", flush=True)
                row = one_run(mode, steps, workdir)
                rows.append(row)
                print(
                    f"   step {row['step_ms_early']:.0f} ms (0-{EARLY}), "
                    f"{row['step_ms_late']:.0f} ms ({EARLY}-{steps - 1}); "
                    f"cores {EARLY}-{steps - 1}: {json.dumps(dict(list(row['cores_late'].items())[:5]))}",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    by = summarize(rows)
    result = {"machine": machine(), "hosts": HOSTS, "steps": steps, "early_window": EARLY, "modes": by, "runs": rows}
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        [
            mode,
            m["runs"],
            fmt(m["step_ms_early"]),
            fmt(m["step_ms_late"]),
            fmt(m["commit_ms"]),
            fmt(m["stall_ms"]),
            ", ".join(f"{SHORT[k]} {v:.2f}x" for k, v in m.get("vs_restart", {}).items()),
        ]
        for mode, m in by.items()
    ]
    markdown = table(
        ["mode", "runs", f"step ms 0-{EARLY}", f"step ms {EARLY}-{steps - 1}", "commit ms", "stall ms", "vs restart"],
        lines,
    )
    return write_report(args.out, result, markdown)


if __name__ == "__main__":
    sys.exit(main())
