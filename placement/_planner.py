"""The recovery planner: what survives a set of host failures, and how likely that is.

Everything here is a pure function of a :class:`~placement.Placement`; restore uses
the same functions, so what a report predicts is what recovery does.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from math import comb
from typing import Literal

from . import _counting
from ._errors import PlacementError
from ._strategies import Placement

__all__ = [
    "RecoveryPlan",
    "expected_steps_lost",
    "fatal_count",
    "fatal_sets",
    "minimal_fatal_sets",
    "plan_recovery",
    "recovery_probability",
    "survives",
]

Tier = Literal["memory", "durable", "none"]


@dataclass(frozen=True)
class RecoveryPlan:
    """Where each host's shards come from after ``failed`` hosts are lost.

    ``sources[h]`` is the live holder to read host ``h``'s shards from: ``h`` itself
    when alive, else its first live holder in ``holders(h)`` order; ``None`` when every
    copy died (then ``h`` is in ``lost_hosts``).  ``tier`` is ``"memory"`` when every
    host has a source, else ``"durable"`` (all hosts load the latest persisted
    version; ``sources`` then only says which memory copies survived) or ``"none"``
    when durable storage is unreachable too.

    >>> from placement import make
    >>> plan = plan_recovery(make("group", hosts=4, replicas=2), failed={1})
    >>> plan.tier, plan.source(1)
    ('memory', 0)
    """

    failed: frozenset[int]
    sources: tuple[int | None, ...]
    lost_hosts: tuple[int, ...]
    from_memory: bool
    tier: Tier
    durable_available: bool

    def source(self, host: int) -> int | None:
        """The host to read ``host``'s shards from, or ``None`` if all copies died."""
        if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < len(self.sources):
            raise PlacementError(f"host: expected an int in 0..{len(self.sources) - 1}, got {host!r}")
        return self.sources[host]


def survives(p: Placement, failed: Iterable[int]) -> bool:
    """Whether every host's shards still have a live holder after ``failed`` fail.

    >>> from placement import make
    >>> p = make("group", hosts=16, replicas=2)
    >>> survives(p, failed={2, 3}), survives(p, failed={3, 4})
    (False, True)
    """
    dead = _failed_set(p, failed)
    return all(not dead.issuperset(p.holders(h)) for h in dead)


def plan_recovery(p: Placement, failed: Iterable[int], *, durable_available: bool = True) -> RecoveryPlan:
    """Decide, host by host, where recovery reads shards from.

    The choice is deterministic (owner first, then holders order) so every rank
    computes the same plan without talking to the others.

    >>> from placement import make
    >>> plan = plan_recovery(make("group", hosts=16, replicas=2), failed={2, 3})
    >>> plan.tier, plan.lost_hosts
    ('durable', (2, 3))
    """
    dead = _failed_set(p, failed)
    sources = tuple(next((h for h in p.holders(owner) if h not in dead), None) for owner in range(p.hosts))
    lost = tuple(h for h, s in enumerate(sources) if s is None)
    tier: Tier
    if not lost:
        tier = "memory"
    elif durable_available:
        tier = "durable"
    else:
        tier = "none"
    return RecoveryPlan(
        failed=dead,
        sources=sources,
        lost_hosts=lost,
        from_memory=not lost,
        tier=tier,
        durable_available=bool(durable_available),
    )


def recovery_probability(p: Placement, k: int) -> Fraction:
    """Exact chance of recovering from memory when ``k`` hosts fail at once.

    All ``C(hosts, k)`` failure sets are taken as equally likely.  Computed by
    counting (see ``docs/placement.md``), so ``hosts=4096`` answers in milliseconds.

    >>> from placement import make
    >>> recovery_probability(make("group", hosts=16, replicas=2), k=2)
    Fraction(14, 15)
    """
    k = _check_k(p, k)
    return Fraction(_survivable(p, k), comb(p.hosts, k))


def fatal_count(p: Placement, k: int) -> int:
    """How many of the ``C(hosts, k)`` failure sets lose some host's every copy.

    >>> from placement import make
    >>> fatal_count(make("group", hosts=16, replicas=2), k=2)
    8
    """
    k = _check_k(p, k)
    return comb(p.hosts, k) - _survivable(p, k)


def minimal_fatal_sets(p: Placement) -> tuple[tuple[int, ...], ...]:
    """The smallest fatal failure sets: each host's holder set, without duplicates.

    A failure set is fatal exactly when it contains one of these.

    >>> from placement import make
    >>> minimal_fatal_sets(make("group", hosts=6, replicas=2))
    ((0, 1), (2, 3), (4, 5))
    """
    return tuple(sorted({tuple(sorted(p.holders(h))) for h in range(p.hosts)}))


def fatal_sets(p: Placement, k: int, *, limit: int | None = 1000) -> tuple[tuple[int, ...], ...]:
    """All fatal ``k``-host failure sets (not only minimal ones), lexicographically.

    Each set is a sorted tuple of hosts.  At most ``limit`` sets are returned (the
    lexicographically first ones; ``None`` for no limit): compare with
    :func:`fatal_count` to know whether the list is complete.  The search only walks
    prefixes that can still become fatal, so the first sets of a huge space
    (``hosts=4096``) come back at once.

    >>> from placement import make
    >>> fatal_sets(make("ring", hosts=5, replicas=2), k=2)
    ((0, 1), (0, 4), (1, 2), (2, 3), (3, 4))
    """
    k = _check_k(p, k)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise PlacementError(f"limit: expected an int >= 0 or None, got {limit!r}")
    return tuple(itertools.islice(_iter_fatal(p, k), limit))


def expected_steps_lost(p: Placement, k: int, persist_every: int) -> Fraction:
    """Expected committed training steps lost when ``k`` hosts fail at once.

    Model: a version is saved to memory every step and persisted every
    ``persist_every`` steps; the failure strikes at a uniformly random step.  The
    step in flight is lost either way, so it is not counted.  Recovery from memory
    resumes from the last committed version: 0 steps lost.  Otherwise the job falls
    back to the last persisted version, which is ``0 .. persist_every - 1`` steps
    behind, ``(persist_every - 1) / 2`` on average.  Hence
    ``(1 - recovery_probability(p, k)) * (persist_every - 1) / 2``.

    >>> from placement import make
    >>> expected_steps_lost(make("group", hosts=16, replicas=2), k=2, persist_every=11)
    Fraction(1, 3)
    """
    if isinstance(persist_every, bool) or not isinstance(persist_every, int) or persist_every < 1:
        raise PlacementError(f"persist_every: expected an int >= 1 (persist every Nth step), got {persist_every!r}")
    return (1 - recovery_probability(p, k)) * Fraction(persist_every - 1, 2)


def _survivable(p: Placement, k: int) -> int:
    # A ring of exactly `replicas` hosts fails like a group: count it as one.
    small = sum(1 for r in p.rings if len(r) == p.replicas)
    rings = [len(r) for r in p.rings if len(r) > p.replicas]
    return _counting.survivable(len(p.groups) + small, rings, p.replicas, k)


def _check_k(p: Placement, k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= p.hosts:
        raise PlacementError(f"k: expected the number of failed hosts, an int in 0..{p.hosts}, got {k!r}")
    return k


def _failed_set(p: Placement, failed: Iterable[int]) -> frozenset[int]:
    try:
        dead = frozenset(failed)
    except TypeError:
        raise PlacementError(f"failed: expected an iterable of host ids, got {type(failed).__name__}") from None
    bad = sorted(
        (h for h in dead if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < p.hosts),
        key=repr,
    )
    if bad:
        raise PlacementError(f"failed: hosts must be ints in 0..{p.hosts - 1}, got {bad!r}")
    return dead


def _iter_fatal(p: Placement, k: int) -> Iterator[tuple[int, ...]]:
    """Depth-first, lexicographic walk over k-sets that contain a minimal fatal set.

    A prefix C (largest element l, r picks left) is extended by x only if some
    minimal set S can still be completed: S has no element <= l outside C, none in
    (l, x), and its t elements above l fit in the picks left (t <= r - 1 if x is
    below them, t <= r if x is the first of them).  Also x <= n - r, so r - 1 larger
    hosts remain.  Every prefix walked therefore yields at least one fatal set.
    """
    n, m = p.hosts, p.replicas
    sets = minimal_fatal_sets(p)
    containing: list[list[int]] = [[] for _ in range(n)]
    for i, s in enumerate(sets):
        for h in s:
            containing[h].append(i)
    minima = sorted({s[0] for s in sets})
    hit = [0] * len(sets)
    full = 0
    chosen: list[int] = []

    def candidates(last: int, left: int) -> Iterator[int]:
        top = n - left
        reach = last  # every x in (last, reach] is a valid next pick
        points: set[int] = set()
        for c in chosen:
            for i in containing[c]:
                s = sets[i]
                below = bisect_right(s, last)
                if hit[i] != below:
                    continue  # S has an element <= last that was skipped
                t = m - below
                if t <= left - 1:
                    reach = max(reach, s[below])
                elif t == left:
                    points.add(s[below])
        untouched: Iterable[int] = ()
        if m <= left - 1 and minima and minima[-1] > last:
            reach = max(reach, minima[-1])
        elif m == left:
            untouched = minima[bisect_right(minima, last) :]
        merged = heapq.merge(range(last + 1, min(reach, top) + 1), sorted(points), untouched)
        previous = last
        for x in merged:
            if x > top:
                break
            if x > previous:
                previous = x
                yield x

    def add(x: int, step: int) -> int:
        nonlocal full
        for i in containing[x]:
            hit[i] += step
            if step > 0 and hit[i] == m:
                full += 1
            elif step < 0 and hit[i] == m - 1:
                full -= 1
        return x

    if k == 0:
        return
    stack = [candidates(-1, k)]
    while stack:
        x = next(stack[-1], None)
        if x is None:
            stack.pop()
            if chosen:
                add(chosen.pop(), -1)
            continue
        chosen.append(add(x, +1))
        left = k - len(chosen)
        if full:
            # Already fatal: every completion is, in lexicographic order.
            prefix = tuple(chosen)
            for rest in itertools.combinations(range(x + 1, n), left):
                yield prefix + rest
            add(chosen.pop(), -1)
        elif left:
            stack.append(candidates(x, left))
        else:
            add(chosen.pop(), -1)
