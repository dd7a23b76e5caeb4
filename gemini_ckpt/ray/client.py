"""``store="ray"``: one rank's view of its namespace's host stores (a memory tier).

Per version (the :class:`~gemini_ckpt.stores.base.MemoryTier` call order), everything goes
through the attach channel to this node's store (:mod:`gemini_ckpt.ray.attach`): the plan once,
a lent segment (mapped here once), then one ``staged`` message with the value blobs; the
outcome comes back on the same channel. The training process sends no bytes to peers and
makes no Ray call per version.

Reading (restore, persist): every live store's ``index`` says which steps are committed and
where each shard's copies are (:mod:`gemini_ckpt.ray.resolve`); a shard held on this node is
mapped (no transfer), one held only by peers is pushed by a peer over the data plane into a
buffer here, 16 MiB blocks at a time, a few ahead of the reader (:mod:`.readahead`).

Call :func:`connect` on every rank (``Checkpointer.start`` does): it is the rendezvous that
fixes the host slots and opens the epoch, which fences an earlier attempt's writes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..config import CheckpointConfig
from ..errors import (
    AttachError,
    CheckpointError,
    CheckpointTimeoutError,
    ConfigError,
    FencedError,
    MemoryBudgetError,
    ReplicationError,
    ShardFormatError,
    VersionNotFoundError,
)
from ..health import Health
from ..stores.views import MemoryVersion, ShardCopy
from ..stores.base import Capabilities, MemoryTier, Outcome
from ..format.layout import data_file_name
from ..format.segments import Segment
from ..format.shards import ShardPlan, ShardRecord
from ..trust import resolve_key
from .attach import AttachClient
from .cluster import (
    current_node_id,
    ensure_ray,
    find_store,
    get_or_create_registry,
    get_or_create_store,
)
from .readahead import LocalCopy, PeerCopy, PeerReads, ReadSink
from .resolve import Resolved, resolve
from .slots import SlotTable
from .transport import Endpoint, TcpConfig, TcpTransport

log = logging.getLogger("gemini_ckpt")

PROGRESS_TIMEOUT_S = 5.0  # as the host store's (gemini_ckpt.ray.actors.host_store.PROGRESS_TIMEOUT_S)


def connect(config: CheckpointConfig, *, rank: int, world_size: int) -> "RayTier":
    """Connect rank ``rank`` of ``world_size`` to its namespace's host stores.

    Collective: every rank of the job calls it (``Checkpointer.start`` does, at the first
    ``save``/``restore``); it returns once all have, with the slot table they share. Creates
    the registry and this host's store when they do not exist yet.
    """
    if config.namespace is None:
        raise ConfigError(
            "CheckpointConfig.namespace is required with store='ray' outside Ray Train: host stores are "
            "reachable by every job on the Ray cluster, and a job must not restore (or drop) another's "
            "versions. Name this job's versions, e.g. CheckpointConfig(namespace='lm-7'); a restarted job "
            "uses the same name to find them. (gemini_ckpt.integrations.ray_train uses the run name.)")
    ensure_ray()
    namespace = config.resolved_namespace
    node_id = current_node_id()
    registry = get_or_create_registry(namespace)
    store = _start_local_store(config, node_id)
    key = resolve_key(config.signing_key)
    # What the registry needs to bring versions back to `replicas` copies after a host is lost.
    job = {"replicas": config.replicas, "strategy": config.placement, "budget": config.host_memory_budget_bytes,
           "key": key.hex() if key else None, "bandwidth": config.replication_bandwidth}
    try:
        joined = ray.get(registry.join.remote(rank, world_size, node_id, config.timeout_s, config.keep_in_memory, job),
                         timeout=config.timeout_s + 10)
    except RayTaskError as exc:
        raise _cause(exc) from None
    except GetTimeoutError:
        raise CheckpointTimeoutError(f"rank {rank}: the registry of namespace {namespace!r} did not answer "
                                     f"within {config.timeout_s}s") from None
    table = SlotTable.from_registry(namespace, joined)
    if table.hosts < config.replicas:
        raise ConfigError(
            f"CheckpointConfig.replicas={config.replicas} needs {config.replicas} hosts but this job's "
            f"ranks run on {table.hosts}; lower replicas to at most {table.hosts} or use more hosts")
    info = {"slot": table.slot_of(node_id), "nodes": list(table.nodes), "world_size": world_size,
            "ranks_here": [int(r) for r, n in joined["ranks"].items() if n == node_id],
            "replicas": config.replicas, "strategy": config.placement, "keep": config.keep_in_memory,
            "dead": joined["dead"], "idle": joined["idle"], "committed": joined["committed"],
            "secret": joined["secret"], "key": key.hex() if key else None, "timeout_s": config.timeout_s,
            "bandwidth": config.replication_bandwidth}
    try:
        attached = ray.get(store.attach.remote(table.epoch, info), timeout=config.timeout_s)
    except RayTaskError as exc:
        raise _cause(exc, f"rank {rank}: ") from None
    secret = bytes.fromhex(joined["secret"])
    channel = AttachClient(attached["attach"], secret, rank=rank, epoch=table.epoch, timeout_s=config.timeout_s)
    tier = RayTier(config, rank=rank, world_size=world_size, node_id=node_id, table=table, registry=registry,
                   secret=secret, attach=channel, dead=set(joined["dead"]))
    tier.recovery_events = tuple(joined.get("recovery", ()))
    return tier


def _start_local_store(config: CheckpointConfig, node_id: str):
    # A store killed a moment ago may still hold its name; retry until a live one answers.
    deadline = time.monotonic() + config.timeout_s
    while True:
        handle = get_or_create_store(config.resolved_namespace, node_id, config.host_memory_budget_bytes)
        try:
            ray.get(handle.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
            return handle
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        except GetTimeoutError:
            raise CheckpointTimeoutError(f"the host store on node {node_id[:12]} did not start within "
                                         f"{config.timeout_s}s (CheckpointConfig.timeout_s)") from None


class RayTier(MemoryTier):
    """One rank's view of the host stores of its namespace (see the module docstring)."""

    capabilities = Capabilities(persists_itself=True)

    def __init__(self, config: CheckpointConfig, *, rank: int, world_size: int, node_id: str, table: SlotTable,
                 registry, secret: bytes, attach: AttachClient, dead: set[int]) -> None:
        self.config, self.rank, self.world_size, self.node_id = config, rank, world_size, node_id
        self.table, self.epoch, self.slot = table, table.epoch, table.slot_of(node_id)
        self._registry, self._secret, self._attach = registry, secret, attach
        self._lock = threading.Lock()
        self._handles = {s: find_store(config.resolved_namespace, n) for s, n in enumerate(table.nodes)}
        self._dead: dict[int, str] = {s: "gone at the rendezvous" for s in dead}
        self._dead.update({s: "no host store" for s, h in self._handles.items() if h is None})
        self._segments: dict[int, Segment] = {}
        self._plans: set[str] = set()
        self._ahead: dict[str, concurrent.futures.Future] = {}  # plan id -> a segment asked for ahead
        self._where: dict[int, Resolved] = {}
        self._surveyed_infos: dict[int, dict] = {}  # step -> slot -> {rank: (plan, record)}, from the survey
        self._transport: Optional[TcpTransport] = None
        self._read_sink = ReadSink()
        self._read_listener = None
        self.peer_reads = PeerReads(sink=self._read_sink, endpoint=self._reader_endpoint, lost=self._mark_dead,
                                    describe=self._describe, timeout_s=config.timeout_s)
        self.recovery_events: tuple[dict, ...] = ()  # the registry's, at the rendezvous

    # --- write: this node's store does the work ----------------------------------------------
    def segment(self, plan: ShardPlan) -> Segment:
        try:
            if plan.plan_id not in self._plans:
                self._attach.request({"type": "plan"}, plan.encode())
                self._plans.add(plan.plan_id)
            with self._lock:
                ahead = self._ahead.pop(plan.plan_id, None)
            if ahead is not None:
                reply, fds = self._attach.reply(ahead)
            else:
                reply, fds = self._attach.request({"type": "segment", "plan_id": plan.plan_id})
        except MemoryError as exc:
            raise MemoryBudgetError(f"rank {self.rank}: {exc}") from None
        except (AttachError, OSError) as exc:
            raise ReplicationError(f"rank {self.rank}: the host store of this node is unreachable: {exc}") from None
        for seg_id in reply.get("forget", []):
            old = self._segments.pop(seg_id, None)
            if old is not None:
                old.close()
        seg_id = int(reply["seg"])
        seg = self._segments.get(seg_id)
        if seg is None:
            if not fds:
                raise ReplicationError(f"rank {self.rank}: the host store lent segment {seg_id} without its memory")
            seg = self._segments[seg_id] = Segment(int(reply["nbytes"]), fd=fds[0], seg_id=seg_id)
        return seg

    def give_back(self, segment: Segment) -> None:
        try:
            self._attach.send({"type": "give_back", "seg": segment.id})
        except (AttachError, OSError):
            pass

    def hand_off(self, step: int, plan: ShardPlan, segment: Segment, blobs: list[bytes], *,
                 persist: bool = False, verdict: Optional[Health] = None) -> "concurrent.futures.Future[Outcome]":
        outcome = self._attach.outcome(step)
        self._attach.send({"type": "staged", "step": step, "plan_id": plan.plan_id, "seg": segment.id,
                           "persist": persist, "lengths": [len(b) for b in blobs],
                           "verdict": None if verdict is None else verdict.to_json()}, b"".join(blobs))
        done: concurrent.futures.Future = concurrent.futures.Future()

        def finish(fut) -> None:
            self._attach.forget_outcome(step)
            exc = fut.exception()
            if exc is not None:
                done.set_result(Outcome(step, False, str(exc), ReplicationError(f"rank {self.rank}: {exc}")))
                return
            reply = fut.result()
            if reply["committed"]:
                # The segment for the next save, asked for now (the version just released one):
                # save() then takes it without a round trip.
                with self._lock:
                    if plan.plan_id not in self._ahead:
                        try:
                            self._ahead[plan.plan_id] = self._attach.request_async(
                                {"type": "segment", "plan_id": plan.plan_id})
                        except AttachError:
                            pass
            unhealthy = reply.get("unhealthy") or ""
            try:
                health = Health.from_text(unhealthy) if unhealthy else None
            except ValueError as exc:  # our own store's words: a version mismatch, not an attack
                health = Health("unhealthy", "finite", "", f"the host store says so, unreadably ({exc})")
            done.set_result(Outcome(step, bool(reply["committed"]), reply.get("reason", ""), health=health))

        outcome.add_done_callback(finish)
        return done

    @property
    def allocations(self) -> int:
        return len(self._segments)

    @property
    def recovery(self) -> tuple[dict, ...]:
        return self.recovery_events

    # --- placement and liveness --------------------------------------------------------------
    def _live(self) -> dict[int, Any]:
        with self._lock:
            return {s: h for s, h in self._handles.items() if s not in self._dead and h is not None}

    def _mark_dead(self, slot: int, why: str) -> None:
        with self._lock:
            if slot in self._dead:
                return
            self._dead[slot] = why
        log.warning("rank %d: host store of slot %d (node %s) is unusable: %s", self.rank, slot,
                    self.table.nodes[slot][:12], why)
        if self._registry is not None:
            self._registry.suspect.remote(slot, f"rank {self.rank}: {why}")

    def _gather(self, method: str, *args) -> dict[int, Any]:
        """Call ``method`` on every live store in parallel; slot -> result (stores that died
        are marked, ones that do not answer in time are left out)."""
        calls = {s: getattr(h, method).remote(*args) for s, h in self._live().items()}
        deadline = time.monotonic() + self.config.timeout_s
        out = {}
        for slot, ref in calls.items():
            try:
                out[slot] = ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
            except RayActorError as exc:
                self._mark_dead(slot, f"died ({type(exc).__name__})")
            except RayTaskError as exc:
                raise _cause(exc, f"{self._describe(slot)}: ") from None
            except GetTimeoutError:
                log.warning("rank %d: %s did not answer %s within %ss", self.rank, self._describe(slot), method,
                            self.config.timeout_s)
        return out

    def _describe(self, slot: int) -> str:
        why = self._dead.get(slot)
        return f"slot {slot} on node {self.table.nodes[slot][:12]}" + (f", {why}" if why else "")

    # --- read ----------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        found = resolve(self._gather("index"), local_slot=self.slot)
        with self._lock:
            self._where = found
        return sorted(s for s, r in found.items() if r.committed)

    def survey_state(self) -> dict:
        with self._lock:
            where = dict(self._where)
        newest = max((s for s, r in where.items() if r.committed), default=None)
        # Restore opens the newest version, and skips it if its records say it is unhealthy: then
        # the newest one the stores call healthy is opened too.
        healthy = max((s for s, r in where.items() if r.committed and r.health != "unhealthy"), default=None)
        wanted = {s for s in (newest, healthy) if s is not None}
        return {"where": where, "infos": {s: self._shard_infos(s, where[s]) for s in wanted}}

    def use_survey_state(self, state: dict) -> None:
        if not state:
            return
        # The surveying rank put its own node's copies first; this rank reads its own node's first.
        where = {step: dataclasses.replace(r, copies={rank: tuple(sorted(slots, key=lambda s: s != self.slot))
                                                      for rank, slots in r.copies.items()})
                 for step, r in state["where"].items()}
        with self._lock:
            self._where = where
            self._surveyed_infos = dict(state["infos"])

    def open(self, step: int, *, key: Optional[bytes] = None) -> MemoryVersion:
        with self._lock:
            where = self._where.get(step)
        if where is None or not where.committed:
            self.committed_steps()
            with self._lock:
                where = self._where.get(step)
        if where is None or not where.committed:
            raise VersionNotFoundError(f"step {step} is not committed on the live host stores of namespace "
                                       f"{self.config.resolved_namespace!r}")
        plans, records, copies, problems = {}, {}, {}, []
        with self._lock:
            held = self._surveyed_infos.pop(step, None)  # rank 0 asked for them at the survey
        if held is None:
            held = self._shard_infos(step, where)  # one call per store, all in parallel
        for rank in range(where.world_size):
            for slot in where.copies[rank]:
                got = held.get(slot, {}).get(rank)
                if got is None:
                    continue
                try:
                    plans[rank], records[rank] = ShardPlan.decode(got[0], key), ShardRecord.decode(got[1], key)
                    break
                except ShardFormatError as exc:
                    problems.append(f"{self._describe(slot)}: rank {rank}: {exc}")
                    log.warning("rank %d: the plan or record of rank %d held by %s is damaged: %s", self.rank, rank,
                                self._describe(slot), exc)
            if rank not in plans:
                raise ShardFormatError(f"step {step}: no live store has an intact plan and record of rank {rank}'s "
                                       f"shard" + (f" ({'; '.join(problems)})" if problems else ""))
            copies[rank] = [self._copy(step, rank, slot, plans[rank].region_bytes) for slot in where.copies[rank]]
        return MemoryVersion(step, plans, records, copies, on_close=lambda: self._release_maps(copies))

    def _shard_infos(self, step: int, where: Resolved) -> dict[int, dict]:
        """slot -> {rank: (plan bytes, record bytes)} from every live store holding a copy."""
        wanted: dict[int, list[int]] = {}
        for rank, slots in where.copies.items():
            for slot in slots:
                wanted.setdefault(slot, []).append(rank)
        live = self._live()
        calls = {slot: live[slot].shard_info.remote(step, ranks) for slot, ranks in wanted.items() if slot in live}
        out = {}
        for slot, ref in calls.items():
            try:
                out[slot] = ray.get(ref, timeout=self.config.timeout_s)
            except RayActorError:
                self._mark_dead(slot, "died")
            except (RayTaskError, GetTimeoutError) as exc:
                log.warning("rank %d: %s did not say what it holds of step %d: %s", self.rank, self._describe(slot),
                            step, type(exc).__name__)
        return out

    def _copy(self, step: int, rank: int, slot: int, nbytes: int) -> ShardCopy:
        if slot == self.slot:
            local = LocalCopy(self._attach, step, rank)
            return ShardCopy("local", local.fetch, "this node")
        handle = self._live().get(slot)
        peer = PeerCopy(self.peer_reads, slot, handle, step, rank, nbytes)
        return ShardCopy("peer", peer.fetch, self._describe(slot), receive_into=peer.receive_into)

    def _release_maps(self, copies: dict[int, list[ShardCopy]]) -> None:
        for rank_copies in copies.values():
            for copy in rank_copies:
                owner = getattr(copy.fetch, "__self__", None)
                if isinstance(owner, LocalCopy):
                    owner.release()

    def _reader_endpoint(self) -> Endpoint:
        """This reader's data-plane listener (started on first use), where peers push ranges."""
        with self._lock:
            listener = self._read_listener
        if listener is None:
            listener = self._data_plane().listen(ray.util.get_node_ip_address(), self._read_sink)
            with self._lock:
                if self._read_listener is None:
                    self._read_listener = listener
                else:
                    listener.close()
                    listener = self._read_listener
        return listener.endpoint

    def _data_plane(self) -> TcpTransport:
        with self._lock:
            if self._transport is None:
                self._transport = TcpTransport(self._secret, self.config.resolved_namespace, host_name=self.node_id,
                                               config=TcpConfig(progress_timeout_s=PROGRESS_TIMEOUT_S))
            return self._transport

    # --- persist, retention, discards ------------------------------------------------------------
    def persist_files(self, step: int, uri: str, directory: str, sections: dict[int, bytes]) -> dict:
        """Have the host stores write ``step``'s data files from their memory, in parallel: each
        rank's file by a store holding an intact copy, the owner's host first (so each host
        writes its own ranks' shards)."""
        with self._lock:
            where = self._where.get(step)
        if where is None:
            self.committed_steps()
            with self._lock:
                where = self._where.get(step)
        if where is None or not where.committed:
            raise VersionNotFoundError(f"step {step} is not committed on the live host stores")
        def write(rank: int) -> list:
            problems = []
            for slot in sorted(where.copies[rank], key=lambda s: s != self._owner(where, rank)):
                handle = self._live().get(slot)
                if handle is None:
                    continue
                try:
                    return ray.get(handle.persist_shard.remote(step, rank, uri, directory, data_file_name(rank),
                                                               sections[rank]), timeout=self.config.timeout_s)
                except RayActorError:
                    self._mark_dead(slot, "died while persisting")
                    problems.append(f"{self._describe(slot)} died")
                except (RayTaskError, GetTimeoutError) as exc:
                    cause = getattr(exc, "cause", exc)
                    problems.append(f"{self._describe(slot)}: {type(cause).__name__}: {cause}")
            raise ReplicationError(f"step {step}: no host store could write rank {rank}'s file: "
                                   + "; ".join(problems))

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, max(1, where.world_size))) as pool:
            futures = {rank: pool.submit(write, rank) for rank in range(where.world_size)}
            return {rank: fut.result() for rank, fut in futures.items()}

    @staticmethod
    def _owner(where: Resolved, rank: int) -> int:
        copies = where.copies[rank]
        return copies[0] if copies else -1

    def unpin(self, step: int) -> None:
        self._gather("unpin", step)

    def discard(self, step: int) -> None:
        self._gather("discard", step, self.epoch)

    def holder(self, step: int, rank: int, *, slot: Optional[int] = None):
        """The actor handle of a host store holding a copy of rank ``rank``'s shard of ``step``:
        the store of ``slot``, else this node's, else the first holder."""
        self.committed_steps()
        where = self._where[step]
        slot = slot if slot is not None else where.copies[rank][0]
        return self._live()[slot]

    def close(self) -> None:
        """Close this client's channels (the host stores keep every version)."""
        with self._lock:
            transport, self._transport = self._transport, None
            listener, self._read_listener = self._read_listener, None
            segments, self._segments = list(self._segments.values()), {}
        if listener is not None:
            listener.close()
        if transport is not None:
            transport.close()
        self._attach.close()
        for seg in segments:
            seg.close()


def _cause(exc: RayTaskError, prefix: str = "") -> BaseException:
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
