"""The host stores of a namespace as one rank sees them: each slot's actor handle, which ones
are unusable (and why), one call on every live store at once, and what an actor's exception
means in the library's terms (:func:`cause`). The tier's writes, reads, persist and discards
(:class:`~gemini_ckpt.hoststore.ray_tier.RayTier`) share one :class:`HostStores`, so a store found dead
by one is skipped by all.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..settings import StoreSettings
from ..errors import (
    CheckpointError,
    CheckpointTimeoutError,
    FencedError,
    MemoryBudgetError,
    ReplicationError,
    VersionNotFoundError,
)
from .cluster import find_store
from .slots import SlotTable

log = logging.getLogger("gemini_ckpt")


class HostStores:
    """The slots' host stores and their liveness, for rank ``rank``: a store that died, or that
    was gone at the rendezvous (``dead``), is left out of every call and reported to the
    ``registry`` once."""

    def __init__(self, settings: StoreSettings, *, rank: int, table: SlotTable, registry, dead: set[int]) -> None:
        self.settings, self.rank, self.table = settings, rank, table
        self._registry = registry
        self._lock = threading.Lock()
        self._handles = {s: find_store(settings.namespace, n) for s, n in enumerate(table.nodes)}
        self._dead: dict[int, str] = {s: "gone at the rendezvous" for s in dead}
        self._dead.update({s: "no host store" for s, h in self._handles.items() if h is None})
        self._retired = frozenset(dead)

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def dead_at_rendezvous(self) -> frozenset:
        """The slots this epoch formed without (see ``holders_for(retired=...)``)."""
        return self._retired

    def live(self) -> dict[int, Any]:
        with self._lock:
            return {s: h for s, h in self._handles.items() if s not in self._dead and h is not None}

    def mark_dead(self, slot: int, why: str) -> None:
        with self._lock:
            if slot in self._dead:
                return
            self._dead[slot] = why
        log.warning(
            "rank %d: host store of slot %d (node %s) is unusable: %s",
            self.rank,
            slot,
            self.table.nodes[slot][:12],
            why,
        )
        if self._registry is not None:
            self._registry.suspect.remote(slot, f"rank {self.rank}: {why}")

    def gather(self, method: str, *args) -> dict[int, Any]:
        """Call ``method`` on every live store in parallel; slot -> result (stores that died
        are marked, ones that do not answer in time are left out)."""
        calls = {s: getattr(h, method).remote(*args) for s, h in self.live().items()}
        deadline = time.monotonic() + self.settings.timeout_s
        out = {}
        for slot, ref in calls.items():
            try:
                out[slot] = ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
            except RayActorError as exc:
                self.mark_dead(slot, f"died ({type(exc).__name__})")
            except RayTaskError as exc:
                raise cause(exc, f"{self.describe(slot)}: ") from None
            except GetTimeoutError:
                log.warning(
                    "rank %d: %s did not answer %s within %ss",
                    self.rank,
                    self.describe(slot),
                    method,
                    self.settings.timeout_s,
                )
        return out

    def describe(self, slot: int) -> str:
        why = self._dead.get(slot)
        return f"slot {slot} on node {self.table.nodes[slot][:12]}" + (f", {why}" if why else "")


def cause(exc: RayTaskError, prefix: str = "") -> BaseException:
    """The library's exception for what an actor raised (actors raise built-ins), with
    ``prefix`` in front of its message."""
    cause = getattr(exc, "cause", None)
    message = prefix + str(cause if cause is not None else exc)
    if isinstance(cause, PermissionError):
        return FencedError(message)
    if isinstance(cause, CheckpointError):
        return type(cause)(message)
    if isinstance(cause, MemoryError):
        return MemoryBudgetError(message)
    if isinstance(cause, LookupError):
        return VersionNotFoundError(message)
    if isinstance(cause, TimeoutError):
        return CheckpointTimeoutError(message)
    if isinstance(cause, ValueError):
        return ValueError(message)
    return ReplicationError(f"{prefix}{type(cause).__name__ if cause else 'error'}: {cause or exc}")
