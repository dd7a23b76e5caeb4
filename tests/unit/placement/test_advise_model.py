"""Tests for ``placement.advise``: the ETTR model, its Monte-Carlo check, the recommendation
and the validation of its inputs.

The analytic model is checked against closed forms (Young/Daly, the classic renewal
formula), against brute-force enumeration of failure sets on small clusters, and against
the seeded Monte-Carlo replay through the real placement and planner.
"""

from __future__ import annotations

import ast
import doctest
import itertools
import math
import time

import pytest

from placement import PlacementError, advise, make, survives


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
