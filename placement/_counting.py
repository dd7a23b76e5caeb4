"""Exact counts of survivable failure sets, by combinatorics instead of enumeration.

A cell of a placement (see ``_strategies``) loses data exactly when ``m`` cyclically
consecutive members fail (a group of ``m`` is a ring of ``m``: "m consecutive" is the
whole group).  Cells fail independently, so the number of survivable ``k``-sets is
the ``x**k`` coefficient of the product, over cells, of each cell's generating
polynomial ``sum_j W(cell, j) x**j`` (``W`` = survivable ``j``-subsets of that cell).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb, perm

__all__ = [
    "bounded_compositions",
    "group_survivable",
    "group_survivable_range",
    "ring_survivable",
    "ring_survivable_range",
    "survivable",
]


def bounded_compositions(total: int, parts: int, cap: int) -> int:
    """Ordered ways to write ``total`` as ``parts`` integers, each in ``0..cap``.

    Inclusion–exclusion over the parts forced above ``cap``:
    ``sum_i (-1)**i C(parts, i) C(total - i*(cap+1) + parts - 1, parts - 1)``.
    """
    if parts == 0:
        return 1 if total == 0 else 0
    if total < 0 or total > parts * cap:
        return 0
    step = cap + 1
    top = total + parts - 1
    # Consecutive terms differ by small exact ratios; stepping them is far cheaper
    # than fresh comb() calls on numbers thousands of bits long.
    a, b = 1, comb(top, parts - 1)
    count = 0
    last = min(parts, total // step)
    for i in range(last + 1):
        count += -a * b if i % 2 else a * b
        if i < last:
            a = a * (parts - i) // (i + 1)
            rest = top - i * step
            b = b * perm(rest - parts + 1, step) // perm(rest, step)
    return count


def ring_survivable(size: int, window: int, failed: int) -> int:
    """``failed``-subsets of a cycle of ``size`` with no ``window`` consecutive members.

    With ``z = size - failed >= 1`` live hosts, the failed ones form ``z`` runs (one
    after each live host, going round), each shorter than ``window``.  Marking one
    live host and reading the runs from it is a bijection onto (start position, run
    lengths), so ``count * z = size * bounded_compositions(failed, z, window - 1)``.
    """
    if failed < 0 or failed > size:
        return 0
    if failed == size:  # size >= window: everything failed means data lost
        return 0
    live = size - failed
    return size * bounded_compositions(failed, live, window - 1) // live


def ring_survivable_range(size: int, window: int, lo: int, hi: int) -> list[int]:
    """``[ring_survivable(size, window, j) for j in range(lo, hi + 1)]``, cheaply.

    Same formula as :func:`ring_survivable` with ``parts = size - j`` live hosts:
    each inclusion–exclusion term ``C(size - j, i) C(size - 1 - i*window, size - j - 1)``
    steps from one ``j`` to the next by a small ratio.
    """
    lo = max(lo, 0)
    if hi < lo:
        return []
    sums = [0] * (hi - lo + 1)
    for i in range(hi // window + 1):
        top = size - 1 - i * window
        n, q = size - lo, size - lo - 1  # a = C(n, i), b = C(top, q)
        a = comb(n, i)
        b = comb(top, q) if 0 <= q <= top else 0
        sign = -1 if i % 2 else 1
        for idx in range(len(sums)):
            sums[idx] += sign * a * b
            # next j: n -> n - 1 and q -> q - 1
            a = a * (n - i) // n if n > 0 else 0
            n -= 1
            q -= 1
            if q < 0 or q > top:
                b = 0
            elif q == top:
                b = 1
            else:
                b = b * (q + 1) // (top - q)
    return [size * s // (size - j) if j < size else 0 for j, s in zip(range(lo, hi + 1), sums)]


def group_survivable(groups: int, size: int, failed: int) -> int:
    """``[x**failed] ((1 + x)**size - x**size) ** groups``: no group entirely failed.

    Expanding the power binomially in ``-x**size`` gives
    ``sum_t (-1)**t C(groups, t) C(size*(groups - t), failed - t*size)``.
    """
    if failed < 0 or failed > groups * size:
        return 0
    a, b = 1, comb(groups * size, failed)
    count = 0
    last = min(groups, failed // size)
    for t in range(last + 1):
        count += -a * b if t % 2 else a * b
        if t < last:  # C(pool - size, pick - size) from C(pool, pick)
            a = a * (groups - t) // (t + 1)
            pool, pick = size * (groups - t), failed - t * size
            b = b * perm(pick, size) // perm(pool, size)
    return count


def group_survivable_range(groups: int, size: int, lo: int, hi: int) -> list[int]:
    """``[group_survivable(groups, size, f) for f in range(lo, hi + 1)]``, cheaply.

    Each inclusion–exclusion term ``C(size*(groups-t), f - t*size)`` steps from one
    ``f`` to the next by a small ratio, so a long range costs one ``comb`` per term
    instead of one per term per ``f`` (matters when groups are few and large).
    """
    out = [0] * (hi - lo + 1)
    for t in range(min(groups, max(hi, 0) // size) + 1):
        pool, pick = size * (groups - t), lo - t * size
        a = -comb(groups, t) if t % 2 else comb(groups, t)
        b = comb(pool, pick) if pick >= 0 else 0
        for i in range(len(out)):
            out[i] += a * b
            pick += 1
            if pick == 0:
                b = 1
            elif pick > 0:
                b = b * (pool - pick + 1) // pick
    return out


def survivable(groups: int, rings: Sequence[int], window: int, failed: int) -> int:
    """Survivable ``failed``-sets of ``groups`` groups of ``window`` plus ``rings``.

    ``rings`` lists the sizes of the ring cells.  The ring cells' polynomial is
    combined with the groups' coefficients: ``sum_j ring[j] * groups[failed - j]``.
    """
    if not rings:
        return group_survivable(groups, window, failed)
    if groups == 0 and len(rings) == 1:
        return ring_survivable(rings[0], window, failed)
    # Only j with failed - j <= groups * window can pair with a survivable group part.
    lo = max(0, failed - groups * window)
    hi = min(failed, sum(rings))
    if hi < lo:
        return 0
    if len(rings) == 1:
        ring = dict(zip(range(lo, hi + 1), ring_survivable_range(rings[0], window, lo, hi)))
    else:
        poly = [1]
        for size in rings:
            cell = [ring_survivable(size, window, j) for j in range(min(size, failed) + 1)]
            poly = _convolve(poly, cell, failed)
        ring = {j: poly[j] if j < len(poly) else 0 for j in range(lo, hi + 1)}
    terms = min(groups, failed // window) + 1
    if hi - lo + 1 > terms:
        column = group_survivable_range(groups, window, failed - hi, failed - lo)
        return sum(ring[j] * column[failed - j - (failed - hi)] for j in range(lo, hi + 1))
    return sum(ring[j] * group_survivable(groups, window, failed - j) for j in range(lo, hi + 1))


def _convolve(a: list[int], b: list[int], degree: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, degree + 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b[: len(out) - i]):
                out[i + j] += x * y
    return out
