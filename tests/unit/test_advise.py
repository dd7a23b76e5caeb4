"""Tests for ``placement.advise``: the ETTR model, its Monte-Carlo check, the CLI.

The analytic model is checked against closed forms (Young/Daly, the classic renewal
formula), against brute-force enumeration of failure sets on small clusters, and against
the seeded Monte-Carlo replay through the real placement and planner.
"""

from __future__ import annotations

import ast
import doctest
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from placement import PlacementError, advise, make, survives

ROOT = Path(__file__).resolve().parents[2]


# ---- durable only: Young/Daly and the exact renewal formula ---------------------


def test_durable_only_interval_is_young_daly_to_first_order():
    # C = 10 s, M = 125 h: C/M is tiny, so sqrt(2 C M) = 3000 s holds to first order.
    a = advise(hosts=64, host_mtbf_h=8000.0, process_mtbf_h=None, durable_save_s=10.0, step_s=1.0)
    mtbf_s = 8000.0 * 3600 / 64
    assert a.system_mtbf_h * 3600 == pytest.approx(mtbf_s)
    assert a.young_daly_s == pytest.approx(math.sqrt(2 * 10.0 * mtbf_s)) == pytest.approx(3000.0)
    doc = a.to_json()["durable_only"]
    assert doc["interval_steps"] == 2993 and doc["interval_s"] == 2993.0
    assert abs(doc["interval_s"] / a.young_daly_s - 1) < 0.01  # 0.23 % here
    # The exact optimum is Daly's higher-order interval, to the step.
    c, m = 10.0, mtbf_s
    daly = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert abs(doc["interval_s"] - daly) <= 1.0


@pytest.mark.parametrize("hosts", [16, 1024, 4096])
def test_durable_only_matches_daly_within_a_step_at_the_defaults(hosts):
    a = advise(hosts=hosts)
    c, m = a.costs.durable_save_s, a.system_mtbf_h * 3600
    daly = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    interval = a.durable_only.setting.persist_every * a.costs.step_s
    assert abs(interval - daly) <= a.costs.step_s
    # First order: the gap to sqrt(2 C M) is O(sqrt(C/M)) of it.
    assert abs(interval / a.young_daly_s - 1) < math.sqrt(c / m)


def test_durable_only_ettr_is_the_classic_renewal_formula():
    """Checkpoint every w seconds of work at cost C, restart R: ETTR = w / ((e^{L tau} - 1)(1/L + R))."""
    a = advise(hosts=1024)
    d = a.durable_only
    c = a.costs
    lam_p, lam_h, lam_d = a.failures.rates()
    lam = lam_p + lam_h + lam_d
    restart = (lam_p * c.restart_process_s + lam_h * c.restart_host_s) / lam + c.restore_durable_s
    w = d.setting.persist_every * c.step_s
    tau = w + c.durable_save_s
    assert d.ettr == pytest.approx(w / (math.expm1(lam * tau) * (1 / lam + restart)), rel=1e-12)
    assert d.ettr + d.waste_checkpoint + d.waste_lost + d.waste_recovery == pytest.approx(1.0)
    # Either side of the optimum is worse.
    n = d.setting.persist_every
    for other in (n - 1, n + 1):
        assert a.evaluate(replicas=0, persist_every=other).ettr < d.ettr


# ---- memory survival: the planner, priced --------------------------------------


def _brute_host_survival(p, window_p):
    """P(memory | a host fails), other hosts failing independently within the window."""
    total = 0.0
    for first in range(p.hosts):
        others = [h for h in range(p.hosts) if h != first]
        for k in range(len(others) + 1):
            for extra in itertools.combinations(others, k):
                w = window_p**k * (1 - window_p) ** (len(others) - k)
                total += w * survives(p, {first, *extra})
    return total / p.hosts


@pytest.mark.parametrize(
    "strategy,hosts,replicas",
    [
        ("ring", 8, 2),
        ("group", 8, 2),
        ("mixed", 7, 3),
        ("ring", 9, 3),
        ("auto", 6, 1),
    ],
)
def test_host_survival_equals_enumeration(strategy, hosts, replicas):
    # A 10 h MTBF with 1 h restarts makes second and third failures in the window common.
    a = advise(hosts=hosts, host_mtbf_h=10.0, restart_host_s=3600.0)
    est = a.evaluate(replicas=replicas, placement=strategy, persist_every=100)
    window_p = -math.expm1(-(3600.0 + a.costs.restore_peer_s) / (10.0 * 3600))
    p = make(strategy, hosts=hosts, replicas=replicas)
    assert est.p_memory_host == pytest.approx(_brute_host_survival(p, window_p), rel=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "spread"])
@pytest.mark.parametrize("strategy,replicas", [("group", 2), ("ring", 2), ("ring", 3), ("mixed", 3)])
def test_domain_survival_equals_enumeration(layout, strategy, replicas):
    """Exact up to two more failed hosts in the window; three or more count as lost."""
    hosts, size = 12, 4
    a = advise(
        hosts=hosts,
        host_mtbf_h=10.0,
        restart_host_s=3600.0,
        domain_size=size,
        domain_mtbf_h=100.0,
        domain_layout=layout,
    )
    est = a.evaluate(replicas=replicas, placement=strategy, persist_every=100)
    window_p = -math.expm1(-(3600.0 + a.costs.restore_peer_s) / (10.0 * 3600))
    labels = [h // size for h in range(hosts)]
    p = make(strategy, hosts=hosts, replicas=replicas, domains=labels if layout == "spread" else None)
    expected = 0.0
    for d in range(hosts // size):
        members = {h for h in range(hosts) if labels[h] == d}
        others = [h for h in range(hosts) if h not in members]
        for k in range(3):
            for extra in itertools.combinations(others, k):
                w = window_p**k * (1 - window_p) ** (len(others) - k)
                expected += w * survives(p, members | set(extra)) / (hosts // size)
    assert est.p_memory_domain == pytest.approx(expected, rel=1e-12)
    if layout == "contiguous" and strategy == "group":
        assert est.p_memory_domain == 0.0  # both copies of a pair sit in one rack


# ---- Monte-Carlo vs analytic -----------------------------------------------------


MC_CONFIGS = {
    # durable only at its optimum: the exponential phase density, restarts of two kinds
    "durable only, 1024 hosts, defaults": (dict(hosts=1024), dict(replicas=0, persist_every=113)),
    # local copy only: process crashes from memory, host losses from the durable tier,
    # a persist interval (232 s) shorter than persist (120 s) + commit: the not-yet-durable case
    "replicas=1, 1024 hosts, defaults": (dict(hosts=1024), dict(replicas=1, persist_every=23)),
    # second failures within a 1 h replacement window: P(memory | host lost) = 98 %
    "ring, replicas=2, 8 hosts, 100 h MTBF, 1 h restarts": (
        dict(hosts=8, host_mtbf_h=100.0, restart_host_s=3600.0),
        dict(replicas=2, placement="ring", persist_every=90),
    ),
    # racks of 4 failing whole, copies spread over racks
    "group, replicas=2, 12 hosts in racks of 4 (spread)": (
        dict(
            hosts=12,
            host_mtbf_h=100.0,
            restart_host_s=3600.0,
            domain_size=4,
            domain_mtbf_h=300.0,
            domain_layout="spread",
        ),
        dict(replicas=2, placement="group", persist_every=90, save_every=3),
    ),
}


@pytest.mark.parametrize("name", list(MC_CONFIGS))
def test_monte_carlo_agrees_with_analytic_within_one_percent(name):
    inputs, setting = MC_CONFIGS[name]
    a = advise(**inputs)
    est = a.evaluate(**setting)
    sim = a.simulate(est, events=20000, seed=0)
    rel = (sim.ettr - est.ettr) / est.ettr
    print(f"{name}: analytic {est.ettr:.5f} monte carlo {sim.ettr:.5f} relative {rel:+.5f}")
    assert abs(rel) < 0.01
    assert sim.events == 20000 and sim.memory_recoveries + sim.durable_fallbacks == 20000
    if est.setting.replicas == 0:
        assert sim.memory_recoveries == 0
    # Same seed, same replay.
    assert a.simulate(est, events=500, seed=7) == a.simulate(est, events=500, seed=7)


def test_monte_carlo_sees_the_probabilities_the_planner_computes():
    # 8 hosts, ring m=2: the share of host failures recovered from memory matches.
    a = advise(hosts=8, host_mtbf_h=100.0, restart_host_s=3600.0, process_mtbf_h=None)
    est = a.evaluate(replicas=2, placement="ring", persist_every=90)
    sim = a.simulate(est, events=20000, seed=1)
    share = sim.memory_recoveries / sim.events
    sd = math.sqrt(est.p_memory_host * (1 - est.p_memory_host) / sim.events)
    assert abs(share - est.p_memory_host) < 4 * sd


# ---- scaling and the recommendation -------------------------------------------------


def test_in_memory_stays_above_durable_only_as_hosts_grow():
    durable, best = [], []
    for hosts in (16, 64, 256, 1024, 4096):
        a = advise(hosts=hosts)
        durable.append(a.durable_only.ettr)
        best.append(a.recommended.ettr)
        assert a.recommended.setting.replicas >= 1
        assert a.recommended.ettr > a.durable_only.ettr
    assert durable == sorted(durable, reverse=True) and len(set(durable)) == len(durable)
    assert best == sorted(best, reverse=True)
    # The gap widens with scale: what GEMINI's scaling figure shows.
    gaps = [b - d for b, d in zip(best, durable)]
    assert gaps == sorted(gaps)


def test_recommendation_at_1024_hosts_with_defaults():
    a = advise(hosts=1024)
    r = a.recommended
    assert (r.setting.replicas, r.setting.placement, r.setting.keep_in_memory) == (2, "group", 2)
    assert (r.setting.save_every, r.setting.persist_every) == (5, 215)
    assert r.ettr == pytest.approx(0.9755, abs=5e-5)
    assert a.durable_only.ettr == pytest.approx(0.9237, abs=5e-5)
    assert r.ettr == max(c.ettr for c in a.candidates if c.setting.replicas == 2)
    # No candidate beats the pick by more than the tie margin.
    assert max(c.ettr for c in a.candidates) - r.ettr <= 1e-4
    line = r.setting.config_line("runs/llm")
    call = ast.parse(line, mode="eval").body
    assert isinstance(call, ast.Call) and call.func.id == "CheckpointConfig"
    assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == {
        "replicas": 2,
        "placement": "group",
        "keep_in_memory": 2,
        "persist_every": 215,
        "durable_uri": "runs/llm",
    }
    for c in a.candidates:
        total = c.ettr + c.waste_checkpoint + c.waste_lost + c.waste_recovery
        assert total == pytest.approx(1.0)
        assert c.feasible and c.interval_s >= a.costs.persist_s


def test_rack_failures_with_contiguous_slots_fall_back_to_durable():
    kwargs = dict(hosts=256, domain_size=16, domain_mtbf_h=2000.0)
    contiguous = advise(**kwargs)
    spread = advise(**kwargs, domain_layout="spread")
    assert all(c.p_memory_domain == 0.0 for c in contiguous.candidates)
    assert any("contiguous" in note for note in contiguous.notes)
    best = max(c.p_memory_domain for c in spread.candidates)
    assert best > 0.99
    assert spread.recommended.ettr > contiguous.recommended.ettr


def test_durable_only_can_win_and_says_so():
    # A 30 s stall per save against a 1 s step: memory checkpointing costs more than it saves.
    a = advise(hosts=16, stall_s=30.0, step_s=1.0, commit_s=(31.0,), max_persist_h=0.05)
    assert a.durable_only.ettr > a.recommended.ettr
    assert any("durable-only checkpointing" in n for n in a.notes)


def test_large_cluster_is_fast():
    start = time.perf_counter()
    a = advise(hosts=4096)
    a.simulate(a.recommended)
    a.simulate(a.durable_only)
    assert time.perf_counter() - start < 5.0  # about 0.5 s


# ---- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(hosts=0), "hosts"),
        (dict(hosts=4, host_mtbf_h=0), "host_mtbf_h"),
        (dict(hosts=4, host_mtbf_h=float("inf")), "host_mtbf_h"),
        (dict(hosts=4, step_s=-1), "step_s"),
        (dict(hosts=4, commit_s=()), "commit_s"),
        (dict(hosts=4, domain_size=2), "domain_size"),
        (dict(hosts=4, domain_size=8, domain_mtbf_h=10.0), "domain_size"),
        (dict(hosts=4, domain_layout="racks"), "domain_layout"),
        (dict(hosts=4, max_persist_h=0), "max_persist_h"),
        (dict(hosts=4, replicas=(0,)), "replicas"),
        (dict(hosts=4, ranks_per_host=True), "ranks_per_host"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field):
    with pytest.raises(PlacementError) as info:
        advise(**kwargs)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{field}:")


def test_evaluate_rejects_settings_the_cluster_cannot_run():
    a = advise(hosts=4)
    with pytest.raises(PlacementError, match="^replicas:"):
        a.evaluate(replicas=5, persist_every=10)
    with pytest.raises(PlacementError, match="^strategy:"):
        advise(hosts=5).evaluate(replicas=2, placement="group", persist_every=10)
    with pytest.raises(PlacementError, match="^persist_every:"):
        a.evaluate(replicas=2, persist_every=0)
    with pytest.raises(PlacementError, match="^events:"):
        a.simulate(a.recommended, events=0)
    slow = a.evaluate(replicas=2, persist_every=1)  # 10 s interval, 120 s persists
    assert not slow.feasible and "queue up" in slow.note


def test_docstring_examples():
    import placement._advise

    result = doctest.testmod(placement._advise, extraglobs=vars(placement), verbose=False)
    assert result.failed == 0 and result.attempted > 0


# ---- CLI ------------------------------------------------------------------------------


def run_cli(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "placement", "advise", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_defaults_need_only_hosts():
    out = run_cli("--hosts", "1024")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Young/Daly sqrt(2 C M) = 1154 s" in text
    assert (
        'CheckpointConfig(replicas=2, placement="group", keep_in_memory=2, persist_every=215, '
        'durable_uri="runs/my-job")' in text
    )
    assert "save every 5 steps" in text
    assert "ETTR 97.55% vs 92.37% durable only" in text
    assert "monte carlo (seed 0, 20000 failures" in text
    starred = [line for line in text.splitlines() if line.startswith("*")]
    assert len(starred) == 1 and starred[0].split()[1:5] == ["2", "group", "5", "215"]


def test_cli_json_has_the_documented_shape():
    out = run_cli("--hosts", "1024", "--json", "--simulate", "2000")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["durable_only"]) >= {"interval_steps", "interval_s", "ettr"}
    assert doc["durable_only"]["interval_steps"] == 113
    assert set(doc["recommended"]) >= {"replicas", "placement", "persist_every", "keep_in_memory", "ettr"}
    assert (doc["recommended"]["replicas"], doc["recommended"]["placement"]) == (2, "group")
    assert len(doc["candidates"]) == 21
    assert {c["replicas"] for c in doc["candidates"]} == {1, 2, 3}
    mc = doc["monte_carlo"]["recommended"]
    assert mc["events"] == 2000 and abs(mc["relative_error"]) < 0.01
    assert doc["inputs"]["cost_sources"]["stall_s"] == "default"


def _bench_results(directory: Path) -> None:
    """Files shaped exactly as the benchmark scripts write them (values invented)."""
    (directory / "save.json").write_text(
        json.dumps(
            {
                "state_bytes": 1,
                "seconds": {"gemini_ckpt save() stall": 0.094, "dcp.save to local disk": 1.68},
            }
        )
    )
    (directory / "replicate.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "gemini_ckpt replicas=2", "replicas": 2, "stall_s": 0.1, "commit_s": 3.09, "put_s": 2.0},
                    {"method": "gemini_ckpt replicas=3", "replicas": 3, "stall_s": 0.1, "commit_s": 4.09, "put_s": 3.0},
                    {"method": "DCP async_save to local disk", "replicas": 1, "stall_s": 0.5, "commit_s": 1.82},
                ]
            }
        )
    )
    (directory / "restore.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "gemini_ckpt: local memory (same hosts)", "seconds": 0.89},
                    {"method": "stock dcp.load, local disk, page cache warm", "seconds": 0.4},
                    {"method": "gemini_ckpt: peer memory (ranks moved to other hosts)", "seconds": 2.26},
                    {"method": "gemini_ckpt: durable tier, page cache warm", "seconds": 0.7},
                    {"method": "gemini_ckpt: durable tier, page cache dropped", "seconds": 1.11},
                ]
            }
        )
    )
    (directory / "recovery.json").write_text(
        json.dumps(
            {
                "ratio_with_restart": 1.9,
                "costs": {"restart_host_s": 21.5, "restore_peer_s": 0.3},
            }
        )
    )


def test_cli_from_bench_takes_measured_costs_and_names_the_rest(tmp_path):
    _bench_results(tmp_path)
    out = run_cli("--hosts", "64", "--from-bench", str(tmp_path), "--restore-peer", "9", "--json", "--simulate", "0")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    costs, sources = doc["inputs"]["costs"], doc["inputs"]["cost_sources"]
    assert costs["stall_s"] == 0.094 and costs["durable_save_s"] == 1.68
    assert costs["commit_s"] == [1.0, 3.09, 4.09]  # replicas 1 not measured: the default
    assert "replicas 1: default" in sources["commit_s"]
    assert costs["restore_local_s"] == 0.89 and costs["restore_durable_s"] == 1.11
    assert costs["restore_peer_s"] == 9.0 and sources["restore_peer_s"] == "--restore-peer"
    assert costs["restart_host_s"] == 21.5 and sources["restart_host_s"] == "bench: recovery.json costs.restart_host_s"
    assert doc["inputs"]["bench_missing"] == ["persist_s", "persist_stall_s"]
    assert sources["persist_s"] == "default (not in the bench results)"
    text = run_cli("--hosts", "64", "--from-bench", str(tmp_path / "restore.json"), "--simulate", "0")
    assert text.returncode == 0, text.stderr
    assert "not in the bench results, default used: stall_s, commit_s, persist_s" in text.stdout


def test_cli_from_bench_refuses_hostile_sizes_and_nesting_with_one_line(tmp_path):
    """A benchmark file is not trusted to size the work (issue 40, 12): a row claiming 10^8
    copies took 141 s and 10.5 GB, a deeply nested file was a RecursionError traceback."""
    (tmp_path / "replicate.json").write_text(
        json.dumps(
            {"rows": [{"method": "gemini_ckpt replicas=huge", "replicas": 100_000_000, "commit_s": 1.0, "put_s": 1.0}]}
        )
    )
    t0 = time.monotonic()
    out = run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--simulate", "0")
    assert out.returncode == 2 and time.monotonic() - t0 < 30, (out.returncode, out.stderr[-2000:])
    assert "replicas=100000000; a benchmark measures 1 to 64 copies" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "replicate.json").write_text("[" * 100_000 + "]" * 100_000)
    out = run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--simulate", "0")
    assert out.returncode == 2 and "nested too deeply" in out.stderr and "Traceback" not in out.stderr, out.stderr[
        -2000:
    ]
    (tmp_path / "replicate.json").write_text(
        json.dumps(
            {"rows": [{"method": "gemini_ckpt replicas=2", "replicas": 2, "commit_s": float("inf"), "put_s": 1.0}]}
        )
    )
    doc = json.loads(
        run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--json", "--simulate", "0").stdout
    )
    assert "commit_s" in doc["inputs"]["bench_missing"]  # an infinite cost is not a measurement


def test_cli_from_bench_reads_persist_stalls(tmp_path):
    (tmp_path / "persist.json").write_text(
        json.dumps(
            {
                "persist": {"committed_to_persisted_s": 4.0, "save_to_persisted_s": 5.0, "gbps": 0.25},
                "stall": {"memory_only_s": 0.10, "persisting_step_s": 0.25, "next_step_during_persist_s": 0.15},
            }
        )
    )
    doc = json.loads(
        run_cli("--hosts", "16", "--from-bench", str(tmp_path / "persist.json"), "--json", "--simulate", "0").stdout
    )
    assert doc["inputs"]["costs"]["persist_s"] == 4.0
    assert doc["inputs"]["costs"]["persist_stall_s"] == pytest.approx(0.20)


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ettr.png"
    out = run_cli("--hosts", "256", "--plot", str(path), "--simulate", "0")
    assert out.returncode == 0, out.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in out.stdout


def test_cli_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from placement._cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["advise", "--hosts", "16", "--simulate", "0", "--plot", str(tmp_path / "x.png")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot: matplotlib is not installed" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--hosts", "0"], "--hosts"),
        (["--hosts", "8", "--domain-size", "4"], "--domain-size: correlated failures need both --domain-size"),
        (["--hosts", "8", "--domain-size", "16", "--domain-mtbf", "100"], "--domain-size: 16 hosts"),
        (["--hosts", "8", "--stall", "-1"], "--stall"),
        (["--hosts", "8", "--step-time", "nan"], "--step-time"),
        (["--hosts", "8", "--host-mtbf", "5", "--failures-per-day", "1"], "--failures-per-day"),
        (["--hosts", "8", "--commit-time", "2=x"], "--commit-time"),
        (["--hosts", "8", "--from-bench", "/no/such/results"], "--from-bench: '/no/such/results' does not exist"),
        (["--hosts", "8", "--domain-layout", "racks"], "--domain-layout"),
    ],
)
def test_cli_errors_are_one_line_naming_the_flag(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr


def test_cli_4096_hosts_under_five_seconds():
    start = time.perf_counter()
    out = run_cli("--hosts", "4096")
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert elapsed < 5.0, f"{elapsed:.2f}s"


def test_failures_per_day_is_host_mtbf():
    out = run_cli("--hosts", "64", "--failures-per-day", "0.003", "--json", "--simulate", "0")
    a = json.loads(out.stdout)
    assert a["inputs"]["failures"]["host_mtbf_h"] == pytest.approx(8000.0)
