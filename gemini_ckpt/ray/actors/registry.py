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
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray

from ...errors import ConfigError
from ..commit import COORDINATOR, Coordinator, Send
from ..names import ACTOR_ENV, RAY_NAMESPACE, find_store, registry_name
from ..resolve import resolve
from ..slots import HOST_LABEL, holders_for
from .host_store import configure_logging, get_or_create_store

log = logging.getLogger("gemini_ckpt")

_MAX_REPORTS = 50  # failure reports and events kept for status
PING_EVERY_S = 1.0
PING_TIMEOUT_S = 5.0


def alive_node_ids() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def _same_kind(dead: Optional[dict], candidate: Optional[dict]) -> bool:
    """Whether a node ``candidate`` can stand in for the ``dead`` one (both as ``ray.nodes()``
    describes a node): the same resource names, apart from the ones Ray names after the node
    itself, and, when the dead node carried the host label (:data:`~gemini_ckpt.ray.slots.HOST_LABEL`),
    the same host label (the ranks pinned to that host will be placed on it)."""
    if dead is None or candidate is None:
        return False

    def names(node: dict) -> set:
        return {k for k in node.get("Resources", {})
                if not k.startswith("node:") and k not in ("memory", "object_store_memory")}

    label = (dead.get("Labels") or {}).get(HOST_LABEL)
    if label is not None and (candidate.get("Labels") or {}).get(HOST_LABEL) != label:
        return False
    return names(dead) == names(candidate)


def _node_info(node: dict) -> dict:
    return {"Resources": dict(node.get("Resources") or {}), "Labels": dict(node.get("Labels") or {})}


@dataclass
class _Round:
    pending: dict[int, str] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    table: Optional[dict] = None
    keys: dict = field(default_factory=dict)  # rank -> its signing key's fingerprint ("" for none)
    error: str = ""  # why the round was refused (every rank raises it)


def key_fingerprint(key_hex: Optional[str]) -> str:
    """A short name of a signing key that says nothing of the key ("" for none)."""
    if not key_hex:
        return ""
    return hashlib.sha256(b"gemini_ckpt key fingerprint\x00" + bytes.fromhex(key_hex)).hexdigest()[:12]


def _key_mismatch(keys: dict[int, str]) -> str:
    """Why the ranks of one rendezvous cannot go on together ("" when they agree): every rank
    signs and checks with the same key, or none does; otherwise the versions one rank writes
    are refused by another only at restore, when it is too late."""
    groups: dict[str, list[int]] = {}
    for rank, fp in sorted(keys.items()):
        groups.setdefault(fp, []).append(rank)
    if len(groups) <= 1:
        return ""
    parts = [f"ranks {ranks} " + (f"the key {fp}" if fp else "no key") for fp, ranks in sorted(groups.items())]
    return ("the ranks of this job do not share one signing key (" + "; ".join(parts) + "): set "
            "CheckpointConfig.signing_key (or $GEMINI_CKPT_SIGNING_KEY) to the same secret on every rank, "
            "or on none")


class Registry:
    """Slots, the commit coordinator and liveness of one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
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
        self._job: dict = {}
        self._keep = 2
        self._node_info: dict[str, dict] = {}  # node id -> its resources and labels, as Ray reported them
        self._rerep_pending = False
        self._rerep_held = False
        self._recovery: list[dict] = []  # what happened after each host loss, when (see recovery())
        self._epoch_opened = 0.0

    # --- the rendezvous ----------------------------------------------------------------------------
    async def join(self, rank: int, world_size: int, node_id: str, timeout_s: float, keep: int = 2,
                   job: Optional[dict] = None) -> dict:
        """Rendezvous of all ranks; returns the slot table every rank of this round shares:
        ``nodes``, ``epoch``, ``ranks`` (rank -> node), ``dead`` and ``idle`` slots, the versions
        committed so far, and the namespace's ``secret``. ``job``: the settings the registry
        needs to bring versions back to ``replicas`` copies after a host is lost (``replicas``,
        ``strategy``, the stores' ``budget``, the signing ``key``, ``bandwidth``)."""
        if self._round is None:
            self._round = _Round()
        rnd = self._round
        rnd.pending[rank] = node_id
        rnd.keys[rank] = key_fingerprint((job or {}).get("key"))
        rnd.params = {"keep": keep, "timeout_s": timeout_s}
        if job:
            self._job = dict(job)
        for stale in [r for r in rnd.pending if r >= world_size]:
            del rnd.pending[stale]
            rnd.keys.pop(stale, None)
        if all(r in rnd.pending for r in range(world_size)):
            rnd.error = _key_mismatch(rnd.keys)
            if not rnd.error:
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
        if rnd.error:
            raise ConfigError(rnd.error)
        return rnd.table

    async def _open_epoch(self, pending: dict[int, str], params: dict) -> dict:
        self._assign(pending)
        self._epoch += 1
        hosting = set(pending.values())
        self._note_nodes()
        alive = set(alive_node_ids())
        dead = set()
        for slot, node in enumerate(self._nodes):
            if node not in alive or (node not in hosting and not await self._store_exists(node)):
                dead.add(slot)
        idle = frozenset(s for s, n in enumerate(self._nodes) if n not in hosting and s not in dead)
        committed = self._coordinator.committed_versions() if self._coordinator is not None else ()
        since = [dict(e) for e in self._recovery if e["noticed"] >= self._epoch_opened]
        self._epoch_opened = time.time()
        keep = int(params.get("keep", 2))
        self._coordinator = Coordinator(hosts=len(self._nodes), keep=keep, dead=dead, idle=idle,
                                        committed=committed, world_size=len(pending))
        self._dead, self._idle, self._handles, self._started = set(dead), idle, {}, {}
        self._timeout_s = float(params.get("timeout_s", 300.0))
        self._keep = keep
        self._rerep_pending = bool(dead)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_event_loop().create_task(self._watch_stores())
        return {"nodes": list(self._nodes), "epoch": self._epoch, "ranks": dict(pending), "secret": self._secret,
                "dead": sorted(dead), "idle": sorted(idle),
                "committed": [[v.epoch, v.step] for v in committed], "recovery": since}

    async def _store_exists(self, node: str) -> bool:
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
        self._recovery.append({"slot": slot, "node_id": self._nodes[slot], "noticed": time.time()})
        del self._recovery[:-_MAX_REPORTS]
        self._rerep_pending = True
        if self._coordinator is not None:
            self._apply(self._coordinator.on_peer_dead(slot))
        for other in range(len(self._nodes)):
            if other not in self._dead:
                handle = self._store(other)
                if handle is not None:
                    handle.peer_dead.remote(slot)

    async def _watch_stores(self) -> None:
        while True:
            await asyncio.sleep(PING_EVERY_S if not self._rerep_pending else PING_EVERY_S / 4)
            try:
                for slot in range(len(self._nodes)):
                    if slot not in self._dead and not await self._alive(slot):
                        self._died(slot, "it stopped answering")
                self._time_out()
                if self._dead:
                    self._note_deaths()
                    if not self._rerep_held:
                        await self._adopt_replacements()
                if self._rerep_pending and not self._rerep_held:
                    await self._rereplicate()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one failure
                log.warning("registry %s: liveness check failed: %s: %s", self.namespace, type(exc).__name__, exc)

    # --- after a host is lost: replacements and re-replication ----------------------------------------
    def _note_nodes(self) -> None:
        for n in ray.nodes():
            if n.get("Alive"):
                self._node_info[n["NodeID"]] = _node_info(n)

    def _note_deaths(self) -> None:
        """When Ray declared each lost host's node dead (the recovery timeline)."""
        alive = None
        for event in self._recovery:
            if "node_dead" not in event:
                alive = set(alive_node_ids()) if alive is None else alive
                if event["node_id"] not in alive:
                    event["node_dead"] = time.time()

    async def _adopt_replacements(self) -> None:
        """A node that joined the cluster while a slot is dead takes that slot over now (as it
        would at the job's next rendezvous): its host store is started and given the dead host's
        copies, before the job's new workers reach ``restore()``, which then reads them locally.
        A replacement is a live node without a slot whose resources have the same names as the
        dead node's (``host3`` replaces ``host3``; GPUs replace GPUs) and, when the dead node
        carried the host label, the same label (``gemini-ckpt.io/host=3`` replaces it)."""
        if not self._job:
            return
        dead = sorted(s for s in self._dead if self._nodes[s] not in self._alive_now())
        if not dead:
            return
        taken = set(self._nodes)
        for n in ray.nodes():
            if not dead:
                break
            node = n["NodeID"]
            if not n.get("Alive") or node in taken:
                continue
            slot = next((s for s in dead if _same_kind(self._node_info.get(self._nodes[s]), n)), None)
            if slot is None:
                continue
            dead.remove(slot)
            old = self._nodes[slot]
            store = get_or_create_store(self.namespace, node, self._job.get("budget"))
            info = self._epoch_info(slot)
            try:
                await asyncio.wait_for(store.attach.remote(self._epoch, info), timeout=self._timeout_s)
            except Exception as exc:  # noqa: BLE001 - not ready yet: the next round tries again
                log.warning("registry %s: the replacement node %s for slot %d could not start its store: %s",
                            self.namespace, node[:12], slot, exc)
                continue
            self._nodes[slot] = node
            self._node_info[node] = _node_info(n)
            self._handles.pop(slot, None)
            self._dead.discard(slot)
            self._event(f"node {node[:12]} took over slot {slot} of dead node {old[:12]} (its store is given the "
                        f"dead host's copies now)")
            for event in self._recovery:
                if event["slot"] == slot and "replacement" not in event:
                    event.update(replacement=node, replacement_joined=time.time())
            self._rerep_pending = True

    def _alive_now(self) -> set[str]:
        return set(alive_node_ids())

    def _epoch_info(self, slot: int) -> dict:
        """What a store adopted outside a rendezvous is told (as ranks tell theirs in ``attach``):
        it holds copies only, this epoch."""
        committed = self._coordinator.committed_versions() if self._coordinator is not None else ()
        idle = sorted(set(self._idle) | {slot})
        return {"slot": slot, "nodes": list(self._nodes), "world_size": self._coordinator.world_size
                if self._coordinator is not None else 0, "ranks_here": [],
                "replicas": int(self._job.get("replicas", 2)), "strategy": self._job.get("strategy", "auto"),
                "keep": self._keep, "dead": sorted(self._dead - {slot}), "idle": idle,
                "committed": [[v.epoch, v.step] for v in committed], "secret": self._secret,
                "key": self._job.get("key"), "timeout_s": self._timeout_s, "bandwidth": self._job.get("bandwidth")}

    async def _rereplicate(self) -> None:
        """Bring every committed version back to ``replicas`` copies, where the placement puts
        them with the live hosts of now (:func:`~gemini_ckpt.ray.slots.holders_for`), each copy
        sent by a store that holds one. A copy becomes visible only once its new holder checked
        it, so a version is never half-copied to a reader. Runs until nothing is missing (or
        nothing missing can be fixed: no live copy)."""
        if not self._job or not self._nodes:
            self._rerep_pending = False
            return
        live = {s: self._store(s) for s in range(len(self._nodes)) if s not in self._dead}
        live = {s: h for s, h in live.items() if h is not None}
        indexes = {}
        for slot, handle in live.items():
            try:
                indexes[slot] = await asyncio.wait_for(handle.index.remote(), timeout=PING_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - busy or dead: the liveness check decides, next round
                return
        found = resolve(indexes)
        # The versions a restore may choose: committed and not unhealthy (one kept for inspection
        # is never made again).
        committed = sorted((s for s, r in found.items() if r.committed and r.health != "unhealthy"),
                           reverse=True)[: max(1, self._keep)]
        replicas, strategy = int(self._job.get("replicas", 2)), self._job.get("strategy", "auto")
        sends = []
        for step in committed:
            where = found[step]
            owners = {int(r): e["shards"][r]["owner"] for ix in indexes.values() if step in ix
                      for e in [ix[step]] for r in e["shards"] if e["epoch"] == where.epoch}
            for rank, slots in where.copies.items():
                owner = owners.get(rank)
                if owner is None:
                    continue
                try:
                    want = holders_for(owner, hosts=len(self._nodes), replicas=replicas, strategy=strategy,
                                       dead=self._dead)
                except Exception:  # noqa: BLE001 - too few live hosts for the copies asked: nothing to do
                    continue
                for target in [h for h in want if h not in slots and h in live]:
                    source = slots[len(sends) % len(slots)]  # spread the sending over the holders
                    sends.append((step, rank, source, target))
        if not sends:
            self._rerep_pending = False
            self._rereplicated()
            return
        endpoints = {}
        for _, _, _, target in sends:
            if target not in endpoints:
                endpoints[target] = await asyncio.wait_for(live[target].endpoint.remote(), timeout=PING_TIMEOUT_S)
        t0 = time.time()
        results = await asyncio.gather(*[asyncio.wait_for(live[source].send_copy.remote(step, rank, endpoints[target]),
                                                          timeout=self._timeout_s)
                                         for step, rank, source, target in sends], return_exceptions=True)
        failed = [(send, r) for send, r in zip(sends, results) if isinstance(r, BaseException)]
        moved = sum(r for r in results if isinstance(r, int))
        self._event(f"re-replicated {len(sends) - len(failed)} of {len(sends)} copies ({moved / 1e6:.1f} MB) in "
                    f"{time.time() - t0:.2f}s" + (f"; failed: {failed[0][1]}" if failed else ""))
        # Another round checks what is still missing (a source that died meanwhile, a new loss).

    def _rereplicated(self) -> None:
        now = time.time()
        for event in self._recovery:
            event.setdefault("rereplicated", now)
            if "replacement" in event:
                event.setdefault("replacement_seeded", now)

    def hold_rereplication(self) -> None:
        """Fault injection (the chaos harness): make no copies and adopt no replacement until
        :meth:`release_rereplication`, so a second failure can land inside that window."""
        self._rerep_held = True

    def release_rereplication(self) -> None:
        self._rerep_held = False

    def recovery(self) -> list[dict]:
        """Per host lost (newest last), when (unix seconds): ``noticed`` by the stores,
        ``node_dead`` as Ray declared it, ``rereplicated`` (every committed version back to
        ``replicas`` copies), ``replacement_joined`` and ``replacement_seeded`` (its store holds
        the dead host's copies), and the ``slot``, ``node_id`` and ``replacement`` node."""
        return [dict(e) for e in self._recovery]

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


def get_or_create_registry(namespace: str):
    """The registry of ``namespace`` (created, detached, on the head node, on first use).
    The actors import ``gemini_ckpt`` (which imports nothing heavy: never torch)."""
    return (ray.remote(Registry)
            .options(name=registry_name(namespace), namespace=RAY_NAMESPACE, get_if_exists=True,
                     lifetime="detached", max_restarts=0, num_cpus=0, runtime_env={"env_vars": ACTOR_ENV},
                     resources={"node:__internal_head__": 0.001})
            .remote(namespace))
