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

**The host label.** A node started with the label :data:`HOST_LABEL` (``ray start --labels
gemini-ckpt.io/host=3``; :class:`~gemini_ckpt.ray.local.LocalCluster` sets it on every simulated
host) names the host it is. Ray Train can then place rank ``r`` on the same host after every
restart (:func:`gemini_ckpt.ray_train.ranks_on_hosts`), and a replacement started with a dead
host's label takes over that host's slot: the registry gives its store the dead host's copies
before the new workers start, so the rank placed there restores from local memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import placement

from ..errors import ConfigError

HOST_LABEL = "gemini-ckpt.io/host"
"""The Ray node label that names a host (a machine of the job): ``"0"``, ``"1"``, ..."""


@dataclass(frozen=True)
class SlotTable:
    """Slot ``i`` is the host with Ray node id ``nodes[i]``; ``epoch`` counts rendezvous."""

    namespace: str
    nodes: tuple[str, ...]
    epoch: int = 0
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> node id, at the last rendezvous

    @classmethod
    def from_registry(cls, namespace: str, data: dict) -> "SlotTable":
        return cls(namespace, tuple(data["nodes"]), data["epoch"], dict(data.get("ranks", {})))

    @property
    def hosts(self) -> int:
        return len(self.nodes)

    def slot_of(self, node_id: str) -> int:
        try:
            return self.nodes.index(node_id)
        except ValueError:
            raise LookupError(f"node {node_id[:12]} has no slot in namespace {self.namespace!r}") from None


def holders_for(slot: int, *, hosts: int, replicas: int, strategy: str = "auto",
                dead: Iterable[int] = ()) -> tuple[int, ...]:
    """The slots that keep ``slot``'s shards of the next version (see the module docstring).

    >>> holders_for(2, hosts=4, replicas=2, strategy="group")
    (2, 3)
    >>> holders_for(2, hosts=4, replicas=2, strategy="group", dead={3})
    (2, 0)
    """
    dead = frozenset(dead)
    if replicas > hosts:
        raise ConfigError(
            f"CheckpointConfig.replicas={replicas} needs {replicas} hosts but the job spans {hosts}; "
            f"lower replicas to at most {hosts} or run on more hosts")
    base = placement.make(strategy, hosts=hosts, replicas=replicas).holders(slot)
    chosen = [h for h in base if h not in dead]
    for k in range(1, hosts):
        if len(chosen) >= replicas:
            break
        candidate = (slot + k) % hosts
        if candidate not in dead and candidate not in chosen:
            chosen.append(candidate)
    if len(chosen) < replicas:
        live = hosts - len(dead)
        raise ConfigError(
            f"only {live} of {hosts} host stores are alive but CheckpointConfig.replicas={replicas}; "
            f"restart the dead hosts' stores (start_host_stores) or lower replicas")
    return tuple(chosen)
