"""Placement generators and a brute-force survival count shared by the ``placement`` tests
(test_placement_strategies.py, test_placement_probabilities.py, test_placement_cli.py)."""

from __future__ import annotations

import itertools

from placement import make

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


def placements_of_size(n, domain_layouts=DOMAIN_LAYOUTS):
    return [p for p in valid_placements(n, domain_layouts) if p.hosts == n]
