"""``store="ray"``: connecting one rank to its namespace's host stores.

Call :func:`connect` on every rank (``Checkpointer.start`` does): it is the rendezvous that
fixes the host slots and opens the epoch, which fences an earlier attempt's writes, and it
returns the rank's memory tier (:class:`~gemini_ckpt.hoststore.ray_tier.RayTier`).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from .. import attempts
from ..errors import AttemptInterruptedError, CheckpointTimeoutError, ConfigError
from ..settings import StoreSettings
from .actors.state import store_config
from .attach_client import AttachClient
from .cluster import (
    current_node_id,
    ensure_ray,
    get_or_create_registry,
    get_or_create_store,
)
from .hosts import cause
from .ray_tier import RayTier
from .slots import SlotTable, placement_for, unlabelled

log = logging.getLogger("gemini_ckpt")


def connect(settings: StoreSettings, *, rank: int, world_size: int) -> RayTier:
    """Connect rank ``rank`` of ``world_size`` to its namespace's host stores.

    Collective: every rank of the job calls it (``Checkpointer.start`` does, at the first
    ``save``/``restore``); it returns once all have, with the slot table they share. Creates
    the registry and this host's store when they do not exist yet. ``settings``: the
    ``CheckpointConfig``'s part for host stores (:func:`gemini_ckpt.settings.store_settings`).
    """
    if not settings.named:
        raise ConfigError(
            "CheckpointConfig.namespace is required with store='ray' outside Ray Train: host stores are "
            "reachable by every job on the Ray cluster, and a job must not restore (or drop) another's "
            "versions. Name this job's versions, e.g. CheckpointConfig(namespace='lm-7'); a restarted job "
            "uses the same name to find them. (gemini_ckpt.integrations.ray_train uses the run name.)"
        )
    ensure_ray()
    namespace = settings.namespace
    node_id = current_node_id()
    registry = get_or_create_registry(namespace)
    store = get_or_create_store(settings.namespace, node_id, settings.budget_bytes)
    alive = store.ping.remote()  # answered while this rank waits for the others in the join
    # What the registry needs to bring versions back to `replicas` copies after a host is lost.
    job = settings.job()
    attempt = attempts.current()  # an in-place runner's attempt: its ranks join as one generation
    generation = attempt.generation if attempt is not None else None
    joining = registry.join.remote(
        rank, world_size, node_id, settings.timeout_s, settings.keep, job, generation=generation
    )
    store = _start_local_store(settings, node_id, store, alive)
    joined = _joined(joining, settings, rank=rank, attempt=attempt)
    table = SlotTable.from_registry(namespace, joined)
    if table.hosts < settings.replicas:
        raise ConfigError(
            f"CheckpointConfig.replicas={settings.replicas} needs {settings.replicas} hosts but this job's "
            f"ranks run on {table.hosts}; lower replicas to at most {table.hosts} or use more hosts"
        )
    if rank == 0:
        warning = unlabelled(table.nodes, table.domains, settings.failure_domain)
        if warning:
            log.warning(warning)
        placement_for(
            hosts=table.hosts, replicas=settings.replicas, strategy=settings.placement, domains=table.domains
        )  # warns here, once, when the domains cannot be honoured
    epoch = store_config(
        job,
        epoch=table.epoch,
        slot=table.slot_of(node_id),
        nodes=tuple(table.nodes),
        ranks_here=tuple(sorted(int(r) for r, n in joined["ranks"].items() if n == node_id)),
        world_size=world_size,
        keep=settings.keep,
        timeout_s=settings.timeout_s,
        dead=frozenset(joined["dead"]),
        idle=frozenset(joined["idle"]),
        committed=tuple(tuple(v) for v in joined["committed"]),
        secret=joined["secret"],
        domains=table.domains,
    )
    try:
        attached = ray.get(store.attach.remote(table.epoch, epoch), timeout=settings.timeout_s)
    except RayTaskError as exc:
        raise cause(exc, f"rank {rank}: ") from None
    secret = bytes.fromhex(joined["secret"])
    channel = AttachClient(attached["attach"], secret, rank=rank, epoch=table.epoch, timeout_s=settings.timeout_s)
    tier = RayTier(
        settings,
        rank=rank,
        world_size=world_size,
        node_id=node_id,
        table=table,
        registry=registry,
        secret=secret,
        attach=channel,
        dead=set(joined["dead"]),
    )
    tier.recovery_events = tuple(joined.get("recovery", ()))
    return tier


JOIN_LOOK_S = 0.1  # within an in-place attempt: how often the join's wait looks whether the attempt ended
WITHDRAW_S = 1.0  # how long an ended attempt's rank waits for the registry to confirm its join withdrawn


def _joined(joining, settings: StoreSettings, *, rank: int, attempt: Optional[attempts.Attempt]) -> dict:
    """The rendezvous' answer. Within an in-place attempt the wait ends as soon as the attempt
    does (a peer failed while this rank waited for the others: no cut connection ends a Ray call),
    and the join is withdrawn from the registry."""
    namespace = settings.namespace
    deadline = time.monotonic() + settings.timeout_s + 10
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GetTimeoutError()
            if attempt is None:
                return ray.get(joining, timeout=left)
            if attempt.interrupted.is_set():
                try:  # the registry withdraws this rank's join (see Rendezvous.join), before the next attempt's
                    ray.cancel(joining)
                    ray.wait([joining], timeout=WITHDRAW_S)
                except Exception as exc:  # noqa: BLE001 - a newer generation's join discards it anyway
                    log.debug("rank %d: withdrawing the join: %s", rank, exc)
                raise AttemptInterruptedError(
                    f"rank {rank}: a newer round was asked for while this rank waited for the others at the "
                    f"host stores' rendezvous of namespace {namespace!r}: this attempt ends here"
                )
            ready, _ = ray.wait([joining], timeout=min(JOIN_LOOK_S, left))
            if ready:
                return ray.get(joining)
    except RayTaskError as exc:
        raise cause(exc) from None
    except GetTimeoutError:
        raise CheckpointTimeoutError(
            f"rank {rank}: the registry of namespace {namespace!r} did not answer within {settings.timeout_s}s"
        ) from None


def _start_local_store(settings: StoreSettings, node_id: str, handle, alive):
    """``handle`` once its ping (``alive``) is answered; a store killed a moment ago may still
    hold its name, so until a live one answers: another lookup (a new store), another ping."""
    deadline = time.monotonic() + settings.timeout_s
    while True:
        try:
            ray.get(alive, timeout=max(0.1, deadline - time.monotonic()))
            return handle
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            handle = get_or_create_store(settings.namespace, node_id, settings.budget_bytes)
            alive = handle.ping.remote()
        except GetTimeoutError:
            raise CheckpointTimeoutError(
                f"the host store on node {node_id[:12]} did not start within "
                f"{settings.timeout_s}s (CheckpointConfig.timeout_s)"
            ) from None
