"""The registry: one small actor per namespace, on the head node.

- **Slots.** The rendezvous (:meth:`Registry.join`) assigns host slots (the rule is in
  :mod:`gemini_ckpt.hoststore.slots`) and opens a new *epoch*: which slots are dead (their node or
  store is gone) and which are idle (no rank this time) are fixed for the epoch, so every
  participant builds the same commit tree.
- **The coordinator** of the commit protocol (:class:`~gemini_ckpt.commit.Coordinator`):
  the root of every version's tree and the one that decides COMMIT (:meth:`commit_message`).
  The versions it committed are carried into the next epoch, so a store that voted and
  never heard the decision learns it when the job comes back.
- **Liveness.** It pings the epoch's live stores every second, and at once when a store
  reports a peer it could not reach (:meth:`suspect`); a store that is gone is announced to
  the coordinator and to every live store (``peer_dead``), once per death, not per version.
- The namespace's **secret** (the data plane's and the attach channel's), handed to ranks at
  the rendezvous, and the failures and slot events ``gemini_ckpt status`` shows.

An async actor: ``join`` waits for the whole world, the liveness loop is a task.

:class:`Registry` is a facade: the coordinator and liveness are its own; the rendezvous
(:mod:`.rendezvous`) and the work after a host is lost (:mod:`.recovery`) are collaborators, all
sharing one :class:`~.registry_state.RegistryState` in named parts (slots, the job's terms,
commits, re-replication, reports).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import ray

from ...commit import COORDINATOR, Send
from ..names import ACTOR_ENV, RAY_NAMESPACE, registry_name
from .host_store import configure_logging
from .recovery import Recovery
from ...timeouts import TIMEOUTS
from .registry_state import MAX_REPORTS, RegistryState
from .rendezvous import Rendezvous

log = logging.getLogger("gemini_ckpt")


class Registry:
    """Slots, the commit coordinator and liveness of one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
        configure_logging()
        self.namespace = namespace
        state = RegistryState(namespace)
        self.slots, self.terms, self.commits, self.rerep, self.reports = state.parts()
        self.recovery_work = Recovery(state)
        self.rendezvous = Rendezvous(state, self.recovery_work)
        self._watch: Optional[asyncio.Task] = None

    # --- the rendezvous ----------------------------------------------------------------------------
    async def join(self, *args, **kwargs) -> dict:
        """:meth:`Rendezvous.join` (its arguments); the first one starts watching the stores."""
        table = await self.rendezvous.join(*args, **kwargs)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_event_loop().create_task(self._watch_stores())
        return table

    def table(self) -> Optional[dict]:
        return self.rendezvous.table()

    # --- the coordinator ---------------------------------------------------------------------------
    async def commit_message(self, message) -> None:
        """A vote or a query from a store (fire-and-forget)."""
        coordinator = self.commits.coordinator
        if coordinator is None or message.version.epoch != self.slots.epoch:
            return
        self.commits.started.setdefault(message.version, time.monotonic())
        self._apply(coordinator.on_message(message))

    def _apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send) and a.to != COORDINATOR:
                handle = self.slots.store(a.to)
                if handle is not None:
                    handle.commit_message.remote(a.message)

    def committed(self) -> list[list[int]]:
        """The versions the coordinator committed (newest ``keep``), as ``[epoch, step]``."""
        if self.commits.coordinator is None:
            return []
        return [[v.epoch, v.step] for v in self.commits.coordinator.committed_versions()]

    def _time_out(self) -> None:
        coordinator = self.commits.coordinator
        if coordinator is None:
            return
        limit = 0.8 * self.terms.timeout_s  # before the stores' own timeout, so the decision arrives first
        now = time.monotonic()
        for version in coordinator.pending():
            started = self.commits.started.setdefault(version, now)
            if now - started > limit:
                self._apply(coordinator.on_timeout(version))

    # --- liveness ------------------------------------------------------------------------------------
    async def suspect(self, slot: int, why: str) -> None:
        """A store could not reach ``slot``'s store: check now (it may just be busy)."""
        if slot in self.slots.dead or not 0 <= slot < len(self.slots.nodes):
            return
        if not await self._alive(slot):
            self._died(slot, why)

    async def _alive(self, slot: int) -> bool:
        from ray.exceptions import GetTimeoutError, RayActorError

        handle = self.slots.store(slot)
        if handle is None:
            return False
        try:
            await asyncio.wait_for(handle.ping.remote(), timeout=TIMEOUTS.ping_s)
            return True
        except RayActorError:
            return False
        except (asyncio.TimeoutError, GetTimeoutError):
            return True  # busy, not known dead

    def _died(self, slot: int, why: str) -> None:
        if slot in self.slots.dead:
            return
        self.slots.dead.add(slot)
        message = f"the host store of slot {slot} (node {self.slots.nodes[slot][:12]}) is gone ({why})"
        log.error("registry %s: %s", self.namespace, message)
        self.report_failure(slot, self.slots.nodes[slot], message)
        self.rerep.timeline.append({"slot": slot, "node_id": self.slots.nodes[slot], "noticed": time.time()})
        self.rerep.change()
        del self.rerep.timeline[:-MAX_REPORTS]
        self.rerep.pending = True
        if self.commits.coordinator is not None:
            self._apply(self.commits.coordinator.on_peer_dead(slot))
        for other in range(len(self.slots.nodes)):
            if other not in self.slots.dead:
                handle = self.slots.store(other)
                if handle is not None:
                    handle.peer_dead.remote(slot)

    async def _watch_stores(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUTS.ping_every_s if not self.rerep.pending else TIMEOUTS.ping_every_s / 4)
            try:
                for slot in range(len(self.slots.nodes)):
                    if slot not in self.slots.dead and not await self._alive(slot):
                        self._died(slot, "it stopped answering")
                self._time_out()
                if self.slots.dead:
                    self.recovery_work.note_deaths()
                    if not self.rerep.held:
                        await self.recovery_work.adopt_replacements()
                if self.rerep.pending and not self.rerep.held:
                    await self.recovery_work.rereplicate()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one failure
                log.warning("registry %s: liveness check failed: %s: %s", self.namespace, type(exc).__name__, exc)

    # --- after a host is lost: replacements and re-replication (see .recovery) ------------------------
    def hold_rereplication(self) -> None:
        """Fault injection (the chaos harness): make no copies and adopt no replacement until
        :meth:`release_rereplication`, so a second failure can land inside that window."""
        self.recovery_work.hold()

    def release_rereplication(self) -> None:
        self.recovery_work.release()

    def recovery(self) -> list[dict]:
        """Per host lost (newest last), when (unix seconds): ``noticed`` by the stores,
        ``node_dead`` as Ray declared it, ``rereplicated`` (the newest committed version back to
        ``replicas`` copies), ``replacement_joined`` and ``replacement_seeded`` (its store holds
        the dead host's copies of it), and the ``slot``, ``node_id`` and ``replacement`` node
        (see ``Recovery.timeline``)."""
        return self.recovery_work.timeline()

    # --- status ------------------------------------------------------------------------------------
    def report_failure(self, slot: int, node_id: str, message: str) -> None:
        self.reports.report_failure(slot, node_id, message)

    def failures(self) -> list[dict]:
        return list(self.reports.failures)

    def events(self) -> list[dict]:
        return list(self.reports.events)


def get_or_create_registry(namespace: str):
    """The registry of ``namespace`` (created, detached, on the head node, on first use).
    The actors import ``gemini_ckpt`` (which imports nothing heavy: never torch)."""
    try:  # the usual case, a registry that exists: one lookup, not an actor class built and shipped again
        return ray.get_actor(registry_name(namespace), namespace=RAY_NAMESPACE)
    except ValueError:
        pass
    return (
        ray.remote(Registry)
        .options(
            name=registry_name(namespace),
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=0,
            num_cpus=0,
            runtime_env={"env_vars": ACTOR_ENV},
            resources={"node:__internal_head__": 0.001},
        )
        .remote(namespace)
    )
