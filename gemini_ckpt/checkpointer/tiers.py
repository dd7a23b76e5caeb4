"""What ``Checkpointer.start()`` builds: the memory tier, the durable tier's persister, the warm-up,
and the start's one collective (:func:`start_survey`).

The memory tier is a process-local store (``store="local"``) or the connection to the host
stores (``store="ray"``; Ray is imported only then). With a durable tier, rank 0 cleans up what
an earlier run left incomplete, and the :class:`~gemini_ckpt.durable.writer.Persister` starts.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..collective import everyones
from ..errors import ConfigError
from ..lineage import survey
from ..restore.newest import take_survey
from ..durable.writer import Persister
from ..results import CheckpointStats
from ..retention import KeepNewest
from ..stores.base import MemoryTier
from ..durable.tier import DurableTier
from ..stores.memory import local_store
from ..settings import SaveSettings, Settings
from ..signing import ENV_KEY

log = logging.getLogger("gemini_ckpt")


def warm_up() -> None:
    """The one-time costs of a new process (a thread's target; failures only logged)."""
    from ..trust.metadata import warm_up as warm_up_trust

    try:
        warm_up_trust()
    except Exception as exc:  # noqa: BLE001 - only an optimization
        log.debug("warm-up failed: %s: %s", type(exc).__name__, exc)


def make_store(settings: Settings, *, rank: int, world_size: int) -> MemoryTier:
    if not settings.store.named and settings.store.key is not None:
        # a signature binds the namespace: every job left on the default one would accept the others' versions
        raise ConfigError(
            f"a signing key (CheckpointConfig.signing_key or ${ENV_KEY}) needs an explicit CheckpointConfig.namespace: "
            f"a signature binds the namespace, and every job left on the default one "
            f"({settings.namespace!r}) with the same key would accept the others' signed versions as its own. "
            f"Set namespace= to a name this run and its restarts alone use (gray.checkpointer names it after the "
            f"Ray Train run)"
        )
    if settings.local:
        if world_size > 1:
            raise ConfigError(
                f"CheckpointConfig.store='local' keeps versions in one process, but this job has "
                f"{world_size} ranks; use store='ray' (host stores) for multi-process jobs"
            )
        return local_store(settings.namespace).attach(keep=KeepNewest(settings.store.keep))
    from ..hoststore.client import connect  # Ray is imported only when it is used

    return connect(settings.store, rank=rank, world_size=world_size)


def job_description(save: SaveSettings, *, world_size: int) -> dict:
    from .._version import __version__

    return {
        "namespace": save.namespace,
        "world_size": world_size,
        "replicas": save.replicas,
        "placement": save.placement,
        "gemini_ckpt": __version__,
        "torch": torch.__version__,
    }


def start_persister(
    durable: DurableTier,
    store: MemoryTier,
    settings: Settings,
    stats: CheckpointStats,
    *,
    rank: int,
    world_size: int,
    run_id: str,
    on_error: Callable[[BaseException], None],
) -> Persister:
    """Clean up incomplete versions (rank 0) and start the durable tier's writer."""
    if rank == 0:
        try:
            durable.cleanup_incomplete()
        except OSError as exc:
            # Memory may hold everything needed; persists will report the outage.
            log.warning(
                "durable tier %s is not reachable at start (%s: %s); incomplete versions are cleaned up next time",
                durable.uri,
                type(exc).__name__,
                exc,
            )
    persister = Persister(
        durable,
        store,
        rank=rank,
        world_size=world_size,
        timeout_s=settings.durable.timeout_s,
        key=settings.durable.key,
        run_id=run_id,
        job=job_description(settings.save, world_size=world_size),
        stats=stats,
        on_error=on_error,
    )
    persister.start()
    return persister


def start_survey(tiers: list, restoring: Optional[tuple], run_id: str, *, rank: int, world_size: int, group):
    """The start's one collective: ``(rank 0's run id, the steps the tiers hold, the restore's
    survey or None)`` on every rank. The run id names this job's persist outcomes in the
    rendezvous store. ``restoring``: ``(step,)`` when ``restore(step)`` starts the Checkpointer;
    rank 0 then takes the restore's survey (:func:`~gemini_ckpt.restore.newest.take_survey`) and
    it is returned when every rank asked for the same restore, so that the restore needs no
    survey round of its own (None otherwise: it surveys again, and raises on different steps)."""
    surveyed, existing = None, ()
    if rank == 0 and restoring is not None:
        surveyed = take_survey(tiers, world_size=world_size)
        existing = tuple(sorted(step for step, _ in surveyed[0]))
    elif rank == 0:
        existing = survey(tiers[0], tiers[1] if len(tiers) > 1 else None)
    if world_size == 1:
        return run_id, existing, surveyed
    everyone = everyones((run_id, existing, surveyed, restoring), world_size=world_size, group=group)
    run_id, existing, surveyed, _ = everyone[0]
    agreed = restoring is not None and all(ask == restoring for *_, ask in everyone)
    return run_id, existing, surveyed if agreed else None
