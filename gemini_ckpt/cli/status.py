"""What the host stores hold: :func:`cluster_status` and ``python -m gemini_ckpt status``.

Read-only: asks the registry and every host store of a namespace (actors in the Ray namespace
``gemini_ckpt``) and the Ray GCS which nodes are alive. A version's ``state`` follows the
rule restore uses (:mod:`gemini_ckpt.hoststore.resolve`):

- ``committed``: a live store committed it and every rank's shard has a complete copy on a
  live store;
- ``lost``: it was committed, but some shard has no live copy left;
- ``pending``: not committed (being replicated now, or a save that failed).

Each version's ``health`` is what the stores say of its state (``healthy``, ``unhealthy`` with
the reason, ``unchecked``; see :mod:`gemini_ckpt.health`): an unhealthy committed version is
kept for inspection only, never restored unless named.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class HostStatus:
    """One host store (or one slot whose store is gone)."""

    slot: Optional[int]  # None: a store whose node never joined a rendezvous (a spare)
    node_id: str
    node_alive: bool
    store_alive: bool
    versions: tuple[int, ...] = ()
    own_shards: int = 0
    replica_shards: int = 0
    held_bytes: int = 0  # bytes of the shards kept
    reserved_bytes: int = 0  # memory the store holds against its budget (incl. buffers kept for reuse)
    budget_bytes: int = 0
    error: Optional[str] = None
    footprint_bytes: int = 0  # what the job's plan will take here, computed before its first save (0: not yet)
    memory: dict = field(default_factory=dict)  # where the reserved bytes are (VersionTable.memory)
    interleave: dict = field(default_factory=dict)  # the interleaving gate's counters (docs/interleave.md)
    domain: Optional[str] = None  # the slot's failure domain at the last rendezvous (failure_domain)


@dataclass(frozen=True)
class ShardStatus:
    rank: int
    owner: Optional[int]  # the slot (host) that saved it
    nbytes: int
    copies: tuple[int, ...]  # slots holding a complete copy (owner first)


@dataclass(frozen=True)
class VersionStatus:
    step: int
    state: str  # committed | lost | pending
    shards: tuple[ShardStatus, ...]
    health: str = "unchecked"  # healthy | unhealthy | unchecked
    health_reason: str = ""  # why it is unhealthy

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclass(frozen=True)
class NamespaceStatus:
    namespace: str
    hosts: tuple[HostStatus, ...]
    versions: tuple[VersionStatus, ...]
    epoch: int = 0
    failures: tuple[dict, ...] = ()
    events: tuple[dict, ...] = ()

    @property
    def committed_steps(self) -> list[int]:
        return [v.step for v in self.versions if v.state == "committed"]

    @property
    def unhealthy_steps(self) -> list[int]:
        """Committed versions kept for inspection only: their state failed its health checks."""
        return [v.step for v in self.versions if v.state == "committed" and v.health == "unhealthy"]

    def host(self, slot: int) -> HostStatus:
        return next(h for h in self.hosts if h.slot == slot)

    def format(self) -> str:
        return _format_namespace(self)


@dataclass(frozen=True)
class ClusterStatus:
    """Returned by :func:`cluster_status`; ``to_dict()`` for scripts, ``format()`` for people."""

    namespaces: tuple[NamespaceStatus, ...] = field(default=())

    def __getitem__(self, namespace: str) -> NamespaceStatus:
        for ns in self.namespaces:
            if ns.namespace == namespace:
                return ns
        raise KeyError(f"no host stores of namespace {namespace!r}")

    def to_dict(self) -> dict:
        """Plain JSON values: a non-finite number (a rate over no time) is None, so strict
        parsers read ``status --json``."""
        return finite_json(
            {
                "namespaces": [
                    asdict(ns) | {"committed_steps": ns.committed_steps, "unhealthy_steps": ns.unhealthy_steps}
                    for ns in self.namespaces
                ]
            }
        )

    def format(self) -> str:
        if not self.namespaces:
            return "no gemini_ckpt host stores on this Ray cluster"
        return "\n\n".join(_format_namespace(ns) for ns in self.namespaces)


def finite_json(value):
    """``value`` with every NaN or infinite float (nested in dicts, lists, tuples) made None.

    >>> finite_json({"rate": float("nan"), "hosts": [1.5, float("inf")]})
    {'rate': None, 'hosts': [1.5, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def cluster_status(
    namespace: Optional[str] = None, *, address: Optional[str] = None, timeout_s: float = 10.0
) -> ClusterStatus:
    """Per host: node, slot, alive, versions, own/replica shards, bytes, budget; per version:
    committed or not and where each shard's copies are. ``namespace=None``: every namespace.

    Example::

        status = gemini_ckpt.cluster_status("run-7")
        print(status.format())
        status["run-7"].committed_steps      # [41, 42]
    """
    import os

    import ray

    from ..hoststore import cluster as _cluster

    if not ray.is_initialized():
        _cluster.ensure_ray(address or os.environ.get("RAY_ADDRESS") or "auto")
    actors = _cluster.named_actors()
    names = [namespace] if namespace is not None else sorted(actors)
    return ClusterStatus(tuple(_namespace_status(ns, actors.get(ns, {}), timeout_s) for ns in names))


def _namespace_status(namespace: str, found: dict, timeout_s: float) -> NamespaceStatus:
    import ray

    from ..hoststore import cluster as _cluster

    registry = _cluster.find_registry(namespace) if found.get("registry") else None
    table, failures, events = None, [], []
    if registry is not None:
        try:
            table, failures, events = ray.get(
                [registry.table.remote(), registry.failures.remote(), registry.events.remote()], timeout=timeout_s
            )
        except Exception:  # noqa: BLE001 - status reports what it can reach
            table = None
    slots = list(table["nodes"]) if table is not None else []
    domains = (table or {}).get("domains") or [None] * len(slots)
    nodes = slots + sorted(n for n in found.get("stores", []) if n not in slots)
    alive_nodes = set(_cluster.alive_node_ids())
    handles = {n: _cluster.find_store(namespace, n) for n in nodes}
    calls = {n: (h.describe.remote(), h.index.remote()) for n, h in handles.items() if h is not None}
    described, indexes, errors = {}, {}, {}
    deadline = time.monotonic() + timeout_s
    for node, refs in calls.items():
        try:
            described[node], indexes[node] = ray.get(list(refs), timeout=max(0.001, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - status reports what it can reach
            errors[node] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    hosts = []
    for node in nodes:
        slot = slots.index(node) if node in slots else None
        domain = domains[slot] if slot is not None and slot < len(domains) else None
        d = described.get(node)
        if d is None:
            why = errors.get(node) or "no host store"
            hosts.append(HostStatus(slot, node, node in alive_nodes, False, error=why, domain=domain))
            continue
        shards = [sh for v in d["versions"].values() for sh in v["shards"].values()]
        own = sum(1 for sh in shards if sh["owner"] == slot)
        hosts.append(
            HostStatus(
                slot,
                node,
                node in alive_nodes,
                True,
                tuple(sorted(d["versions"])),
                own,
                len(shards) - own,
                d["held_bytes"],
                d["reserved_bytes"],
                d["budget_bytes"],
                memory=d.get("memory", {}),
                footprint_bytes=d.get("footprint_bytes", 0),
                interleave=d.get("interleave", {}),
                domain=domain,
            )
        )
    by_slot = {slots.index(n): ix for n, ix in indexes.items() if n in slots}
    return NamespaceStatus(
        namespace,
        tuple(hosts),
        _versions(by_slot),
        table["epoch"] if table is not None else 0,
        tuple(failures),
        tuple(events),
    )


def _versions(index: dict[int, dict]) -> tuple[VersionStatus, ...]:
    from ..hoststore.resolve import resolve  # the rule restore uses

    out = []
    for step, resolved in resolve(index).items():
        owners, sizes = {}, {}
        for ix in index.values():
            entry = ix.get(step)
            if entry is not None and entry["epoch"] == resolved.epoch:
                for rank, shard in entry["shards"].items():
                    owners[int(rank)], sizes[int(rank)] = shard["owner"], shard["nbytes"]
        ranks = sorted(set(owners) | set(range(resolved.world_size)))
        shards = tuple(ShardStatus(r, owners.get(r), sizes.get(r, 0), resolved.copies.get(r, ())) for r in ranks)
        state = "committed" if resolved.committed else "lost" if resolved.lost else "pending"
        out.append(VersionStatus(step, state, shards, resolved.health, resolved.reason))
    return tuple(out)


# --- formatting ----------------------------------------------------------------------------------
def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _format_namespace(ns: NamespaceStatus) -> str:
    lines = [
        f"namespace {ns.namespace!r}: {sum(h.slot is not None for h in ns.hosts)} slot(s), "
        f"rendezvous epoch {ns.epoch}, committed steps {ns.committed_steps or 'none'}"
        + (f" (UNHEALTHY, kept for inspection: {ns.unhealthy_steps})" if ns.unhealthy_steps else "")
    ]
    domains = any(h.domain is not None for h in ns.hosts)  # a column only with failure domains
    rows = [
        ["slot"]
        + (["domain"] if domains else [])
        + ["node", "node", "store", "versions", "own", "replica", "held", "reserved", "footprint", "budget", "note"]
    ]
    for h in ns.hosts:
        rows.append(
            ["-" if h.slot is None else str(h.slot)]
            + ([h.domain or "-"] if domains else [])
            + [
                h.node_id[:12],
                "alive" if h.node_alive else "DEAD",
                "alive" if h.store_alive else "DEAD",
                ",".join(map(str, h.versions)) or "-",
                str(h.own_shards),
                str(h.replica_shards),
                _size(h.held_bytes),
                _size(h.reserved_bytes),
                _size(h.footprint_bytes) if h.footprint_bytes else "-",
                _size(h.budget_bytes) if h.budget_bytes else "-",
                h.error or ("spare (no ranks)" if h.slot is None else ""),
            ]
        )
    lines.append(_table(rows))
    if ns.versions:
        rows = [["step", "state", "health", "shard", "saved by slot", "bytes", "copies on slots"]]
        for v in ns.versions:
            health = "UNHEALTHY" if v.health == "unhealthy" else v.health
            for i, s in enumerate(v.shards):
                rows.append(
                    [
                        str(v.step) if i == 0 else "",
                        v.state if i == 0 else "",
                        health if i == 0 else "",
                        f"rank {s.rank}",
                        str(s.owner),
                        _size(s.nbytes),
                        ",".join(map(str, s.copies)) or "NONE",
                    ]
                )
        lines += ["", _table(rows)]
        lines += [f"step {v.step} is unhealthy: {v.health_reason}" for v in ns.versions if v.health == "unhealthy"]
    for title, items in (("events", ns.events), ("failures reported by ranks", ns.failures)):
        if items:
            lines += ["", f"{title} (latest last):"]
            lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['unix']))} {e['message']}" for e in items[-10:]]
    return "\n".join(lines)


# --- CLI -----------------------------------------------------------------------------------------
def add_status_command(subcommands: argparse._SubParsersAction) -> None:
    """Register ``status`` on the ``python -m gemini_ckpt`` parser."""
    p = subcommands.add_parser(
        "status",
        help="what the host stores of a job hold, per host and per version",
        description="Per host: node, slot, alive, versions held, own/replica shards, "
        "bytes, budget. Per version: committed or not, where each "
        "shard's copies are.",
    )
    p.add_argument("--namespace", default=None, help="CheckpointConfig.namespace of the job (default: all)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else 'auto')")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each store")
    p.set_defaults(func=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    try:
        status = cluster_status(args.namespace, address=args.address, timeout_s=args.timeout)
    except ConnectionError as exc:
        print(
            f"gemini_ckpt status: no Ray cluster to ask ({exc}). Run it on a node of the job's cluster, "
            f"or pass --address HOST:PORT (or set RAY_ADDRESS).",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(status.to_dict(), indent=2, sort_keys=True, default=str, allow_nan=False))
    else:
        print(status.format())
    return 0
