"""Tests for the pure ``placement`` package: strategies, planner, counting, CLI.

Exact probabilities are checked against brute-force enumeration of every failure set
on small clusters, and against an independent dynamic programme on large ones.
"""

from __future__ import annotations

import dataclasses
import doctest
import itertools
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

import placement
from placement import (
    PlacementError,
    domain_violations,
    expected_steps_lost,
    fatal_count,
    fatal_sets,
    make,
    minimal_fatal_sets,
    plan_recovery,
    recovery_probability,
    survives,
)

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("group", "ring", "mixed")


def valid_placements(max_hosts, domain_layouts=(None,)):
    """Every (strategy, hosts, replicas, domains) that ``make`` accepts, small N."""
    for n in range(1, max_hosts + 1):
        for m in range(1, n + 1):
            for strategy in STRATEGIES:
                if strategy == "group" and n % m:
                    continue
                for layout in domain_layouts:
                    yield make(strategy, hosts=n, replicas=m, domains=layout(n) if layout else None)


def two_racks(n):
    return ["rackA"] * (n - n // 2) + ["rackB"] * (n // 2)


def three_uneven(n):
    return [("r0", "r0", "r1", "r2", "r0")[i % 5] for i in range(n)]


DOMAIN_LAYOUTS = (None, two_racks, three_uneven)


def brute_survivable(p):
    """Survivable failure sets per k, by trying every combination of failed hosts."""
    masks = [sum(1 << h for h in p.holders(owner)) for owner in range(p.hosts)]
    counts = []
    for k in range(p.hosts + 1):
        alive = 0
        for failed in itertools.combinations(range(p.hosts), k):
            dead = sum(1 << h for h in failed)
            alive += all(masks[h] & ~dead for h in failed)
        counts.append(alive)
    return counts


# ---- strategies -------------------------------------------------------------


def test_design_example():
    p = make("group", hosts=16, replicas=2)
    assert p.holders(3) == (3, 2)
    assert survives(p, failed={2, 3}) is False
    assert recovery_probability(p, k=2) == Fraction(14, 15)
    assert f"{float(recovery_probability(p, 2)) * 100:.2f}" == "93.33"


def test_group_holders_hand_checked():
    p = make("group", hosts=6, replicas=3)
    assert [p.holders(h) for h in range(6)] == [(0, 1, 2), (1, 0, 2), (2, 0, 1), (3, 4, 5), (4, 3, 5), (5, 3, 4)]
    assert p.held_by(4) == (4, 3, 5)
    assert (p.strategy, p.hosts, p.replicas) == ("group", 6, 3)


def test_ring_holders_hand_checked():
    p = make("ring", hosts=5, replicas=3)
    assert [p.holders(h) for h in range(5)] == [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 0), (4, 0, 1)]
    assert p.held_by(0) == (0, 3, 4)
    assert make("ring", hosts=3, replicas=3).holders(1) == (1, 2, 0)


def test_mixed_holders_hand_checked():
    p = make("mixed", hosts=5, replicas=2)
    assert [p.holders(h) for h in range(5)] == [(0, 1), (1, 0), (2, 3), (3, 4), (4, 2)]
    q = make("mixed", hosts=7, replicas=3)
    assert [q.holders(h) for h in range(7)] == [
        (0, 1, 2),
        (1, 0, 2),
        (2, 0, 1),
        (3, 4, 5),
        (4, 5, 6),
        (5, 6, 3),
        (6, 3, 4),
    ]
    assert q.groups == ((0, 1, 2),) and q.rings == ((3, 4, 5, 6),)


@pytest.mark.parametrize("n,m", [(4, 2), (6, 3), (9, 3), (8, 8), (5, 1)])
def test_mixed_equals_group_when_replicas_divide_hosts(n, m):
    mixed, group = make("mixed", hosts=n, replicas=m), make("group", hosts=n, replicas=m)
    assert [mixed.holders(h) for h in range(n)] == [group.holders(h) for h in range(n)]
    assert mixed.strategy == "mixed"


def test_auto_resolves_and_shows_it():
    assert make("auto", hosts=16, replicas=2).strategy == "group"
    assert make("auto", hosts=16, replicas=3).strategy == "mixed"
    assert make(hosts=5, replicas=2).strategy == "mixed"


def test_placement_is_frozen():
    p = make("ring", hosts=4, replicas=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.replicas = 3  # type: ignore[misc]
    assert p == make("ring", hosts=4, replicas=2)
    assert "ring" in repr(p)


def placements_of_size(n, domain_layouts=DOMAIN_LAYOUTS):
    return [p for p in valid_placements(n, domain_layouts) if p.hosts == n]


@pytest.mark.parametrize("n", range(1, 13))
def test_every_host_is_held_exactly_replicas_times(n):
    for p in placements_of_size(n):
        _check_holders(p)


def _check_holders(p):
    seen = [0] * p.hosts
    for owner in range(p.hosts):
        holders = p.holders(owner)
        assert holders[0] == owner
        assert len(holders) == len(set(holders)) == p.replicas
        for h in holders:
            seen[h] += 1
            assert owner in p.held_by(h)
        assert p.held_by(owner)[0] == owner
        assert len(p.held_by(owner)) == p.replicas
    assert seen == [p.replicas] * p.hosts


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(strategy="group", hosts=2, replicas=3), "replicas"),
        (dict(strategy="ring", hosts=4, replicas=0), "replicas"),
        (dict(strategy="ring", hosts=0, replicas=1), "hosts"),
        (dict(strategy="ring", hosts=4.0, replicas=2), "hosts"),
        (dict(strategy="ring", hosts=4, replicas="2"), "replicas"),
        (dict(strategy="ring", hosts=True, replicas=1), "hosts"),
        (dict(strategy="star", hosts=4, replicas=2), "strategy"),
        (dict(strategy="group", hosts=16, replicas=3), "strategy"),
        (dict(strategy="ring", hosts=4, replicas=2, domains=["a", "b"]), "domains"),
        (dict(strategy="ring", hosts=4, replicas=2, domains="abab"), "domains"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field):
    strategy = kwargs.pop("strategy")
    with pytest.raises(ValueError) as info:
        make(strategy, **kwargs)
    assert isinstance(info.value, PlacementError)
    assert str(info.value).startswith(f"{field}:")


def test_validation_errors_say_how_to_fix():
    with pytest.raises(PlacementError, match="'group', 'ring', 'mixed', 'auto'"):
        make("star", hosts=4, replicas=2)
    with pytest.raises(PlacementError, match="mixed"):
        make("group", hosts=16, replicas=3)
    with pytest.raises(PlacementError, match="at most 2"):
        make("ring", hosts=2, replicas=3)
    with pytest.raises(PlacementError, match="host"):
        make("ring", hosts=4, replicas=2).holders(4)


# ---- failure domains --------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("labels", ["aaaabbbb", "abababab", "aabbaabb"])
def test_two_racks_of_four_have_no_shared_copies(strategy, labels):
    p = make(strategy, hosts=8, replicas=2, domains=list(labels))
    assert domain_violations(p) == ()
    for rack in "ab":
        # Every copy pair spans both racks, so losing a whole rack is survivable.
        assert survives(p, [h for h, d in enumerate(labels) if d == rack])


def test_domain_placement_hand_checked():
    p = make("ring", hosts=8, replicas=2, domains=["a"] * 4 + ["b"] * 4)
    assert p.rings == ((0, 4, 1, 5, 2, 6, 3, 7),)  # round-robin over the racks
    assert p.holders(0) == (0, 4) and p.holders(7) == (7, 0)
    g = make("group", hosts=8, replicas=2, domains=["a"] * 4 + ["b"] * 4)
    assert g.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_unavoidable_violations_are_reported():
    # 5 hosts of rack a but only 4 groups: some group holds two of rack a.
    p = make("group", hosts=8, replicas=2, domains=list("aaaaabbb"))
    assert domain_violations(p) != ()
    # Fewer racks than copies: every host has two copies in one rack.
    q = make("ring", hosts=6, replicas=3, domains=list("aaabbb"))
    assert domain_violations(q) == tuple(range(6))
    assert domain_violations(make("ring", hosts=6, replicas=3)) == ()


def _partitions(n, largest=None):
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    for first in range(min(n, largest), 0, -1):
        for rest in _partitions(n - first, first):
            yield (first, *rest)


def _arrangements(labels):
    """Distinct orderings of a multiset of labels."""
    if not labels:
        yield ()
        return
    for label in sorted(set(labels)):
        rest = list(labels)
        rest.remove(label)
        for tail in _arrangements(rest):
            yield (label, *tail)


def test_violations_only_when_no_arrangement_avoids_them():
    """Exhaustive for N <= 7: make() finds a clash-free layout whenever one exists."""
    checked = 0
    for n in range(2, 8):
        for sizes in _partitions(n):
            if len(sizes) in (1, n):
                continue  # one domain: always clashes; all distinct: never
            labels = [f"d{i}" for i, size in enumerate(sizes) for _ in range(size)]
            for m in range(2, n + 1):
                for strategy in STRATEGIES:
                    if strategy == "group" and n % m:
                        continue
                    # Present the labels in two orders: the result must not depend on it.
                    for order in (labels, labels[::-1]):
                        p = make(strategy, hosts=n, replicas=m, domains=order)
                        if not domain_violations(p):
                            continue
                        shape = make(strategy, hosts=n, replicas=m)
                        copy_sets = [shape.holders(h) for h in range(n)]
                        assert not any(
                            all(len({arr[h] for h in hs}) == m for hs in copy_sets) for arr in _arrangements(order)
                        ), (strategy, n, m, order)
                        checked += 1
    assert checked > 50


# ---- exact probabilities ----------------------------------------------------


@pytest.mark.parametrize("n", range(1, 13))
def test_probability_equals_brute_force(n):
    """Every strategy, every replicas, with and without domains, every k."""
    for p in placements_of_size(n):
        counts = brute_survivable(p)
        for k in range(n + 1):
            assert recovery_probability(p, k) == Fraction(counts[k], comb(n, k)), (p, k)
            assert fatal_count(p, k) == comb(n, k) - counts[k], (p, k)


def test_domains_do_not_change_probabilities():
    for n, m in [(8, 2), (9, 3), (10, 3), (12, 4)]:
        for strategy in STRATEGIES:
            if strategy == "group" and n % m:
                continue
            plain = make(strategy, hosts=n, replicas=m)
            racked = make(strategy, hosts=n, replicas=m, domains=two_racks(n))
            assert [plain.holders(h) for h in range(n)] != [racked.holders(h) for h in range(n)]
            assert brute_survivable(plain) == brute_survivable(racked)


def test_gemini_numbers_for_16_hosts():
    probs = {s: recovery_probability(make(s, hosts=16, replicas=2), 2) for s in STRATEGIES}
    assert probs == {"group": Fraction(14, 15), "ring": Fraction(13, 15), "mixed": Fraction(14, 15)}
    assert fatal_count(make("group", hosts=16, replicas=2), 2) == 8
    assert fatal_count(make("ring", hosts=16, replicas=2), 2) == 16


def _dp_survivable(p, k):
    """Independent count: polynomial product for groups, run-length DP for rings."""
    m = p.replicas
    poly = [1]
    for _ in p.groups:
        cell = [comb(m, j) for j in range(m)]  # any j < m of the group may fail
        poly = [
            sum(poly[i] * cell[d - i] for i in range(len(poly)) if 0 <= d - i < len(cell))
            for d in range(min(len(poly) + m - 1, k + 1))
        ]
    for ring in p.rings:
        n = len(ring)
        cell = [0] * (k + 1)
        for lead in range(min(m - 1, k) + 1):  # leading failed run, then a live host
            if lead >= n:
                break
            # state: (failed so far, current trailing run) over hosts lead+1 .. n-1
            states = {(lead, 0): 1}
            for _ in range(n - lead - 1):
                nxt = {}
                for (f, run), ways in states.items():
                    nxt[(f, 0)] = nxt.get((f, 0), 0) + ways
                    if f < k and run + 1 < m:
                        nxt[(f + 1, run + 1)] = nxt.get((f + 1, run + 1), 0) + ways
                states = nxt
            for (f, run), ways in states.items():
                if run + lead < m:  # the wrap-around run stays short
                    cell[f] += ways
        poly = [sum(poly[i] * cell[d - i] for i in range(len(poly)) if d - i >= 0) for d in range(k + 1)]
    return poly[k] if k < len(poly) else 0


@pytest.mark.parametrize(
    "strategy,n,m", [("group", 4095, 3), ("group", 4096, 4), ("ring", 4096, 3), ("mixed", 4096, 3)]
)
def test_4096_hosts_is_fast_and_exact(strategy, n, m):
    p = make(strategy, hosts=n, replicas=m)
    start = time.perf_counter()
    for k in (10, m, m + 1, n // 2, n - 1):
        recovery_probability(p, k)
    fatal_sets(p, 10, limit=5)
    assert time.perf_counter() - start < 5.0  # typically a few milliseconds

    # Values that do not depend on the formulas: with k = m the fatal sets are the
    # distinct copy sets; with k = m + 1, a copy set plus any other host, minus the
    # sets holding several copy sets: m + 1 consecutive hosts of a ring (c of them,
    # two copy sets each) or a whole ring of m + 1 (one set, m + 1 copy sets).
    copy_sets = len(minimal_fatal_sets(p))
    assert fatal_count(p, m) == copy_sets
    over = sum(len(r) if len(r) > m + 1 else m for r in p.rings if len(r) > m)
    assert fatal_count(p, m + 1) == copy_sets * (n - m) - over
    assert recovery_probability(p, 10) * comb(n, 10) == _dp_survivable(p, 10)
    assert recovery_probability(p, m - 1) == 1


@pytest.mark.parametrize("strategy", ["auto", "ring", "mixed"])
def test_4096_hosts_every_k_stays_fast(strategy):
    p = make(strategy, hosts=4096, replicas=3)
    start = time.perf_counter()
    for k in range(0, 4097, 256):
        recovery_probability(p, k)
    assert time.perf_counter() - start < 5.0


def test_probability_edges():
    p = make("ring", hosts=6, replicas=2)
    assert recovery_probability(p, 0) == 1
    assert recovery_probability(p, 1) == 1
    assert recovery_probability(p, 6) == 0
    assert recovery_probability(make("group", hosts=4, replicas=1), 1) == 0
    for bad in (-1, 7, 1.0, True):
        with pytest.raises(PlacementError, match="^k:"):
            recovery_probability(p, bad)


# ---- fatal sets -------------------------------------------------------------


def test_fatal_sets_hand_checked():
    assert fatal_sets(make("group", hosts=4, replicas=2), 2) == ((0, 1), (2, 3))
    assert fatal_sets(make("group", hosts=4, replicas=2), 3) == ((0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3))
    assert fatal_sets(make("ring", hosts=5, replicas=2), 2) == ((0, 1), (0, 4), (1, 2), (2, 3), (3, 4))
    assert fatal_sets(make("mixed", hosts=5, replicas=2), 2) == ((0, 1), (2, 3), (2, 4), (3, 4))
    assert fatal_sets(make("ring", hosts=6, replicas=3), 2) == ()
    assert fatal_sets(make("ring", hosts=6, replicas=2), 0) == ()
    mixed = make("mixed", hosts=5, replicas=2)
    assert minimal_fatal_sets(mixed) == ((0, 1), (2, 3), (2, 4), (3, 4))


@pytest.mark.parametrize("n", range(1, 10))
def test_fatal_sets_equal_brute_force(n):
    for p in placements_of_size(n):
        for k in range(n + 1):
            expected = tuple(failed for failed in itertools.combinations(range(n), k) if not survives(p, failed))
            assert fatal_sets(p, k, limit=None) == expected, (p, k)
            assert fatal_sets(p, k, limit=3) == expected[:3], (p, k)


def test_fatal_sets_on_a_huge_cluster_are_real_and_quick():
    racks = [f"rack{i % 8}" for i in range(4096)]
    for p in (
        make("mixed", hosts=4096, replicas=3),
        make("ring", hosts=4096, replicas=2, domains=racks),
    ):
        start = time.perf_counter()
        found = fatal_sets(p, 10, limit=20)
        assert time.perf_counter() - start < 5.0
        assert len(found) == 20 and list(found) == sorted(found)
        assert all(len(s) == 10 and not survives(p, s) for s in found)
    with pytest.raises(PlacementError, match="^limit:"):
        fatal_sets(p, 2, limit=-1)


# ---- recovery plans ---------------------------------------------------------


def test_plan_recovery_group_example():
    p = make("group", hosts=16, replicas=2)
    plan = plan_recovery(p, failed={2, 3})
    assert (plan.from_memory, plan.tier, plan.lost_hosts) == (False, "durable", (2, 3))
    assert plan.source(2) is None and plan.source(5) == 5
    ok = plan_recovery(p, failed=[3, 4])
    assert (ok.from_memory, ok.tier, ok.lost_hosts) == (True, "memory", ())
    assert (ok.source(3), ok.source(4), ok.source(0)) == (2, 5, 0)
    assert plan_recovery(p, {2, 3}, durable_available=False).tier == "none"
    with pytest.raises(PlacementError, match="^host:"):
        ok.source(-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.tier = "durable"  # type: ignore[misc]


def test_plan_source_is_first_live_holder():
    for p in valid_placements(7, (None, three_uneven)):
        for k in range(p.hosts + 1):
            for failed in itertools.combinations(range(p.hosts), k):
                plan = plan_recovery(p, failed)
                for owner in range(p.hosts):
                    live = [h for h in p.holders(owner) if h not in failed]
                    assert plan.source(owner) == (live[0] if live else None)
                assert plan.from_memory == survives(p, failed) == (plan.tier == "memory")


def test_plan_rejects_bad_failed_hosts():
    p = make("ring", hosts=4, replicas=2)
    for bad in ([4], [-1], ["1"], 3):
        with pytest.raises(PlacementError, match="^failed:"):
            plan_recovery(p, bad)
    with pytest.raises(PlacementError, match="^failed:"):
        survives(p, [9])


def test_expected_steps_lost():
    p = make("group", hosts=16, replicas=2)
    # 1/15 of 2-failures fall back to disk, losing (11 - 1) / 2 = 5 steps on average.
    assert expected_steps_lost(p, 2, persist_every=11) == Fraction(1, 3)
    assert expected_steps_lost(p, 2, persist_every=1) == 0
    assert expected_steps_lost(p, 1, persist_every=100) == 0
    assert expected_steps_lost(p, 16, persist_every=5) == 2
    with pytest.raises(PlacementError, match="^persist_every:"):
        expected_steps_lost(p, 2, persist_every=0)


def test_docstring_examples():
    import placement._planner
    import placement._strategies

    for module in (placement, placement._planner, placement._strategies):
        result = doctest.testmod(module, extraglobs=vars(placement), verbose=False)
        assert result.failed == 0 and (module is placement or result.attempted > 0)


# ---- CLI and packaging ------------------------------------------------------


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "placement", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_report_json():
    out = run_cli("report", "--hosts", "16", "--replicas", "2", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["strategies"] == ["group", "ring", "mixed"]
    assert [row["k"] for row in doc["rows"]] == [1, 2, 3, 4]  # min(N, m + 2)
    k2 = doc["rows"][1]
    assert k2["strategies"]["group"] == {"probability": "14/15", "percent": 93.33, "fatal_sets": 8}
    assert k2["strategies"]["ring"]["probability"] == "13/15"
    assert k2["best"] == ["group", "mixed"]


def test_cli_report_table_and_missing_group():
    out = run_cli("report", "--hosts", "16", "--replicas", "3", "--max-failures", "5")
    assert out.returncode == 0, out.stderr
    assert "98.57%" in out.stdout and "group: n/a" in out.stdout
    lines = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [line[0] for line in lines] == ["1", "2", "3", "4", "5"]
    assert lines[2][-1] == "mixed"


def test_cli_explains_a_failure():
    out = run_cli("report", "--hosts", "16", "--replicas", "2", "--failed", "3,4")
    assert out.returncode == 0, out.stderr
    assert "host 3: read from host 2" in out.stdout
    assert "host 4: read from host 5" in out.stdout
    lost = run_cli("report", "--hosts", "16", "--replicas", "2", "--strategy", "group", "--failed", "2,3")
    assert "host 2: LOST" in lost.stdout and "durable tier is needed" in lost.stdout
    doc = json.loads(
        run_cli("report", "--hosts", "5", "--replicas", "2", "--strategy", "auto", "--failed", "2", "--json").stdout
    )
    plan = doc["plans"]["mixed"]
    assert plan["sources"]["2"] == 3 and plan["tier"] == "memory"


def test_cli_show_with_domains():
    out = run_cli("show", "--hosts", "8", "--replicas", "2", "--strategy", "ring", "--domains", "a*4,b*4")
    assert out.returncode == 0, out.stderr
    assert "no host has two copies in one domain" in out.stdout
    assert "who holds whom" in out.stdout
    doc = json.loads(run_cli("show", "--hosts", "5", "--replicas", "2", "--json").stdout)
    assert doc["strategy"] == "mixed" and doc["holders"]["4"] == [4, 2]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["report", "--hosts", "16", "--replicas", "3", "--strategy", "group"], "strategy:"),
        (["report", "--hosts", "4", "--replicas", "5"], "replicas:"),
        (["report", "--hosts", "four", "--replicas", "2"], "--hosts"),
        (["report", "--hosts", "4", "--replicas", "2", "--failed", "7"], "failed:"),
        (["show", "--hosts", "4", "--replicas", "2", "--domains", "a,b"], "domains:"),
        (["show", "--hosts", "4", "--replicas", "2", "--strategy", "star"], "--strategy"),
    ],
)
def test_cli_errors_are_one_line_exit_2(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr


def test_import_pulls_in_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import placement, placement._cli; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'placement'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_surface_is_small():
    assert len(placement.__all__) <= 15
    assert all(hasattr(placement, name) for name in placement.__all__)


def test_hand_built_placement_with_several_rings():
    """Placement is a public dataclass: custom cells are validated and counted exactly."""
    p = placement.Placement(strategy="custom", hosts=9, replicas=2, groups=((0, 1),), rings=((2, 4, 3), (5, 6, 7, 8)))
    assert p.holders(4) == (4, 3) and p.holders(8) == (8, 5)
    counts = brute_survivable(p)
    assert [recovery_probability(p, k) * comb(9, k) for k in range(10)] == counts
    with pytest.raises(PlacementError, match="^groups/rings:"):
        placement.Placement(strategy="custom", hosts=4, replicas=2, groups=((0, 1), (1, 2)))
    with pytest.raises(PlacementError, match="^rings:"):
        placement.Placement(strategy="custom", hosts=3, replicas=2, groups=((0, 1),), rings=((2,),))


def test_cli_never_rounds_to_a_false_certainty(capsys):
    from placement._cli import main

    assert main(["report", "--hosts", "4096", "--replicas", "3", "--max-failures", "3"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("   3")]
    assert row and ">99.99%" in row[0] and "100.00%" not in row[0]
