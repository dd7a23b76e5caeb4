"""Persist with failover: the host stores write a version's data files from their memory, each
rank's file by a store holding an intact copy, the owner's host first (so each host writes its
own ranks' shards) and the next holder when one fails. Used by
:meth:`~gemini_ckpt.hoststore.ray_tier.RayTier.persist_files`.
"""

from __future__ import annotations

import concurrent.futures

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..errors import ReplicationError
from ..durable.layout import data_file_name
from .hosts import HostStores
from .resolve import Resolved


def persist_files(
    hosts: HostStores, step: int, where: Resolved, uri: str, directory: str, sections: dict[int, bytes], opener=None
) -> dict:
    """Have the live ``hosts`` that hold ``step`` (``where``) write its data files, in parallel:
    rank -> what the writing store returned; ReplicationError when no store could write a
    rank's file. ``opener``: the URI's backend, sent along (None: pyarrow's own)."""

    def write(rank: int) -> list:
        problems = []
        for slot in sorted(where.copies[rank], key=lambda s: s != _owner(where, rank)):
            handle = hosts.live().get(slot)
            if handle is None:
                continue
            try:
                return ray.get(
                    handle.persist_shard.remote(
                        step, rank, uri, directory, data_file_name(rank), sections[rank], opener
                    ),
                    timeout=hosts.settings.timeout_s,
                )
            except RayActorError:
                hosts.mark_dead(slot, "died while persisting")
                problems.append(f"{hosts.describe(slot)} died")
            except (RayTaskError, GetTimeoutError) as exc:
                cause = getattr(exc, "cause", exc)
                problems.append(f"{hosts.describe(slot)}: {type(cause).__name__}: {cause}")
        raise ReplicationError(f"step {step}: no host store could write rank {rank}'s file: " + "; ".join(problems))

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, max(1, where.world_size))) as pool:
        futures = {rank: pool.submit(write, rank) for rank in range(where.world_size)}
        return {rank: fut.result() for rank, fut in futures.items()}


def _owner(where: Resolved, rank: int) -> int:
    copies = where.copies[rank]
    return copies[0] if copies else -1
