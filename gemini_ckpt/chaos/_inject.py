"""Striking: the faults of a scenario at its moment (kill, remove, corrupt, hold a vote, cut
the storage), and waiting until the cluster knows."""

from __future__ import annotations

import os
import time
from typing import Any

from ._harness import Harness
from ._memory import damage_copy
from ._jobrun import JobRun
from ._results import (
    HarnessError,
    infrastructure,
)
from ._faults import (
    CorruptDurable,
    CorruptReplica,
    KillStore,
    KillWorker,
    RemoveHosts,
)
from ._phases import STORE_PHASES
from ._spec import (
    ChaosConfig,
    Scenario,
)


def store_of(namespace: str, node_id: str):
    from ..hoststore.cluster import find_store

    handle = find_store(namespace, node_id)
    if handle is None:
        raise HarnessError(f"no host store of namespace {namespace!r} on node {node_id[:12]}")
    return handle


def _corrupt_replica(namespace: str, node_id: str, step: int, rank: int, nan: bool = False) -> int:
    """Flip a byte in the middle of the biggest tensor item of that store's copy of rank
    ``rank``'s shard (every tensor item is read at restore); with ``nan``, write a NaN over the
    first value of the biggest floating-point item instead."""
    import ray

    from ..format.finite import NAN_BITS
    from ..format.shards import ShardPlan

    handle = store_of(namespace, node_id)
    held = ray.get(handle.shard_info.remote(step, [rank]), timeout=30)
    if rank not in held:
        raise HarnessError(f"the host store on node {node_id[:12]} holds no copy of rank {rank}'s shard of step {step}")
    tensors = ShardPlan.decode(held[rank][0]).tensors
    if nan:
        item = max((t for t in tensors if t.dtype in NAN_BITS and t.nbytes), key=lambda t: t.nbytes, default=None)
        if item is None:
            raise HarnessError(f"rank {rank}'s shard of step {step} has no floating-point item to poison")
        return damage_copy(handle, step, rank, item.at, NAN_BITS[item.dtype])
    item = max(tensors, key=lambda t: t.nbytes)
    return damage_copy(handle, step, rank, item.at + item.nbytes // 2)


def ray_get(ref, timeout: float = 30.0):
    import ray

    return ray.get(ref, timeout=timeout)


def _corrupt_file(path: str) -> int:
    with open(path, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        i = fh.tell() // 2
        fh.seek(i)
        b = fh.read(1)
        fh.seek(i)
        fh.write(bytes([b[0] ^ 0xFF]))
    return i


def let_go(
    s: Scenario,
    h: Harness,
    cfg: ChaosConfig,
    hosts: tuple[int, ...],
    in_flight: dict[int, Any],
    namespace: str,
    grace_s: float = 3.0,
) -> dict[int, Any]:
    """Release the ranks held at the fault's phase and collect what their in-flight step did.

    Survivors whose peers died sit in a collective until the process group's timeout; they are
    not waited for (the restart replaces them). Rank 0 is waited for when it may still be
    persisting the version in flight, so the durable tier ends up as the prediction assumes."""
    dead = s.dead_ranks(hosts)  # their hosts already run replacement workers
    alive = {r: hosts[r] for r in range(len(hosts)) if r not in dead and hosts[r] in h.pool.workers}
    if s.at.phase in STORE_PHASES and hosts[s.at.rank] not in s.failed_slots():
        # The held vote goes out only once the registry knows of every store the faults took:
        # then the coordinator decides with that knowledge, as it would had the vote been slower.
        _wait_known_dead(namespace, s.failed_slots(), timeout=cfg.timeout_s)
        try:
            ray_get(store_of(namespace, h.sim.node_id(hosts[s.at.rank])).release_vote.remote())
        except Exception:  # noqa: BLE001 - the store died with its host: nothing to let go
            pass
    h.pool.collect({r: h.pool.workers[x].release.remote() for r, x in alive.items()}, timeout=10)
    out = h.pool.collect(in_flight, timeout=grace_s)
    persisting = s.at.phase in ("committed", "persist", "persist_commit") and cfg.persisted_by_policy(s.at.step)
    if persisting and 0 in alive and isinstance(out.get(0), TimeoutError):
        out.update(h.pool.collect({0: in_flight[0]}, timeout=cfg.timeout_s + 30))
    for r, v in out.items():
        if isinstance(v, TimeoutError) and r in alive:
            h.pool.forget(alive[r])  # stuck with a dead peer: replaced at the restart
    return out


def _wait_known_dead(namespace: str, slots, timeout: float) -> None:
    from ..hoststore.cluster import find_registry

    registry = find_registry(namespace)
    deadline = time.monotonic() + timeout
    while slots and registry is not None and time.monotonic() < deadline:
        table = ray_get(registry.table.remote()) or {}
        if set(slots) <= set(table.get("dead", ())):
            return
        time.sleep(0.2)


def wait_paused(h: Harness, host: int, s: Scenario, in_flight: dict, timeout: float, namespace: str) -> None:
    import ray

    deadline = time.monotonic() + timeout
    worker = h.pool.workers[host]
    store = store_of(namespace, h.sim.node_id(host)) if s.at.phase in STORE_PHASES else None
    while time.monotonic() < deadline:
        try:
            if store is not None:
                held = ray.get(store.held.remote(), timeout=10)
                state = {"step": held, "phase": s.at.phase} if held is not None else None
            else:
                state = ray.get(worker.paused.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            state = None
        if state and state["step"] == s.at.step and state["phase"] == s.at.phase:
            return
        done, _ = ray.wait(list(in_flight.values()), num_returns=len(in_flight), timeout=0)
        if len(done) == len(in_flight):
            outcome = h.pool.collect(in_flight, timeout=1)
            raise HarnessError(f"phase {s.at.phase!r} of step {s.at.step} never ran on rank {s.at.rank}: {outcome}")
        time.sleep(0.1)
    raise HarnessError(f"rank {s.at.rank} did not reach phase {s.at.phase!r} of step {s.at.step} within {timeout}s")


def inject(
    s: Scenario, h: Harness, job: JobRun, hosts: tuple[int, ...], committed: list[int], persisted: list[int]
) -> tuple[dict, set]:
    """Apply the faults; returns what was corrupted (memory: step -> owner -> slots; durable steps)."""
    import ray

    from ..hoststore.cluster import find_store
    from ..durable.layout import data_file_name, step_dir_name

    corrupt_memory: dict[int, dict[int, set]] = {}
    corrupt_durable: set[int] = set()
    for fault in s.faults:
        if isinstance(fault, CorruptReplica):
            if not committed:
                raise HarnessError(f"{fault!r}: no committed version to corrupt yet")
            healthy = [x for x in committed if x not in s.unhealthy_steps()]
            if not healthy:
                raise HarnessError(f"{fault!r}: no healthy committed version to corrupt yet")
            step = max(healthy)
            _corrupt_replica(job.namespace, h.sim.node_id(fault.host), step, fault.owner, nan=fault.nan)
            corrupt_memory.setdefault(step, {}).setdefault(fault.owner, set()).add(fault.host)
        elif isinstance(fault, CorruptDurable):
            if not persisted:
                raise HarnessError(f"{fault!r}: no persisted version to corrupt yet")
            step = max(persisted)
            _corrupt_file(os.path.join(job.durable_root, step_dir_name(step), data_file_name(fault.rank)))
            corrupt_durable.add(step)
    killed = tuple(hosts[rank] for fault in s.faults if isinstance(fault, KillWorker) for rank in fault.ranks)
    for host in killed:
        h.pool.sigkill(host)
    h.pool.respawn(killed)
    for fault in s.faults:
        if isinstance(fault, KillStore):
            for host in fault.hosts:
                handle = find_store(job.namespace, h.sim.node_id(host))
                if handle is not None:
                    ray.kill(handle, no_restart=True)
    first = tuple(x for f in s.faults if isinstance(f, RemoveHosts) and f.at_fault for x in f.hosts)
    later = [f for f in s.faults if isinstance(f, RemoveHosts) and f.during_rereplication]
    from ..hoststore.cluster import find_registry

    registry = find_registry(job.namespace) if later else None
    if registry is not None:
        ray_get(registry.hold_rereplication.remote())
    try:
        if first:
            _remove(
                h,
                first,
                tuple(x for f in s.faults if isinstance(f, RemoveHosts) and f.replace and f.at_fault for x in f.hosts),
            )
        for f in later:
            # The stores have noticed the first losses: re-replication would be under way now.
            slots = {hosts.index(x) for x in first}
            _wait(
                lambda: slots <= {e["slot"] for e in ray_get(registry.recovery.remote())},
                h.config.timeout_s,
                f"the host stores to notice the loss of hosts {list(first)}",
            )
            _remove(h, f.hosts, f.hosts if f.replace else ())
    finally:
        if registry is not None:
            ray_get(registry.release_rereplication.remote())
    return corrupt_memory, corrupt_durable


def _remove(h: Harness, removed: tuple[int, ...], replaced: tuple[int, ...]) -> None:
    with infrastructure(f"removing hosts {list(removed)} and adding replacements"):
        h.sim.remove_hosts(removed)
        for host in removed:
            h.pool.forget(host)
        for host in replaced:
            h.sim.add_host(host)
        h.pool.respawn(replaced)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
