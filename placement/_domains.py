"""Spreading each host's copies over failure domains (racks, power feeds, zones).

A placement is a list of *cells*: groups (every member holds the whole group) and
rings (each member's copies live on the next ``replicas - 1`` members).  Two hosts of
one cell share a copy set when they are closer than ``replicas`` along the cell, so a
cell of ``size`` hosts can hold at most ``size // replicas`` hosts of any one domain
without two copies of some host landing in that domain.  ``arrange`` fills the cells
so that bound is met whenever any arrangement meets it:

1. hosts go to cells domain by domain, largest domain first, each host into the cell
   with the most free slots that is still under the cap for its domain.  For cap-1
   cells (groups, and every ring shorter than ``2 * replicas``) this is the greedy
   construction from the Gale–Ryser theorem, which finds a clash-free assignment
   whenever one exists;
2. inside a long ring (cap >= 2) hosts are *dealt* into ``cap`` blocks of about
   ``replicas`` slots, largest domain first.  A domain's hosts then sit one per block,
   at least ``replicas`` apart.  With equal-sized domains this is plain round-robin
   over the domains (A B A B ...).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

__all__ = ["arrange", "clashing_hosts"]


def arrange(labels: Sequence[Hashable], sizes: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Fill cells of the given ``sizes`` with host ids, cells in ring order.

    ``caps[i]`` is how many hosts of one domain cell ``i`` takes before copies must
    share a domain.  Always returns a full assignment; when no clash-free one exists
    the extra hosts go where they do the least harm (the emptiest cell).
    """
    by_domain: dict[Hashable, list[int]] = {}
    for host, label in enumerate(labels):
        by_domain.setdefault(label, []).append(host)
    # Largest domain first: it is the hardest to spread (stable: ties keep label order).
    ordered = sorted(by_domain.values(), key=len, reverse=True)

    free = list(sizes)
    cells: list[list[int]] = [[] for _ in sizes]
    for members in ordered:
        used = [0] * len(sizes)
        # The best cell is the one with the largest (under cap, free slots, -index); only
        # the chosen cell's key changes per host, so a heap finds the same cell as a scan
        # in O(log cells) (thousands of hosts in groups of 2 would otherwise be quadratic).
        heap = [(-(caps[i] > 0), -free[i], i) for i in range(len(sizes)) if free[i] > 0]
        heapq.heapify(heap)
        for host in members:
            best = heapq.heappop(heap)[2]
            cells[best].append(host)
            used[best] += 1
            free[best] -= 1
            if free[best] > 0:
                heapq.heappush(heap, (-(used[best] < caps[best]), -free[best], best))

    domain_of = dict(enumerate(labels))
    return [_deal(cell, cap, domain_of) for cell, cap in zip(cells, caps)]


def _deal(cell: list[int], cap: int, domain_of: dict[int, Hashable]) -> list[int]:
    if cap <= 1:
        # Every pair of members is within reach of each other: order does not matter.
        return sorted(cell)
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for host in cell:
        label = domain_of[host]
        counts[label] = counts.get(label, 0) + 1
        first.setdefault(label, host)
    # Domains with exactly `cap` hosts must come first so they start at block 0 and
    # keep one column; a smaller domain may wrap to the next column safely.
    line = sorted(cell, key=lambda h: (-counts[domain_of[h]], first[domain_of[h]], h))
    size = len(cell)
    base, extra = divmod(size, cap)
    starts = [b * base + min(b, extra) for b in range(cap)]
    ring = [0] * size
    for j, host in enumerate(line):
        ring[starts[j % cap] + j // cap] = host
    return ring


def clashing_hosts(holders: Sequence[Sequence[int]], labels: Sequence[Hashable]) -> tuple[int, ...]:
    """Hosts with two copies (holders) in one domain."""
    return tuple(host for host, held in enumerate(holders) if len({labels[h] for h in held}) < len(held))
