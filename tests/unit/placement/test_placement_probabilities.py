"""Tests for the pure ``placement`` package: exact recovery probabilities, fatal sets and
recovery plans.

Exact probabilities are checked against brute-force enumeration of every failure set
on small clusters, and against an independent dynamic programme on large ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from fractions import Fraction
from math import comb

import pytest

from placement import (
    PlacementError,
    expected_steps_lost,
    fatal_count,
    fatal_sets,
    make,
    minimal_fatal_sets,
    plan_recovery,
    recovery_probability,
    survives,
)
from placement_support import (
    STRATEGIES,
    brute_survivable,
    placements_of_size,
    three_uneven,
    two_racks,
    valid_placements,
)


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
