"""What ``Checkpointer.start()`` builds: the memory tier, the durable tier's persister, the warm-up.

The memory tier is a process-local store (``store="local"``) or the connection to the host
stores (``store="ray"``; Ray is imported only then). With a durable tier, rank 0 cleans up what
an earlier run left incomplete, and the :class:`~gemini_ckpt.durable.writer.Persister` starts.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import ConfigError
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
