"""Slots: which host is which to placement, and where a version goes when hosts have died.

**Slots.** Placement works on hosts ``0..N-1`` ("slots"), which must mean the same nodes to
every rank and stay stable for the job. The registry (a small detached actor on the head
node) assigns them at a rendezvous: every rank joins with its node id; once all
``world_size`` ranks have joined, nodes that have no slot yet get one, in the order of the
lowest rank they host (slot 0 is rank 0's host). A node that joins later (a replacement
machine) takes over the lowest slot whose node is dead; only if there is none is a slot
appended. Slots are never renumbered, so holders of older versions stay where they were.

**Dead holders.** :func:`holders_for` is the rule for where a version goes: the placement's
holders of the owner's slot, with each dead slot replaced by the next live slot after the
owner in ring order that is not already a holder. Hosts whose holders are all alive keep
their placement; fewer than ``replicas`` live slots is an error (a version counts only when
every copy is acknowledged). A slot is dead for a rank once its store fails to answer (or did
not exist when the rank connected). A store that dies while its node lives is not replaced
during a run: the ranks of that host create a fresh one when they connect again (a job
restart), as does :func:`start_host_stores`.

**Failure domains.** With ``CheckpointConfig(failure_domain="rack")`` the registry reads each
slotted node's ``rack`` label at the rendezvous (:func:`node_domains`) and publishes one domain
per slot with the table (:attr:`SlotTable.domains`; a node without the label is its own
domain, with a warning). :func:`placement_for` is then ``placement.make(..., domains=...)``: each
host's copies in different domains wherever the hosts allow it (``python -m placement show
--domains ...`` draws the same placement), and a dead holder is replaced by the next live slot
after the owner in a domain the other copies do not use yet. When there are fewer (live)
domains than ``replicas``, a warning, once, and the rule without domains. With no domains, or
every slot in its own domain, the placement is exactly the one without domains.

**The host label.** A node started with the label :data:`HOST_LABEL` (``ray start --labels
gemini-ckpt.io/host=3``; :class:`~gemini_ckpt.testing.cluster.LocalCluster` sets it on every simulated
host) names the host it is. Ray Train can then place rank ``r`` on the same host after every
restart (:func:`gemini_ckpt.ray_train.ranks_on_hosts`), and a replacement started with a dead
host's label takes over that host's slot: the registry gives its store the dead host's copies
before the new workers start, so the rank placed there restores from local memory.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import placement

from ..errors import ConfigError

HOST_LABEL = "gemini-ckpt.io/host"
"""The Ray node label that names a host (a machine of the job): ``"0"``, ``"1"``, ..."""

log = logging.getLogger("gemini_ckpt")
_warned: set = set()  # the domain warnings given in this process (each once)


@dataclass(frozen=True)
class SlotTable:
    """Slot ``i`` is the host with Ray node id ``nodes[i]``; ``epoch`` counts rendezvous."""

    namespace: str
    nodes: tuple[str, ...]
    epoch: int = 0
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> node id, at the last rendezvous
    domains: Optional[tuple[Optional[str], ...]] = None  # slot -> failure domain (None: no failure_domain)

    @classmethod
    def from_registry(cls, namespace: str, data: dict) -> "SlotTable":
        domains = data.get("domains")  # absent from a registry of before failure domains
        return cls(
            namespace,
            tuple(data["nodes"]),
            data["epoch"],
            dict(data.get("ranks", {})),
            None if domains is None else tuple(domains),
        )

    @property
    def hosts(self) -> int:
        return len(self.nodes)

    def slot_of(self, node_id: str) -> int:
        try:
            return self.nodes.index(node_id)
        except ValueError:
            raise LookupError(f"node {node_id[:12]} has no slot in namespace {self.namespace!r}") from None


def node_domains(
    nodes: Sequence[str], labels: Mapping[str, Mapping[str, str]], label: Optional[str]
) -> Optional[tuple[Optional[str], ...]]:
    """Each slot's failure domain: the value of node label ``label`` of the slot's node
    (``labels``: node id -> its Ray labels), None where the node has no such label (it is its
    own domain: :func:`unlabelled` says so). None when ``label`` is None (no failure domains)."""
    if label is None:
        return None
    return tuple((labels.get(node) or {}).get(label) for node in nodes)


def unlabelled(nodes: Sequence[str], domains: Optional[Sequence[Optional[str]]], label: Optional[str]) -> str:
    """The warning for slots whose node has no ``label`` label ("" when every one has)."""
    if label is None or domains is None:
        return ""
    missing = [f"slot {s} (node {nodes[s][:12]})" for s, d in enumerate(domains) if d is None]
    if not missing:
        return ""
    return (
        f"CheckpointConfig.failure_domain={label!r}: {', '.join(missing)} has no {label!r} node label, so "
        f"each is a failure domain of its own; start such nodes with `ray start --labels {label}=...`"
    )


def placement_for(
    *, hosts: int, replicas: int, strategy: str = "auto", domains: Optional[Sequence[Optional[str]]] = None
) -> placement.Placement:
    """The placement of a job's slots (no host dead): ``placement.make(strategy, ..., domains=...)``
    over the slots' failure domains (a slot with domain None is a domain of its own), or without
    domains when there are none, every slot is its own, or there are fewer than ``replicas``
    (then a warning, once). The chaos predictor and ``placement report --domains`` use the same.

    >>> placement_for(hosts=4, replicas=2, strategy="group", domains=["a", "a", "b", "b"]).holders(0)
    (0, 2)
    """
    return _placement(hosts, replicas, strategy, _labels(domains, hosts, replicas))


def holders_for(
    slot: int,
    *,
    hosts: int,
    replicas: int,
    strategy: str = "auto",
    dead: Iterable[int] = (),
    domains: Optional[Sequence[Optional[str]]] = None,
    retired: Iterable[int] = (),
) -> tuple[int, ...]:
    """The slots that keep ``slot``'s shards of the next version (see the module docstring).

    ``retired``: slots the job's epoch formed without (their hosts were dead at its rendezvous: an
    elastic run went on without them). A live slot's copies then follow the placement made over
    the other slots, as if the job had been started on them (the copies spread evenly over the
    hosts left), its dead holders replaced as above; a retired slot's own shards (re-replicated
    after its loss) keep the rule above. Fewer such slots than ``replicas``: as many copies as
    there are slots, with a warning, once.

    >>> holders_for(2, hosts=4, replicas=2, strategy="group")
    (2, 3)
    >>> holders_for(2, hosts=4, replicas=2, strategy="group", dead={3})
    (2, 0)
    >>> holders_for(2, hosts=4, replicas=2, strategy="group", domains=["a", "a", "b", "b"])
    (2, 0)
    >>> holders_for(3, hosts=4, replicas=2, dead={1}), holders_for(3, hosts=4, replicas=2, dead={1}, retired={1})
    ((3, 2), (3, 0))
    """
    dead, retired = frozenset(dead), frozenset(retired) - {slot}
    if retired and len(retired) < hosts:
        live = [s for s in range(hosts) if s not in retired]
        if len(live) < replicas:
            _warn_once(
                ("retired", len(live), replicas),
                f"the job runs on {len(live)} host(s) now, fewer than CheckpointConfig.replicas={replicas}: each "
                f"version keeps {len(live)} copies in memory until hosts join again",
            )
        inner = holders_for(
            live.index(slot),
            hosts=len(live),
            replicas=min(replicas, len(live)),
            strategy=strategy,
            dead={live.index(s) for s in dead if s in live},
            domains=None if domains is None else [domains[s] for s in live],
        )
        return tuple(live[i] for i in inner)
    if replicas > hosts:
        raise ConfigError(
            f"CheckpointConfig.replicas={replicas} needs {replicas} hosts but the job spans {hosts}; "
            f"lower replicas to at most {hosts} or run on more hosts"
        )
    labels = _labels(domains, hosts, replicas)
    base = _placement(hosts, replicas, strategy, labels).holders(slot)
    chosen = [h for h in base if h not in dead]
    ring = [(slot + k) % hosts for k in range(1, hosts)]
    if labels is not None and len(chosen) < replicas:
        # First the next live slots in domains none of the copies uses yet.
        used = {labels[h] for h in chosen}
        for candidate in ring:
            if len(chosen) >= replicas:
                break
            if candidate not in dead and candidate not in chosen and labels[candidate] not in used:
                chosen.append(candidate)
                used.add(labels[candidate])
        if len(chosen) < replicas:
            live = sorted({str(_shown(labels[h])) for h in range(hosts) if h not in dead})
            _warn_once(
                ("few-live", labels, replicas, tuple(live)),
                f"failure domains: only {len(live)} domain(s) with live hosts ({', '.join(live)}) for "
                f"CheckpointConfig.replicas={replicas}: some copies share a domain until the dead hosts "
                f"are replaced; add hosts in other domains or lower replicas",
            )
    for candidate in ring:
        if len(chosen) >= replicas:
            break
        if candidate not in dead and candidate not in chosen:
            chosen.append(candidate)
    if len(chosen) < replicas:
        live = hosts - len(dead)
        raise ConfigError(
            f"only {live} of {hosts} host stores are alive but CheckpointConfig.replicas={replicas}; "
            f"restart the dead hosts' stores (start_host_stores) or lower replicas"
        )
    return tuple(chosen)


def _labels(domains: Optional[Sequence[Optional[str]]], hosts: int, replicas: int) -> Optional[tuple[Hashable, ...]]:
    """The domains as placement labels (a slot without one gets a label of its own), or None
    where they change nothing (none given, every slot its own) or cannot be honoured (fewer
    domains than replicas: a warning, once)."""
    if domains is None:
        return None
    if len(domains) != hosts:
        raise ConfigError(f"failure domains: got {len(domains)} for {hosts} slots; give one per slot")
    labels = tuple(("no label", s) if d is None else d for s, d in enumerate(domains))
    distinct = len(set(labels))
    if distinct == hosts:
        return None
    if distinct < replicas:
        shown = sorted({str(_shown(d)) for d in labels})
        _warn_once(
            ("few", labels, replicas),
            f"failure domains: {replicas} copies of each shard (CheckpointConfig.replicas) but the job's "
            f"{hosts} hosts are in only {distinct} domain(s) ({', '.join(shown)}): copies cannot all be in "
            f"different domains, so they follow slot order as without failure_domain; run on hosts in at "
            f"least {replicas} domains or lower replicas",
        )
        return None
    return labels


@functools.lru_cache(maxsize=64)
def _placement(hosts: int, replicas: int, strategy: str, labels: Optional[tuple]) -> placement.Placement:
    p = placement.make(strategy, hosts=hosts, replicas=replicas, domains=labels)
    clashes = placement.domain_violations(p)
    if clashes:
        _warn_once(
            ("clash", labels, replicas, strategy),
            f"failure domains: no {p.strategy} placement of {replicas} copies over these hosts' domains keeps "
            f"the copies of slot(s) {list(clashes)} in different domains (a domain holds too many of the "
            f"job's hosts); `python -m placement show --domains ...` draws it; spread the hosts more evenly",
        )
    return p


def _shown(label: Hashable) -> Hashable:
    return f"slot {label[1]} (no label)" if isinstance(label, tuple) else label


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
