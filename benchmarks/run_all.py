"""Run every benchmark, collect the JSON results, write ``results/summary.md`` and PNG plots.

Each bench script runs as its own subprocess (``python benchmarks/bench_X.py [--quick]``) with a
timeout; a failed or timed-out one is reported in the summary and the others still run. A script
past its timeout gets Ctrl-C first (its traceback, where it waited, and its clean-up) and the
last lines of a failed or timed-out script's log (``results/[quick/]NAME.log``) are printed. The
load average before and after each script is recorded in its JSON (``run_all`` key), since the
development machine's 2 cores are shared.

Usage (from the repository root)::

    python -m benchmarks --quick          # a few minutes on 2 cores; writes results/quick/
    python -m benchmarks                  # full sizes (~1 GB states; tens of minutes)
    python -m benchmarks --only restore persist
    python -m benchmarks --quick --only scaling
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FULL_RESULTS = HERE / "results"
RESULTS = FULL_RESULTS  # --quick: results/quick/, so quick runs never overwrite full-size results

# Scripts without a --quick flag get these arguments instead.
QUICK_ARGS = {"gpu_staging": ["--gb", "0.25", "--repeats", "2"]}

# lines of a failed or timed-out script's log printed on the console
LOG_TAIL_LINES = 60
# seconds a timed-out script gets after Ctrl-C to clean up (clusters, namespaces) before it is killed
INTERRUPT_GRACE_S = 60

# name, script, result file, timeout (s) quick, timeout (s) full
BENCHES = [
    ("save", "bench_save.py", "save.json", 300, 1800),
    ("replicate", "bench_replicate.py", "replicate.json", 400, 3600),
    ("restore", "bench_restore.py", "restore.json", 400, 3600),
    ("persist", "bench_persist.py", "persist.json", 400, 3600),
    ("overhead", "bench_overhead.py", "overhead.json", 400, 3600),
    ("scaling", "bench_scaling.py", "scaling.json", 400, 3600),
    ("health", "bench_health.py", "health.json", 300, 1800),
    ("metrics", "bench_metrics.py", "metrics.json", 300, 1800),
    ("recovery", "bench_recovery.py", "recovery.json", 900, 3600),
    ("steady", "bench_steady.py", "steady.json", 900, 3600),
    ("commit_sim", "bench_commit_sim.py", "commit_sim.json", 300, 900),
    ("soak", "bench_soak.py", "soak.json", 600, 3600),
    ("peers", "bench_peers.py", "peers.json", 600, 3600),  # needs the [peers] extra; says so and exits 0 without it
    ("interference", "bench_interference.py", "interference.json", 600, 3600),  # needs root (netns); says so without
    ("gpu_staging", "bench_gpu_staging.py", "gpu_staging.json", 120, 1800),
]


def run_one(name: str, script: str, out: str, timeout: int, quick: bool) -> dict:
    cmd = [sys.executable, str(HERE / script)] + (QUICK_ARGS.get(name, ["--quick"]) if quick else [])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "BENCH_RESULTS_DIR": str(RESULTS)}
    before = list(os.getloadavg())
    path = RESULTS / out
    mtime = path.stat().st_mtime if path.exists() else None
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])} (timeout {timeout}s, load {before[0]:.1f})", flush=True)
    log = RESULTS / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            rc, status = None, f"timed out after {timeout}s"
            # Ctrl-C: its traceback (where it waited) goes to the log and its clean-up runs
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:  # the log's tail on the console: a CI log then says where a script failed or hung
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(f"   | {line}" for line in tail), flush=True)
    fresh = path.exists() and path.stat().st_mtime != mtime
    if rc == 0 and not fresh:
        status = "ok but wrote no new result"
    info = {
        "status": status,
        "wall_s": wall,
        "quick": quick,
        "load_average_before": before,
        "load_average_after": list(os.getloadavg()),
        "log": str(log.relative_to(HERE.parent)),
    }
    data = None
    if fresh:
        data = json.loads(path.read_text())
        data["run_all"] = info
        path.write_text(json.dumps(data, indent=2))
    print(f"   {status} in {wall:.0f}s", flush=True)
    return {"name": name, "info": info, "data": data}


# --- summary -----------------------------------------------------------------------------------
def _f(v, unit="s") -> str:
    if v is None:
        return "-"
    return f"{v:.3f} {unit}".strip()


def summary_rows(res: dict) -> list[list[str]]:
    """One row per question: question, our number, baseline, ratio, target, met?"""
    rows = []
    d = res.get("save")
    if d:
        s = d["seconds"]
        ours, floor = s.get("gemini_ckpt save() stall"), s.get("floor: memcpy into preallocated buffers")
        rows.append(
            [
                "save() stall (single process)",
                _f(ours),
                f"memcpy floor {_f(floor)}",
                f"{ours / floor:.2f}x floor",
                f"<= {d.get('target_ratio', 1.3)}x floor",
                _met(d.get("target_met")),
            ]
        )
        dcp_async = s.get("dcp.async_save (blocking part)")
        if dcp_async:
            rows.append(
                [
                    "save() stall vs dcp.async_save blocking part",
                    _f(ours),
                    _f(dcp_async),
                    f"{dcp_async / ours:.1f}x less",
                    "-",
                    "-",
                ]
            )
    d = res.get("replicate")
    if d:
        dcp = next((r for r in d["rows"] if r["method"].startswith("DCP")), None)
        for r in d["rows"]:
            if "put_s" in r and dcp:
                rows.append(
                    [
                        f"time to safe (save -> committed in peer memory), {r['method']}",
                        _f(r["commit_s"]),
                        f"dcp.async_save done {_f(dcp['commit_s'])}",
                        f"{dcp['commit_s'] / r['commit_s']:.2f}x",
                        ">= 1.0x",
                        _met(dcp["commit_s"] >= r["commit_s"]),
                    ]
                )
                floor = next((f for f in d["rows"] if "floor_s" in f and f["replicas"] == r["replicas"]), None)
                if floor:
                    ratio = r["commit_s"] / floor["floor_s"]
                    rows.append(
                        [
                            f"time to safe vs the raw TCP floor, {r['method']}",
                            _f(r["commit_s"]),
                            f"same bytes over raw TCP {_f(floor['floor_s'])}",
                            f"{ratio:.2f}x floor",
                            "<= 1.5x floor",
                            _met(ratio <= 1.5),
                        ]
                    )
        cap = d.get("cap")
        if cap:
            capped = next(k for k in cap if k.startswith("capped"))
            rows.append(
                [
                    f"step time, every step saved: uncapped / {capped}",
                    f"{_f(cap['uncapped'])} / {_f(cap[capped])}",
                    f"no checkpoint {_f(cap['no checkpoint'])}",
                    f"{cap['uncapped'] / cap['no checkpoint']:.2f}x / {cap[capped] / cap['no checkpoint']:.2f}x",
                    "-",
                    "-",
                ]
            )
    d = res.get("restore")
    if d:
        by = {r["method"]: r["seconds"] for r in d["rows"]}
        base = by[d["baseline"]]
        warm = by.get("stock dcp.load, local disk, page cache warm")
        for m, s in by.items():
            if m.startswith("gemini_ckpt"):
                peer, local = "peer memory" in m, "local memory" in m
                if local and warm:
                    rows.append(
                        [
                            f"restore: {m[len('gemini_ckpt: ') :]}",
                            _f(s),
                            f"dcp.load, page cache warm {_f(warm)}",
                            f"{warm / s:.2f}x speedup",
                            f">= {d.get('local_target', 2.0):.0f}x",
                            _met(d.get("local_target_met")),
                        ]
                    )
                    continue
                rows.append(
                    [
                        f"restore: {m[len('gemini_ckpt: ') :]}",
                        _f(s),
                        f"{d['baseline'][len('stock ') :]} {_f(base)}",
                        f"{base / s:.2f}x speedup",
                        f">= {d['target_speedup']:g}x" if peer else "-",
                        _met(d["target_met"]) if peer else "-",
                    ]
                )
    d = res.get("persist")
    if d:
        p = d["persist"]
        rows.append(
            [
                "persist throughput (host stores, parallel)",
                f"{p['gbps']:.2f} GB/s",
                f"dcp.save one process {d['dcp_save_single_process']['gbps']:.2f} GB/s",
                f"{d['speedup_vs_single_process_dcp_save']:.2f}x",
                "-",
                "-",
            ]
        )
        st = d["stall"]
        rows.append(
            [
                "save() stall: persisting step vs memory-only step",
                _f(st["persisting_step_s"]),
                f"memory-only {_f(st['memory_only_s'])}",
                f"{st['persisting_step_s'] / st['memory_only_s']:.2f}x",
                "-",
                "-",
            ]
        )
        rows.append(
            [
                "save() stall: next step while persisting",
                _f(st["next_step_during_persist_s"]),
                f"memory-only {_f(st['memory_only_s'])}",
                f"{st['next_step_during_persist_s'] / st['memory_only_s']:.2f}x",
                "-",
                "-",
            ]
        )
    d = res.get("overhead")
    if d:
        t = d.get("targets", {})
        rows.append(
            [
                "training throughput, checkpoint every step / never, every core training",
                f"{d['ratio']:.3f}",
                "1.000",
                f"{d['ratio']:.3f}",
                f">= {t.get('all_cores', 0.85)}",
                _met(d["ratio"] >= t.get("all_cores", 0.85)),
            ]
        )
        if "ratio_one_core_free" in d:
            rows.append(
                [
                    "same, one core left free",
                    f"{d['ratio_one_core_free']:.3f}",
                    "1.000",
                    f"{d['ratio_one_core_free']:.3f}",
                    f">= {t.get('one_core_free', 0.97)}",
                    _met(d["ratio_one_core_free"] >= t.get("one_core_free", 0.97)),
                ]
            )
        if "trainer_cpu_outside_copy_s" in d:
            rows.append(
                [
                    "training process CPU per version outside the staging copy",
                    f"{d['trainer_cpu_outside_copy_s'] * 1e3:.2f} ms",
                    "-",
                    "-",
                    "< 5 ms",
                    _met(d["trainer_cpu_outside_copy_s"] < 0.005),
                ]
            )
    d = res.get("scaling")
    if d and d.get("slope_s_per_host") is not None:
        by = {r["hosts"]: r for r in d["rows"]}
        lo, hi = by[min(by)], by[max(by)]
        rows.append(
            [
                f"time to safe vs hosts ({min(by)}->{max(by)}, {lo['shard_bytes'] / 1e6:.0f} MB per host), slope",
                f"{d['slope_s_per_host'] * 1e3:+.1f} ms/host",
                f"t({min(by)}) {_f(lo['time_to_safe_s'])}, t({max(by)}) {_f(hi['time_to_safe_s'])}",
                f"{d['ratio_label']} = {d['ratio_largest_to_smallest']:.2f}",
                "flat (1.00)",
                "-",
            ]
        )
    if d:
        r = max(d["rows"], key=lambda row: row["hosts"])
        peak, pred = r["measured_store_bytes"]["peak_anon_growth_bytes"], r["predicted_store_bytes"]
        rows.append(
            [
                f"host-store memory peak ({r['hosts']} hosts, K={d['keep_in_memory']}, m={d['replicas']})",
                f"{peak / 1e6:.1f} MB",
                f"K·m·shard {pred['K*m*shard'] / 1e6:.1f} MB, (K+1)·m·shard {pred['(K+1)*m*shard'] / 1e6:.1f} MB",
                f"{peak / pred['K*m*shard']:.2f}x K·m·shard, {peak / pred['(K+1)*m*shard']:.2f}x (K+1)·m·shard",
                "-",
                "-",
            ]
        )
    d = res.get("health")
    if d:
        med, r = d["median_s"], d["ratio_on_off"]
        for what, k in (("save() stall", "stall"), ("time to safe", "safe")):
            rows.append(
                [
                    f"{what} with the default health check ({d['staged_bytes'] / 2**30:.2f} GiB)",
                    _f(med["on"][k]),
                    f"check off {_f(med['off'][k])}",
                    f"{r[k]:.3f}x",
                    f"<= {d['target_ratio']}x",
                    _met(r[k] <= d["target_ratio"]),
                ]
            )
    d = res.get("soak")
    if d:
        rows.append(
            [
                f"host-store private memory over the last half of {d['versions']:,} versions, every step",
                f"{100 * d['worst_growth']:+.2f}%",
                "flat",
                "-",
                f"within {100 * d['target_growth']:.0f}%",
                _met(d["target_met"]),
            ]
        )
    d = res.get("recovery")
    if d:
        rows.append(
            [
                f"time wasted per failure, durable-only / gemini_ckpt ({d['state_mb_per_rank']} MB per rank)",
                f"{next(r['wasted_s'] for r in d['rows'] if r['mode'] == 'gemini'):.2f} s",
                f"durable only {next(r['wasted_s'] for r in d['rows'] if r['mode'] == 'durable'):.2f} s",
                f"{d['ratio_without_restart']:.1f}x (incl. restart {d['ratio_with_restart']:.2f}x)",
                f">= {d['target_ratio']:.0f}x",
                _met(d["target_met"]),
            ]
        )
        if d.get("library_adds_to_the_restart_s") is not None:
            rows.append(
                [
                    "failure -> next step: gemini_ckpt vs no checkpointing",
                    _f(d["restart_to_first_step_with_library_s"]),
                    f"no checkpointing {_f(d['restart_to_first_step_without_checkpointing_s'])}",
                    f"{d['library_adds_to_the_restart_s']:+.1f} s",
                    "-",
                    "-",
                ]
            )
    d = res.get("interference")
    if d and "skipped" in d:
        rows.append(["shaped links (netns)", "skipped", d["skipped"], "-", "-", "-"])
    elif d:
        s = d["safe"]
        rows.append(
            [
                f"time to safe on {d['link']} links ({s['shard_bytes'] / 2**20:.0f} MiB per host, replicas=2)",
                _f(s["save_to_committed_s"]),
                f"link floor {_f(s['link_floor_s'])}, raw TCP {_f(s['raw_tcp_s'])}",
                f"{s['vs_floor']:.2f}x floor",
                "<= 1.5x floor",
                _met(s["vs_floor"] <= 1.5),
            ]
        )
        for kind, device_ms in dict.fromkeys((r["kind"], r.get("device_ms", 0)) for r in d["interference"]):
            by = {r["config"]: r for r in d["interference"] if (r["kind"], r.get("device_ms", 0)) == (kind, device_ms)}
            unc = by.get("every step, uncapped")
            inter = by.get("every step, interleaved")
            if unc and inter:
                # the target applies where uncapped replication visibly slows training (>= 15%)
                vs_floor = inter.get("safe_vs_floor")
                met = (
                    None
                    if unc["p50_overhead"] < 0.15
                    else inter["p50_overhead"] <= 0.03
                    and inter["p95_overhead"] <= 0.10
                    and vs_floor is not None
                    and vs_floor <= 1.5
                )
                workload = f"emulated accelerator {device_ms:.0f} ms" if device_ms else "CPU-computed"
                links = " links honouring priority (qos)" if d.get("qos") else ""
                rows.append(
                    [
                        f"{kind} ({workload}) step time cost of every-step checkpointing on {d['link']}{links}: "
                        f"interleaved / uncapped",
                        f"p50 {inter['p50_overhead']:+.1%}, p95 {inter['p95_overhead']:+.1%}",
                        f"uncapped p50 {unc['p50_overhead']:+.1%}",
                        "-" if vs_floor is None else f"time to safe {vs_floor:.2f}x floor",
                        "<= 3% p50, <= 10% p95, <= 1.5x floor (where uncapped >= 15%)",
                        "n/a (uncapped < 15%)" if met is None else _met(met),
                    ]
                )
            net = next((r for c, r in by.items() if c.startswith("every step, interleaved by the network")), None)
            if unc and net:
                vs_floor = net.get("safe_vs_floor")
                rows.append(
                    [
                        f"{kind}: the same, interleaved by the network (CS1 marked, no gate; links "
                        f"{'honouring priority' if d.get('qos') else 'one FIFO'})",
                        f"p50 {net['p50_overhead']:+.1%}, p95 {net['p95_overhead']:+.1%}",
                        f"uncapped p50 {unc['p50_overhead']:+.1%}",
                        "-" if vs_floor is None else f"time to safe {vs_floor:.2f}x floor",
                        "-",
                        "-",
                    ]
                )
    d = res.get("gpu_staging")
    if d:
        if "skipped" in d:
            rows.append(["GPU staging", "skipped", d["skipped"], "-", "-", "-"])
        else:
            rows.append(["GPU staging", json.dumps(d.get("seconds"))[:80], "-", "-", "-", "-"])
    return rows


def _met(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def write_summary(results: list[dict], quick: bool) -> str:
    res = {r["name"]: r["data"] for r in results if r["data"]}
    full = FULL_RESULTS / "restore_1gb.json"  # a full-size restore run kept alongside (bench_restore.py --out ...)
    extra = []
    if full.exists():
        d = json.loads(full.read_text())
        rows = summary_rows({"restore": d})
        extra = [
            [f"{r[0]} [full size: {d['total_bytes'] / 1e9:.2f} GB, results/restore_1gb.json]"] + r[1:] for r in rows
        ]
    lines = [
        f"# Benchmark summary ({'--quick sizes' if quick else 'full sizes'})",
        "",
        f"Machine: {os.cpu_count()} cores (shared; load average per script below). "
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by `python -m benchmarks"
        f"{' --quick' if quick else ''}`.",
        "",
        "| question | our number | baseline | ratio | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in summary_rows(res) + extra]
    lines += ["", "| script | status | wall (s) | load avg before -> after (1m) |", "|---|---|---|---|"]
    for r in results:
        i = r["info"]
        lines.append(
            f"| {r['name']} | {i['status']} | {i['wall_s']:.0f} | "
            f"{i['load_average_before'][0]:.1f} -> {i['load_average_after'][0]:.1f} |"
        )
    plots = [p.name for p in sorted(RESULTS.glob("plot_*.png"))]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`{(RESULTS / p).relative_to(HERE)}`" for p in plots)]
    text = "\n".join(lines) + "\n"
    (RESULTS / "summary.md").write_text(text)
    return text


# --- plots -------------------------------------------------------------------------------------
def write_plots(results: list[dict]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    res = {r["name"]: r["data"] for r in results if r["data"]}
    out = []

    def bar(name: str, title: str, labels: list[str], values: list[float], ylabel: str = "seconds"):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        colors = ["tab:blue" if lab.startswith("gemini") else "tab:gray" for lab in labels]
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3f}", va="center", fontsize=8)
        fig.tight_layout()
        path = RESULTS / f"plot_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)

    d = res.get("save")
    if d:
        s = d["seconds"]
        keep = [k for k in s if "first save" not in k]
        bar(
            "stall",
            f"save() stall vs baselines ({d['state_bytes'] / 2**20:.0f} MiB state)",
            [("gemini_ckpt save() stall" if k.startswith("gemini") else k.strip()) for k in keep],
            [s[k] for k in keep],
        )
    d = res.get("replicate")
    if d:
        bar(
            "time_to_safe",
            f"time to safe: save -> committed ({d['hosts']} hosts, {d['shard_bytes'] / 1e6:.0f} MB/rank)",
            [r["method"] for r in d["rows"]],
            [r.get("commit_s", r.get("floor_s")) for r in d["rows"]],
        )
    d = res.get("restore")
    if d:
        bar(
            "restore",
            f"restore time ({d['total_bytes'] / 1e9:.2f} GB over {d['hosts']} hosts)",
            [r["method"] for r in d["rows"]],
            [r["seconds"] for r in d["rows"]],
        )
    full = FULL_RESULTS / "restore_1gb.json"
    if full.exists():
        d = json.loads(full.read_text())
        bar(
            "restore_1gb",
            f"restore time ({d['total_bytes'] / 1e9:.2f} GB over {d['hosts']} hosts, full size)",
            [r["method"] for r in d["rows"]],
            [r["seconds"] for r in d["rows"]],
        )
    d = res.get("scaling")
    if d:
        out.append(_plot_scaling(plt, d))
    d = res.get("persist")
    if d:
        bar(
            "persist",
            f"persist vs dcp.save ({d['total_bytes'] / 1e9:.2f} GB)",
            ["gemini_ckpt persist (committed -> persisted)", "dcp.save one process", "dcp.save 4 ranks"],
            [
                d["persist"]["committed_to_persisted_s"],
                d["dcp_save_single_process"]["seconds"],
                d["dcp_save_4_ranks"]["seconds"],
            ],
        )
    return out


def _plot_scaling(plt, d: dict) -> Path:
    """Time to safe vs hosts (a line), and host-store memory measured vs predicted per host count."""
    rows = sorted(d["rows"], key=lambda r: r["hosts"])
    hosts = [r["hosts"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.5))
    ax1.plot(hosts, [r["time_to_safe_s"] for r in rows], "o-", color="tab:blue", label="time to safe (median)")
    ax1.plot(hosts, [r["stall_s"] for r in rows], "s--", color="tab:gray", label="save() stall")
    ax1.set_xticks(hosts)
    ax1.set_xlabel("hosts")
    ax1.set_ylabel("seconds")
    ax1.set_ylim(bottom=0)
    ratio = f", {d['ratio_label']} = {d['ratio_largest_to_smallest']:.2f}" if d.get("ratio_largest_to_smallest") else ""
    ax1.set_title(f"time to safe, {rows[0]['shard_bytes'] / 1e6:.0f} MB per host{ratio}", fontsize=10)
    ax1.legend(fontsize=8)
    width = 0.2
    series = [
        (
            "measured peak (anon growth)",
            [r["measured_store_bytes"]["peak_anon_growth_bytes"] for r in rows],
            "tab:blue",
        ),
        ("measured reserved", [r["measured_store_bytes"]["reserved_bytes"] for r in rows], "tab:cyan"),
        ("predicted K·m·shard", [r["predicted_store_bytes"]["K*m*shard"] for r in rows], "tab:gray"),
        ("predicted (K+1)·m·shard", [r["predicted_store_bytes"]["(K+1)*m*shard"] for r in rows], "silver"),
    ]
    for i, (label, values, color) in enumerate(series):
        xs = [x + (i - 1.5) * width for x in range(len(rows))]
        ax2.bar(xs, [v / 1e6 for v in values], width, label=label, color=color)
    ax2.set_xticks(range(len(rows)), [str(h) for h in hosts])
    ax2.set_xlabel("hosts")
    ax2.set_ylabel("MB per host store (largest host)")
    ax2.set_title(f"host-store memory (K={d['keep_in_memory']}, m={d['replicas']})", fontsize=10)
    ax2.set_ylim(top=1.4 * max(v for _, values, _ in series for v in values) / 1e6)
    ax2.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    path = RESULTS / "plot_scaling.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a few minutes on 2 cores")
    ap.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHES], help="run only these")
    ap.add_argument("--summary-only", action="store_true", help="rebuild summary and plots from existing JSON")
    args = ap.parse_args(argv)
    global RESULTS
    RESULTS = FULL_RESULTS / "quick" if args.quick else FULL_RESULTS
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []
    for name, script, out, t_quick, t_full in BENCHES:
        if args.only and name not in args.only:
            continue
        if args.summary_only:
            path = RESULTS / out
            data = json.loads(path.read_text()) if path.exists() else None
            info = (data or {}).get("run_all") or {
                "status": "existing result" if data else "missing",
                "wall_s": 0.0,
                "load_average_before": [0.0],
                "load_average_after": [0.0],
            }
            results.append({"name": name, "info": info, "data": data})
            continue
        res = run_one(name, script, out, t_quick if args.quick else t_full, args.quick)
        if args.quick and res["info"]["status"] != "ok":
            # one more run: on a shared machine a quick run can fail once; both are reported
            first = res["info"]["status"]
            (RESULTS / f"{name}.log").replace(RESULTS / f"{name}.first.log")
            print(
                f"   running {name} once more (the first run's log: "
                f"{(RESULTS / f'{name}.first.log').relative_to(HERE.parent)})",
                flush=True,
            )
            res = run_one(name, script, out, t_quick, True)
            res["info"]["first_run"] = first
            if res["info"]["status"] == "ok":
                res["info"]["status"] = f"ok on a second run (first {first})"
                res["info"]["passed"] = True
            if res["data"] is not None:
                (RESULTS / out).write_text(json.dumps({**res["data"], "run_all": res["info"]}, indent=2))
        results.append(res)
    plots = write_plots(results)
    text = write_summary(results, args.quick)
    print()
    print(text)
    for p in plots:
        print(f"wrote {p.relative_to(HERE.parent)}")
    print(f"wrote {(RESULTS / 'summary.md').relative_to(HERE.parent)}")
    return 0 if all(r["info"]["status"] == "ok" or r["info"].get("passed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
