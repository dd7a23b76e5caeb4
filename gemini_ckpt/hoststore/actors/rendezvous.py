"""The registry's rendezvous: every rank of a job joins, and once all have, the host slots are
assigned (a new node takes a dead node's slot) and a new *epoch* opens, with its dead and idle
slots fixed and a fresh commit coordinator (see :mod:`.registry`). The ranks must agree on the
signing key, or none of them goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional

from ...errors import ConfigError
from ...timeouts import TIMEOUTS
from ...commit import Coordinator
from ..names import alive_node_ids, find_store
from ..slots import node_domains, unlabelled
from .recovery import Recovery
from .registry_state import RegistryState


@dataclass
class _Round:
    pending: dict[int, str] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    table: Optional[dict] = None
    keys: dict = field(default_factory=dict)  # rank -> its signing key's fingerprint ("" for none)
    error: str = ""  # why the round was refused (every rank raises it)
    generation: Optional[int] = None  # the runner's attempt the ranks join in (None: not told)
    callers: dict = field(default_factory=dict)  # rank -> the call that joined it (an object() of its own)
    abandoned: str = ""  # why a newer generation's join ended this round (its waiters are refused)


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
    return (
        "the ranks of this job do not share one signing key (" + "; ".join(parts) + "): set "
        "CheckpointConfig.signing_key (or $GEMINI_CKPT_SIGNING_KEY) to the same secret on every rank, "
        "or on none"
    )


class Rendezvous:
    """Joins the ranks of one round and opens the epoch (``state``: the registry's shared state;
    ``recovery`` notes the nodes' resources, for finding replacements later)."""

    def __init__(self, state: RegistryState, recovery: Recovery) -> None:
        self.slots, self.terms, self.commits, self.rerep, self.reports = state.parts()
        self.recovery = recovery
        self._round: Optional[_Round] = None

    async def join(
        self,
        rank: int,
        world_size: int,
        node_id: str,
        timeout_s: float,
        keep: int = 2,
        job: Optional[dict] = None,
        generation: Optional[int] = None,
    ) -> dict:
        """Rendezvous of all ranks; returns the slot table every rank of this round shares:
        ``nodes``, ``epoch``, ``ranks`` (rank -> node), ``dead`` and ``idle`` slots, the versions
        committed so far, and the namespace's ``secret``. ``job``: the settings the registry
        needs to bring versions back to ``replicas`` copies after a host is lost (``replicas``,
        ``strategy``, the stores' ``budget``, the signing ``key``, ``bandwidth``).

        ``generation``: the in-place runner's attempt (its round), the same on every rank of one
        attempt. A join of a newer generation ends a round still waiting for an older one's ranks
        (they are refused: their attempt is over), and an older generation's join is refused at
        once; so a rank that joined and then left (its attempt failed, its process died) is never
        counted in a later attempt's rendezvous. A join that times out or is withdrawn (cancelled)
        leaves the round too."""
        rnd = self._round
        if rnd is not None and generation is not None and rnd.generation is not None:
            if generation < rnd.generation:
                raise PermissionError(
                    f"rank {rank} joins the host stores' rendezvous of namespace {self.slots.namespace!r} for attempt "
                    f"{generation}, but attempt {rnd.generation}'s ranks are joining: this rank's attempt is over"
                )
            if generation > rnd.generation:
                rnd.abandoned = (
                    f"the host stores' rendezvous of namespace {self.slots.namespace!r} moved on to attempt "
                    f"{generation} while these ranks waited in attempt {rnd.generation}: their attempt is over"
                )
                rnd.done.set()
                rnd = self._round = None
        if rnd is None:
            rnd = self._round = _Round(generation=generation)
        rnd.pending[rank] = node_id
        call = rnd.callers[rank] = object()
        rnd.keys[rank] = key_fingerprint((job or {}).get("key"))
        rnd.params = {"keep": keep, "timeout_s": timeout_s}
        if job:
            self.terms.job = dict(job)
        for stale in [r for r in rnd.pending if r >= world_size]:
            self._leave(rnd, stale)
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
                self._leave(rnd, rank, call)
                raise TimeoutError(
                    f"rank {rank}: ranks {missing} of {world_size} did not connect to the host stores of "
                    f"namespace {self.slots.namespace!r} within {timeout_s}s (CheckpointConfig.timeout_s); every "
                    f"rank must build its Checkpointer and save/restore"
                ) from None
            except asyncio.CancelledError:  # the rank withdrew its join
                self._leave(rnd, rank, call)
                raise
        if rnd.abandoned:
            raise PermissionError(f"rank {rank}: {rnd.abandoned}")
        if rnd.error:
            raise ConfigError(rnd.error)
        return rnd.table

    @staticmethod
    def _leave(rnd: _Round, rank: int, call: Optional[object] = None) -> None:
        """Take ``rank`` out of a waiting round (only the join ``call`` put there, when given: a
        later join of the same rank stays)."""
        if rnd.table is not None or (call is not None and rnd.callers.get(rank) is not call):
            return
        rnd.pending.pop(rank, None)
        rnd.keys.pop(rank, None)
        rnd.callers.pop(rank, None)

    async def _open_epoch(self, pending: dict[int, str], params: dict) -> dict:
        self._assign(pending)
        self.slots.epoch += 1
        hosting = set(pending.values())
        self.recovery.note_nodes()
        # The slots' failure domains, fixed for the epoch like dead and idle (a replacement
        # adopted meanwhile is placed by its slot's domain until the next rendezvous reads it).
        label = self.terms.job.get("domain")
        labels = {node: info.get("Labels") or {} for node, info in self.slots.node_info.items()}
        self.slots.domains = node_domains(self.slots.nodes, labels, label)
        warning = unlabelled(self.slots.nodes, self.slots.domains, label)
        if warning:
            self.reports.event(warning)
        alive = set(alive_node_ids())
        dead = set()
        for slot, node in enumerate(self.slots.nodes):
            if node not in alive or (node not in hosting and not await self._store_exists(node)):
                dead.add(slot)
        idle = frozenset(s for s, n in enumerate(self.slots.nodes) if n not in hosting and s not in dead)
        committed = self.commits.coordinator.committed_versions() if self.commits.coordinator is not None else ()
        since = [dict(e) for e in self.rerep.timeline if e["noticed"] >= self.slots.epoch_opened]
        self.slots.epoch_opened = time.time()
        keep = int(params.get("keep", 2))
        self.commits.coordinator = Coordinator(
            hosts=len(self.slots.nodes), keep=keep, dead=dead, idle=idle, committed=committed, world_size=len(pending)
        )
        self.slots.dead, self.slots.idle, self.slots.handles, self.commits.started = set(dead), idle, {}, {}
        self.terms.timeout_s = float(params.get("timeout_s", TIMEOUTS.version_s))
        self.terms.keep = keep
        self.rerep.pending = bool(dead)
        await self._move_idle_stores(idle)
        return {
            "nodes": list(self.slots.nodes),
            "epoch": self.slots.epoch,
            "ranks": dict(pending),
            "secret": self.slots.secret,
            "dead": sorted(dead),
            "idle": sorted(idle),
            "committed": [[v.epoch, v.step] for v in committed],
            "recovery": since,
            "domains": None if self.slots.domains is None else list(self.slots.domains),
        }

    async def _move_idle_stores(self, idle) -> None:
        """A live store whose ranks went elsewhere still holds copies this epoch (the placement
        counts it), but no rank of the new epoch attaches to it: the registry moves it to the
        epoch, or it would refuse the new epoch's copies as from the future."""
        for slot in sorted(idle):
            store = find_store(self.slots.namespace, self.slots.nodes[slot])
            if store is None:
                continue
            try:
                await asyncio.wait_for(
                    store.attach.remote(self.slots.epoch, self.recovery.epoch_config(slot)), timeout=TIMEOUTS.progress_s
                )
            except Exception as exc:  # noqa: BLE001 - its copies fail and are reported where they fail
                self.reports.event(
                    f"slot {slot}'s store (no ranks this epoch) could not be moved to epoch "
                    f"{self.slots.epoch}: {type(exc).__name__}: {exc}"
                )

    async def _store_exists(self, node: str) -> bool:
        return find_store(self.slots.namespace, node) is not None

    def _assign(self, pending: dict[int, str]) -> None:
        first_rank: dict[str, int] = {}
        for rank, node in sorted(pending.items()):
            first_rank.setdefault(node, rank)
        new = [n for n in sorted(first_rank, key=first_rank.get) if n not in self.slots.nodes]
        if new:
            alive = set(alive_node_ids())
            free = [i for i, n in enumerate(self.slots.nodes) if n not in alive]
            for node in new:
                if free:
                    slot = free.pop(0)
                    self.reports.event(
                        f"node {node[:12]} took over slot {slot} of dead node {self.slots.nodes[slot][:12]}"
                    )
                    self.slots.nodes[slot] = node
                else:
                    self.slots.nodes.append(node)
                    self.reports.event(f"node {node[:12]} got slot {len(self.slots.nodes) - 1}")

    def table(self) -> Optional[dict]:
        if not self.slots.nodes:
            return None
        return {
            "nodes": list(self.slots.nodes),
            "epoch": self.slots.epoch,
            "ranks": {},
            "dead": sorted(self.slots.dead),
            "idle": sorted(self.slots.idle),
            "domains": None if self.slots.domains is None else list(self.slots.domains),
        }
