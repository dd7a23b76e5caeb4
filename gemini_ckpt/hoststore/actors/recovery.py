"""After a host is lost: a live node of the same kind takes the dead host's slot over (its
store is started and given the dead host's copies), and every committed version is brought
back to ``replicas`` copies (see :mod:`.registry`); the timeline of each loss, for
``RestoreResult.recovery``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import ray

from ..names import alive_node_ids, named_actors
from ..resolve import resolve
from ..slots import HOST_LABEL, holders_for
from ...errors import MemoryBudgetError
from .budget import other_budgets
from .store_handle import get_or_create_store
from ...timeouts import TIMEOUTS
from .registry_state import RegistryState
from .state import EpochConfig, store_config

log = logging.getLogger("gemini_ckpt")

OLDER_AFTER_S = 10.0
"""After a host is lost (or its replacement joins), the copies of the kept versions older than the
newest committed one are made this long after; the newest's at once. A restore reads the newest,
and the older copies (``keep - 1`` times its bytes) would otherwise take the CPU and memory
bandwidth that the replacement's start and restore need, on the critical path (a lost host's
in-place recovery: node dead + 6.25 s median of 9 before, + 5.11 s of 6 after, docs/recovery.md). A version
committed meanwhile lets the oldest go, and its copies are not made at all."""


REFUSED_S = 30.0
"""A node passed over as a replacement (other jobs' stores leave it no room for the job's budget)
is not tried again for this long."""


def _same_kind(dead: Optional[dict], candidate: Optional[dict]) -> bool:
    """Whether a node ``candidate`` can stand in for the ``dead`` one (both as ``ray.nodes()``
    describes a node): the same resource names, apart from the ones Ray names after the node
    itself, and, when the dead node carried the host label (:data:`~gemini_ckpt.hoststore.slots.HOST_LABEL`),
    the same host label (the ranks pinned to that host will be placed on it)."""
    if dead is None or candidate is None:
        return False

    def names(node: dict) -> set:
        return {
            k
            for k in node.get("Resources", {})
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")
        }

    label = (dead.get("Labels") or {}).get(HOST_LABEL)
    if label is not None and (candidate.get("Labels") or {}).get(HOST_LABEL) != label:
        return False
    return names(dead) == names(candidate)


def _node_info(node: dict) -> dict:
    return {"Resources": dict(node.get("Resources") or {}), "Labels": dict(node.get("Labels") or {})}


class Recovery:
    """Replacements and re-replication for the registry (``state``: its shared state). Held by the
    chaos harness while it lands a second failure (:meth:`hold`)."""

    def __init__(self, state: RegistryState) -> None:
        self.slots, self.terms, self.commits, self.rerep, self.reports = state.parts()
        self._refused: dict[str, float] = {}  # node -> when it may be tried again as a replacement

    def note_nodes(self) -> None:
        for n in ray.nodes():
            if n.get("Alive"):
                self.slots.node_info[n["NodeID"]] = _node_info(n)

    def note_deaths(self) -> None:
        """When Ray declared each lost host's node dead (the recovery timeline)."""
        alive = None
        for event in self.rerep.timeline:
            if "node_dead" not in event:
                alive = set(alive_node_ids()) if alive is None else alive
                if event["node_id"] not in alive:
                    event["node_dead"] = time.time()

    async def adopt_replacements(self) -> None:
        """A node that joined the cluster while a slot is dead takes that slot over now (as it
        would at the job's next rendezvous): its host store is started and given the dead host's
        copies, before the job's new workers reach ``restore()``, which then reads them locally.
        A replacement is a live node without a slot whose resources have the same names as the
        dead node's (``host3`` replaces ``host3``; GPUs replace GPUs) and, when the dead node
        carried the host label, the same label (``gemini-ckpt.io/host=3`` replaces it). Nodes
        where no other job keeps a host store go first; the store's budget is judged with the other
        jobs' stores on the node (:mod:`.budget`), and a node that cannot hold the job's explicit
        budget is passed over (tried again after :data:`REFUSED_S`)."""
        if not self.terms.job:
            return
        dead = sorted(s for s in self.slots.dead if self.slots.nodes[s] not in self._alive_now())
        if not dead:
            return
        taken = set(self.slots.nodes)
        now = time.monotonic()
        candidates = [
            n
            for n in ray.nodes()
            if n.get("Alive") and n["NodeID"] not in taken and self._refused.get(n["NodeID"], 0.0) <= now
        ]
        named = None
        for slot in dead:
            fits = [n for n in candidates if _same_kind(self.slots.node_info.get(self.slots.nodes[slot]), n)]
            if not fits:
                continue
            if named is None:  # off the event loop, once for every slot and node
                named = await asyncio.to_thread(named_actors)
            crowded = {}
            for n in fits:
                others = await asyncio.to_thread(
                    other_budgets, self.slots.namespace, n["NodeID"], self.terms.timeout_s, named
                )
                crowded[n["NodeID"]] = bool(others)
            fits.sort(key=lambda n: crowded[n["NodeID"]])  # stable: the scan order otherwise
            for n in fits:
                if await self._take_over(slot, n, named):
                    candidates.remove(n)
                    break

    async def _take_over(self, slot: int, n: dict, named: dict) -> bool:
        """Start the job's store on node ``n`` for ``slot``; whether it took the slot over."""
        node = n["NodeID"]
        try:
            store = await asyncio.to_thread(
                get_or_create_store,
                self.slots.namespace,
                node,
                self.terms.job.get("budget"),
                timeout_s=self.terms.timeout_s,
                named=named,
            )
        except MemoryBudgetError as exc:
            self._refused[node] = time.monotonic() + REFUSED_S
            log.warning("registry %s: node %s cannot replace slot %d: %s", self.slots.namespace, node[:12], slot, exc)
            self.reports.event(f"node {node[:12]} was passed over for slot {slot}: other jobs' stores fill it")
            return False
        old = self.slots.nodes[slot]
        cfg = self.epoch_config(slot)
        try:
            await asyncio.wait_for(store.attach.remote(self.slots.epoch, cfg), timeout=self.terms.timeout_s)
        except Exception as exc:  # noqa: BLE001 - not ready yet: the next round tries again
            log.warning(
                "registry %s: the replacement node %s for slot %d could not start its store: %s",
                self.slots.namespace,
                node[:12],
                slot,
                exc,
            )
            return False
        self.slots.nodes[slot] = node
        self.slots.node_info[node] = _node_info(n)
        self.slots.handles.pop(slot, None)
        self.slots.dead.discard(slot)
        self.reports.event(
            f"node {node[:12]} took over slot {slot} of dead node {old[:12]} (its store is given the "
            f"dead host's copies now)"
        )
        for event in self.rerep.timeline:
            if event["slot"] == slot and "replacement" not in event:
                event.update(replacement=node, replacement_joined=time.time())
        self.rerep.change()
        self.rerep.pending = True
        return True

    def _alive_now(self) -> set[str]:
        return set(alive_node_ids())

    def epoch_config(self, slot: int) -> EpochConfig:
        """What a store without ranks this epoch is told (as ranks tell theirs in ``attach``): a
        replacement adopted outside a rendezvous, or a live store whose ranks went elsewhere at
        one. It holds copies only, this epoch."""
        committed = self.commits.coordinator.committed_versions() if self.commits.coordinator is not None else ()
        return store_config(
            self.terms.job,
            epoch=self.slots.epoch,
            slot=slot,
            nodes=tuple(self.slots.nodes),
            ranks_here=(),
            world_size=self.commits.coordinator.world_size if self.commits.coordinator is not None else 0,
            keep=self.terms.keep,
            timeout_s=self.terms.timeout_s,
            dead=frozenset(self.slots.dead - {slot}),
            idle=frozenset(set(self.slots.idle) | {slot}),
            committed=tuple((v.epoch, v.step) for v in committed),
            secret=self.slots.secret,
            domains=self.slots.domains,
        )

    async def rereplicate(self) -> None:
        """Bring every committed version back to ``replicas`` copies, where the placement puts
        them with the live hosts of now (:func:`~gemini_ckpt.hoststore.slots.holders_for`), each copy
        sent by a store that holds one. A copy becomes visible only once its new holder checked
        it, so a version is never half-copied to a reader. The newest committed version's copies
        are made first, the older kept versions' :data:`OLDER_AFTER_S` after the newest loss or
        replacement. Runs until nothing is missing (or nothing missing can be fixed: no live copy)."""
        if not self.terms.job or not self.slots.nodes:
            self.rerep.pending = False
            return
        live = {s: self.slots.store(s) for s in range(len(self.slots.nodes)) if s not in self.slots.dead}
        live = {s: h for s, h in live.items() if h is not None}
        indexes = {}
        for slot, handle in live.items():
            try:
                indexes[slot] = await asyncio.wait_for(handle.index.remote(), timeout=TIMEOUTS.ping_s)
            except Exception:  # noqa: BLE001 - busy or dead: the liveness check decides, next round
                return
        found = resolve(indexes)
        # The versions a restore may choose: committed and not unhealthy (one kept for inspection
        # is never made again).
        committed = sorted((s for s, r in found.items() if r.committed and r.health != "unhealthy"), reverse=True)[
            : max(1, self.terms.keep)
        ]
        replicas, strategy = int(self.terms.job.get("replicas", 2)), self.terms.job.get("strategy", "auto")
        sends = []
        for step in committed:
            where = found[step]
            owners = {
                int(r): e["shards"][r]["owner"]
                for ix in indexes.values()
                if step in ix
                for e in [ix[step]]
                for r in e["shards"]
                if e["epoch"] == where.epoch
            }
            for rank, slots in where.copies.items():
                owner = owners.get(rank)
                if owner is None:
                    continue
                try:
                    want = holders_for(
                        owner,
                        hosts=len(self.slots.nodes),
                        replicas=replicas,
                        strategy=strategy,
                        dead=self.slots.dead,
                        domains=self.slots.domains,
                    )
                except Exception:  # noqa: BLE001 - too few live hosts for the copies asked: nothing to do
                    continue
                for target in [h for h in want if h not in slots and h in live]:
                    source = slots[len(sends) % len(slots)]  # spread the sending over the holders
                    sends.append((step, rank, source, target))
        later = []
        if sends and time.monotonic() < self.rerep.changed + OLDER_AFTER_S:
            later = [send for send in sends if send[0] != committed[0]]
            sends = [send for send in sends if send[0] == committed[0]]
        if not sends:
            self.rerep.pending = bool(later)  # a pass after the wait makes them
            self._rereplicated()
            return
        endpoints = {}
        for _, _, _, target in sends:
            if target not in endpoints:
                endpoints[target] = await asyncio.wait_for(live[target].endpoint.remote(), timeout=TIMEOUTS.ping_s)
        t0 = time.time()
        results = await asyncio.gather(
            *[
                asyncio.wait_for(
                    live[source].send_copy.remote(step, rank, endpoints[target]), timeout=self.terms.timeout_s
                )
                for step, rank, source, target in sends
            ],
            return_exceptions=True,
        )
        failed = [(send, r) for send, r in zip(sends, results) if isinstance(r, BaseException)]
        moved = sum(r for r in results if isinstance(r, int))
        steps = ", ".join(str(step) for step in sorted({send[0] for send in sends}, reverse=True))
        self.reports.event(
            f"re-replicated {len(sends) - len(failed)} of {len(sends)} copies of step {steps} ({moved / 1e6:.1f} MB) "
            f"in {time.time() - t0:.2f}s"
            + (f"; failed: {failed[0][1]}" if failed else "")
            + (f"; {len(later)} of older steps follow {OLDER_AFTER_S:.0f}s after the loss or join" if later else "")
        )
        # Another round checks what is still missing (a source that died meanwhile, a new loss).

    def _rereplicated(self) -> None:
        """Stamp the timeline: the newest committed version is back to ``replicas`` copies, and a
        replacement holds its lost host's copies of it (what its restore reads)."""
        now = time.time()
        for event in self.rerep.timeline:
            event.setdefault("rereplicated", now)
            if "replacement" in event:
                event.setdefault("replacement_seeded", now)

    def hold(self) -> None:
        """Fault injection (the chaos harness): make no copies and adopt no replacement until
        :meth:`release`, so a second failure can land inside that window."""
        self.rerep.held = True

    def release(self) -> None:
        self.rerep.held = False

    def timeline(self) -> list[dict]:
        """Per host lost (newest last), when (unix seconds): ``noticed`` by the stores,
        ``node_dead`` as Ray declared it, ``rereplicated`` (the newest committed version back to
        ``replicas`` copies; the older kept ones follow :data:`OLDER_AFTER_S` after the loss),
        ``replacement_joined`` and ``replacement_seeded`` (its store holds the dead host's copies
        of the newest version), and the ``slot``, ``node_id`` and ``replacement`` node."""
        return [dict(e) for e in self.rerep.timeline]
