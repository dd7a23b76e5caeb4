"""The registry: one small actor per namespace, on the head node.

- **Slots.** The rendezvous (:meth:`Registry.join`) assigns host slots (the rule is in
  :mod:`gemini_ckpt.ray.slots`) and opens a new *epoch*: which slots are dead (their node or
  store is gone) and which are idle (no rank this time) are fixed for the epoch, so every
  participant builds the same commit tree.
- **The coordinator** of the commit protocol (:class:`~gemini_ckpt.ray.commit.Coordinator`):
  the root of every version's tree and the one that decides COMMIT (:meth:`commit_message`).
  The versions it committed are carried into the next epoch, so a store that voted and
  never heard the decision learns it when the job comes back.
- **Liveness.** It pings the epoch's live stores every second, and at once when a store
  reports a peer it could not reach (:meth:`suspect`); a store that is gone is announced to
  the coordinator and to every live store (``peer_dead``), once per death, not per version.
- The namespace's **secret** (the data plane's and the attach channel's), handed to ranks at
  the rendezvous, and the failures and slot events ``gemini_ckpt status`` shows.

An async actor: ``join`` waits for the whole world, the liveness loop is a task.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..commit import COORDINATOR, Coordinator, Send

log = logging.getLogger("gemini_ckpt")

_MAX_REPORTS = 50  # failure reports and events kept for status
PING_EVERY_S = 1.0
PING_TIMEOUT_S = 5.0


def alive_node_ids() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


@dataclass
class _Round:
    pending: dict[int, str] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    table: Optional[dict] = None


class Registry:
    """Slots, the commit coordinator and liveness of one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
        from .host_store import configure_logging

        configure_logging()
        self.namespace = namespace
        self._nodes: list[str] = []
        self._epoch = 0
        self._round: Optional[_Round] = None
        self._failures: list[dict] = []
        self._events: list[dict] = []
        self._secret = os.urandom(32).hex()
        self._coordinator: Optional[Coordinator] = None
        self._started: dict[Any, float] = {}  # version -> when the coordinator first heard of it
        self._timeout_s = 300.0
        self._dead: set[int] = set()
        self._idle: frozenset = frozenset()
        self._handles: dict[int, Any] = {}
        self._watch: Optional[asyncio.Task] = None

    # --- the rendezvous ----------------------------------------------------------------------------
    async def join(self, rank: int, world_size: int, node_id: str, timeout_s: float, keep: int = 2) -> dict:
        """Rendezvous of all ranks; returns the slot table every rank of this round shares:
        ``nodes``, ``epoch``, ``ranks`` (rank -> node), ``dead`` and ``idle`` slots, the versions
        committed so far, and the namespace's ``secret``."""
        if self._round is None:
            self._round = _Round()
        rnd = self._round
        rnd.pending[rank] = node_id
        rnd.params = {"keep": keep, "timeout_s": timeout_s}
        for stale in [r for r in rnd.pending if r >= world_size]:
            del rnd.pending[stale]
        if all(r in rnd.pending for r in range(world_size)):
            rnd.table = await self._open_epoch(rnd.pending, rnd.params)
            self._round = None
            rnd.done.set()
        else:
            try:
                await asyncio.wait_for(rnd.done.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                missing = sorted(set(range(world_size)) - set(rnd.pending))
                raise TimeoutError(
                    f"rank {rank}: ranks {missing} of {world_size} did not connect to the host stores of "
                    f"namespace {self.namespace!r} within {timeout_s}s (CheckpointConfig.timeout_s); every "
                    f"rank must build its Checkpointer and save/restore") from None
        return rnd.table

    async def _open_epoch(self, pending: dict[int, str], params: dict) -> dict:
        self._assign(pending)
        self._epoch += 1
        hosting = set(pending.values())
        alive = set(alive_node_ids())
        dead = set()
        for slot, node in enumerate(self._nodes):
            if node not in alive or (node not in hosting and not await self._store_exists(node)):
                dead.add(slot)
        idle = frozenset(s for s, n in enumerate(self._nodes) if n not in hosting and s not in dead)
        committed = self._coordinator.committed_versions() if self._coordinator is not None else ()
        keep = int(params.get("keep", 2))
        self._coordinator = Coordinator(hosts=len(self._nodes), keep=keep, dead=dead, idle=idle,
                                        committed=committed, world_size=len(pending))
        self._dead, self._idle, self._handles, self._started = set(dead), idle, {}, {}
        self._timeout_s = float(params.get("timeout_s", 300.0))
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_event_loop().create_task(self._watch_stores())
        return {"nodes": list(self._nodes), "epoch": self._epoch, "ranks": dict(pending), "secret": self._secret,
                "dead": sorted(dead), "idle": sorted(idle),
                "committed": [[v.epoch, v.step] for v in committed]}

    async def _store_exists(self, node: str) -> bool:
        from ..cluster import find_store

        return find_store(self.namespace, node) is not None

    def _assign(self, pending: dict[int, str]) -> None:
        first_rank: dict[str, int] = {}
        for rank, node in sorted(pending.items()):
            first_rank.setdefault(node, rank)
        new = [n for n in sorted(first_rank, key=first_rank.get) if n not in self._nodes]
        if new:
            alive = set(alive_node_ids())
            free = [i for i, n in enumerate(self._nodes) if n not in alive]
            for node in new:
                if free:
                    slot = free.pop(0)
                    self._event(f"node {node[:12]} took over slot {slot} of dead node {self._nodes[slot][:12]}")
                    self._nodes[slot] = node
                else:
                    self._nodes.append(node)
                    self._event(f"node {node[:12]} got slot {len(self._nodes) - 1}")

    def table(self) -> Optional[dict]:
        if not self._nodes:
            return None
        return {"nodes": list(self._nodes), "epoch": self._epoch, "ranks": {}, "dead": sorted(self._dead),
                "idle": sorted(self._idle)}

    # --- the coordinator ---------------------------------------------------------------------------
    async def commit_message(self, message) -> None:
        """A vote or a query from a store (fire-and-forget)."""
        coordinator = self._coordinator
        if coordinator is None or message.version.epoch != self._epoch:
            return
        self._started.setdefault(message.version, time.monotonic())
        self._apply(coordinator.on_message(message))

    def _apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send) and a.to != COORDINATOR:
                handle = self._store(a.to)
                if handle is not None:
                    handle.commit_message.remote(a.message)

    def _store(self, slot: int):
        handle = self._handles.get(slot)
        if handle is None and 0 <= slot < len(self._nodes):
            from ..cluster import find_store

            handle = self._handles[slot] = find_store(self.namespace, self._nodes[slot])
        return handle

    def committed(self) -> list[list[int]]:
        """The versions the coordinator committed (newest ``keep``), as ``[epoch, step]``."""
        if self._coordinator is None:
            return []
        return [[v.epoch, v.step] for v in self._coordinator.committed_versions()]

    # --- liveness ------------------------------------------------------------------------------------
    async def suspect(self, slot: int, why: str) -> None:
        """A store could not reach ``slot``'s store: check now (it may just be busy)."""
        if slot in self._dead or not 0 <= slot < len(self._nodes):
            return
        if not await self._alive(slot):
            self._died(slot, why)

    async def _alive(self, slot: int) -> bool:
        from ray.exceptions import GetTimeoutError, RayActorError

        handle = self._store(slot)
        if handle is None:
            return False
        try:
            await asyncio.wait_for(handle.ping.remote(), timeout=PING_TIMEOUT_S)
            return True
        except RayActorError:
            return False
        except (asyncio.TimeoutError, GetTimeoutError):
            return True  # busy, not known dead

    def _died(self, slot: int, why: str) -> None:
        if slot in self._dead:
            return
        self._dead.add(slot)
        message = f"the host store of slot {slot} (node {self._nodes[slot][:12]}) is gone ({why})"
        log.error("registry %s: %s", self.namespace, message)
        self.report_failure(slot, self._nodes[slot], message)
        if self._coordinator is not None:
            self._apply(self._coordinator.on_peer_dead(slot))
        for other in range(len(self._nodes)):
            if other not in self._dead:
                handle = self._store(other)
                if handle is not None:
                    handle.peer_dead.remote(slot)

    async def _watch_stores(self) -> None:
        while True:
            await asyncio.sleep(PING_EVERY_S)
            try:
                for slot in range(len(self._nodes)):
                    if slot not in self._dead and not await self._alive(slot):
                        self._died(slot, "it stopped answering")
                self._time_out()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one failure
                log.warning("registry %s: liveness check failed: %s", self.namespace, exc)

    def _time_out(self) -> None:
        coordinator = self._coordinator
        if coordinator is None:
            return
        limit = 0.8 * self._timeout_s  # before the stores' own timeout, so the decision arrives first
        now = time.monotonic()
        for version in coordinator.pending():
            started = self._started.setdefault(version, now)
            if now - started > limit:
                self._apply(coordinator.on_timeout(version))

    # --- status ------------------------------------------------------------------------------------
    def report_failure(self, slot: int, node_id: str, message: str) -> None:
        self._failures.append({"unix": time.time(), "slot": slot, "node_id": node_id, "message": message})
        del self._failures[:-_MAX_REPORTS]

    def failures(self) -> list[dict]:
        return list(self._failures)

    def events(self) -> list[dict]:
        return list(self._events)

    def _event(self, message: str) -> None:
        log.info("registry %s: %s", self.namespace, message)
        self._events.append({"unix": time.time(), "message": message})
        del self._events[:-_MAX_REPORTS]
