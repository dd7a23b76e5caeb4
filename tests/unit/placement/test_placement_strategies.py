"""Tests for the pure ``placement`` package: the strategies (who holds whom, hand-checked and
for every small cluster), validation of ``make``, and failure domains (copies spread over racks,
violations only when no arrangement avoids them)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from placement import PlacementError, domain_violations, make, recovery_probability, survives
from placement_support import STRATEGIES, placements_of_size


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
