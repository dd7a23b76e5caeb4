"""Placement strategies: which hosts keep a copy of each host's shards.

Every strategy is a list of disjoint *cells* over the hosts:

- a **group** of exactly ``replicas`` hosts: every member holds the whole group;
- a **ring** of ``replicas`` or more hosts: each member's copies live on itself and
  the next ``replicas - 1`` members, wrapping inside the ring.

``group`` placement is all groups, ``ring`` is one ring of every host, ``mixed`` is
groups plus one remainder ring of ``replicas + hosts % replicas`` hosts.  The planner
counts failures per cell, so this one shape serves every strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from . import _domains
from ._errors import PlacementError

__all__ = ["LAYOUTS", "STRATEGIES", "Placement", "domain_violations", "make"]

#: The strategies that lay copies out themselves (the one list of their names).
LAYOUTS = ("group", "ring", "mixed")
#: Strategy names accepted by :func:`make`; ``auto`` resolves to group or mixed.
STRATEGIES = (*LAYOUTS, "auto")

_GROUP, _RING = "group", "ring"


@dataclass(frozen=True, repr=False)
class Placement:
    """Where each host's shards are kept in memory.  Build one with :func:`make`.

    Hosts are the ints ``0 .. hosts-1``.  ``groups`` and ``rings`` are the cells
    (see the module docstring); ``domains`` holds one failure-domain label per host
    when the placement was built to spread copies over domains.

    >>> p = make("group", hosts=16, replicas=2)
    >>> p.holders(3), p.held_by(3)
    ((3, 2), (3, 2))
    """

    strategy: str
    hosts: int
    replicas: int
    groups: tuple[tuple[int, ...], ...] = ()
    rings: tuple[tuple[int, ...], ...] = ()
    domains: tuple[Hashable, ...] | None = None
    # host -> (cell, index in cell); holders are derived on demand so that building
    # a placement stays O(hosts) even when replicas is in the thousands.
    _where: tuple[tuple[tuple[int, ...], int, bool], ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("hosts", self.hosts, minimum=1, fix="pass the number of hosts")
        _check_int("replicas", self.replicas, minimum=1, fix="use 1 (local copy only) or more")
        groups = tuple(tuple(sorted(g)) for g in self.groups)
        rings = tuple(tuple(r) for r in self.rings)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "rings", rings)
        m = self.replicas
        for g in groups:
            if len(g) != m:
                raise PlacementError(
                    f"groups: group {g} has {len(g)} hosts but replicas={m}; "
                    "every group must have exactly `replicas` hosts"
                )
        for r in rings:
            if len(r) < m:
                raise PlacementError(
                    f"rings: ring {r} has {len(r)} hosts but replicas={m}; a ring needs at least `replicas` hosts"
                )
        seen = sorted(h for cell in groups + rings for h in cell)
        if seen != list(range(self.hosts)):
            raise PlacementError(f"groups/rings: cells must cover hosts 0..{self.hosts - 1} exactly once")
        if self.domains is not None:
            object.__setattr__(self, "domains", _check_domains(self.domains, self.hosts))

        where: list[tuple[tuple[int, ...], int, bool]] = [((), 0, False)] * self.hosts
        for g in groups:
            for i, h in enumerate(g):
                where[h] = (g, i, True)
        for r in rings:
            for i, h in enumerate(r):
                where[h] = (r, i, False)
        object.__setattr__(self, "_where", tuple(where))

    def holders(self, host: int) -> tuple[int, ...]:
        """The hosts keeping ``host``'s shards: ``host`` itself first, then its peers.

        >>> make("ring", hosts=5, replicas=3).holders(4)
        (4, 0, 1)
        """
        cell, i, is_group = self._where[self._host(host)]
        if is_group:
            return (host, *cell[:i], *cell[i + 1 :])
        n = len(cell)
        return tuple(cell[(i + j) % n] for j in range(self.replicas))

    def held_by(self, host: int) -> tuple[int, ...]:
        """The hosts whose shards ``host`` keeps: ``host`` itself first, then ascending.

        >>> make("ring", hosts=5, replicas=3).held_by(0)
        (0, 3, 4)
        """
        cell, i, is_group = self._where[self._host(host)]
        if is_group:
            return (host, *cell[:i], *cell[i + 1 :])
        # In a ring, host i holds the shards of the replicas - 1 hosts before it.
        n = len(cell)
        return (host, *sorted(cell[(i - j) % n] for j in range(1, self.replicas)))

    def _host(self, host: int) -> int:
        if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < self.hosts:
            raise PlacementError(f"host: expected an int in 0..{self.hosts - 1}, got {host!r}")
        return host

    def __repr__(self) -> str:
        extra = "" if self.domains is None else f", domains={len(set(self.domains))} labels"
        return f"Placement(strategy={self.strategy!r}, hosts={self.hosts}, replicas={self.replicas}{extra})"


def make(
    strategy: str = "auto",
    *,
    hosts: int,
    replicas: int,
    domains: Sequence[Hashable] | None = None,
) -> Placement:
    """Build a placement of ``replicas`` in-memory copies over ``hosts`` hosts.

    ``strategy`` is ``group`` (consecutive groups of ``replicas`` hosts; needs
    ``replicas`` to divide ``hosts``), ``ring`` (each host's next ``replicas - 1``
    hosts), ``mixed`` (groups, with the last group and the leftover hosts as one
    ring) or ``auto`` (group when it fits, else mixed; ``.strategy`` tells which).
    ``domains`` gives each host a failure-domain label (e.g. its rack); copies are
    then spread so no two copies of a host share a domain whenever that is possible.

    >>> make("group", hosts=16, replicas=2).holders(3)
    (3, 2)
    >>> make("mixed", hosts=5, replicas=2).holders(4)
    (4, 2)
    >>> make("auto", hosts=5, replicas=2).strategy
    'mixed'
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PlacementError(
            f"strategy: unknown strategy {strategy!r}; use one of " + ", ".join(repr(s) for s in STRATEGIES)
        )
    _check_int("hosts", hosts, minimum=1, fix="pass the number of hosts")
    _check_int("replicas", replicas, minimum=1, fix="use 1 (local copy only) or more")
    if replicas > hosts:
        raise PlacementError(
            f"replicas: {replicas} copies need {replicas} distinct hosts but hosts={hosts}; "
            f"lower replicas to at most {hosts} or add hosts"
        )
    labels = None if domains is None else _check_domains(domains, hosts)
    if strategy == "auto":
        strategy = _GROUP if hosts % replicas == 0 else "mixed"
    if strategy == _GROUP and hosts % replicas:
        raise PlacementError(
            f"strategy: 'group' needs replicas ({replicas}) to divide hosts ({hosts}); "
            "use strategy='mixed' (or 'auto') to place the leftover hosts in a ring"
        )

    cells = _LAYOUTS[strategy](hosts, replicas)
    sizes = [size for _, size in cells]
    if labels is None:
        members, start = [], 0
        for size in sizes:
            members.append(list(range(start, start + size)))
            start += size
    else:
        members = _domains.arrange(labels, sizes, [s // replicas for s in sizes])
    return Placement(
        strategy=strategy,
        hosts=hosts,
        replicas=replicas,
        groups=tuple(tuple(c) for (kind, _), c in zip(cells, members) if kind == _GROUP),
        rings=tuple(tuple(c) for (kind, _), c in zip(cells, members) if kind == _RING),
        domains=labels,
    )


def domain_violations(p: Placement) -> tuple[int, ...]:
    """Hosts with two of their copies in one failure domain (empty without domains).

    ``make`` only leaves such hosts when no arrangement avoids them, e.g. when a
    domain holds more hosts than there are groups, or fewer domains than replicas.

    >>> racks = ["a"] * 4 + ["b"] * 4
    >>> domain_violations(make("group", hosts=8, replicas=2, domains=racks))
    ()
    """
    if p.domains is None:
        return ()
    return _domains.clashing_hosts([p.holders(h) for h in range(p.hosts)], p.domains)


# Each layout lists its cells as (kind, size), in host order.
def _group_layout(n: int, m: int) -> list[tuple[str, int]]:
    return [(_GROUP, m)] * (n // m)


def _ring_layout(n: int, m: int) -> list[tuple[str, int]]:
    return [(_RING, n)]


def _mixed_layout(n: int, m: int) -> list[tuple[str, int]]:
    # The paper's choice: whole groups while they fit; the last group absorbs the
    # leftover hosts and, being too big to be a group, becomes a small ring.
    if n % m == 0:
        return _group_layout(n, m)
    return [(_GROUP, m)] * (n // m - 1) + [(_RING, m + n % m)]


_LAYOUTS: dict[str, Callable[[int, int], list[tuple[str, int]]]] = {
    "group": _group_layout,
    "ring": _ring_layout,
    "mixed": _mixed_layout,
}


def _check_int(name: str, value: object, *, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise PlacementError(f"{name}: must be >= {minimum}, got {value}; {fix}")


def _check_domains(domains: object, hosts: int) -> tuple[Hashable, ...]:
    if isinstance(domains, (str, bytes)) or not isinstance(domains, Sequence):
        raise PlacementError(
            f"domains: expected a sequence of {hosts} labels (one per host), got {type(domains).__name__}"
        )
    if len(domains) != hosts:
        raise PlacementError(
            f"domains: got {len(domains)} labels for hosts={hosts}; give exactly one domain label per host"
        )
    try:
        for label in domains:
            hash(label)
    except TypeError:
        raise PlacementError("domains: labels must be hashable (e.g. rack names)") from None
    return tuple(domains)
