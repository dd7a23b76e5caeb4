"""The :class:`~gemini_ckpt._store.Store` of ``CheckpointConfig(store="ray")``: host stores.

Each rank talks to the host-store actors of its namespace (:mod:`gemini_ckpt._host_store`,
one per host). What each call does, in the store protocol's call order:

1. ``put_file`` (every rank, its own data file): the bytes go to every holder of this rank's
   host (:func:`~gemini_ckpt._cluster.holders_for`, the local store first) in parallel over
   the data plane (:mod:`gemini_ckpt.ray.transport`: authenticated TCP streams, bound to the
   node address Ray reports, received straight into the holder's reused buffer; Ray never
   carries these bytes). ``put_file`` returns when every holder acknowledged the file, and
   raises when any holder refuses, dies (noticed in about a second) or times out: DCP then
   fails the save on every rank and the version is never committed. A holder found dead is skipped by the next version (see the rule in
   :mod:`gemini_ckpt._cluster`), and reported to the registry so status shows it.
2. ``commit`` (rank 0, after every rank's ``put_file`` returned): checks, on every live
   store, that each file of the manifest is complete on every holder it was sent to, then
   stores the manifest on every live store. A failure rolls the step back everywhere.
   Saving a committed step again replaces it: each holder the new put reaches uncommits the
   step at once, and the commit discards copies that are not the newest put of their file.
3. ``committed_steps``: steps with a commit whose every file has a complete copy on at least
   one live store holding that same commit (manifest and bytes always come from one
   version). ``manifest`` and ``read_range`` read from the local store first (through Ray,
   which maps the store's result without another copy), then the file's holders in
   placement order, then any other store holding the commit; a peer pushes the range over
   the data plane straight into the reader's buffer.
4. ``drop`` on every live store.

Call :func:`connect_ray_store` on every rank (``Checkpointer.start`` does): it is a
rendezvous that fixes the host slots (:mod:`gemini_ckpt._cluster`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from ._cluster import (
    SlotTable,
    current_node_id,
    ensure_ray,
    find_store,
    get_or_create_registry,
    get_or_create_store,
    holders_for,
)
from ._config import CheckpointConfig
from ._errors import (
    CheckpointError,
    CheckpointTimeoutError,
    ConfigError,
    FencedError,
    MemoryBudgetError,
    VersionNotFoundError,
)
from ._store import VersionManifest, as_uint8
from .ray.transport import Endpoint, Header, TcpConfig, TcpTransport, TransferRejectedError, TransportError
from ._trust import VerificationError, decode_manifest, encode_manifest, resolve_key, sign

__all__ = ["IncompleteVersionError", "RayStore", "ReplicationError", "ResolvedVersion",
           "connect_ray_store", "resolve_versions"]

log = logging.getLogger("gemini_ckpt")

PROGRESS_TIMEOUT_S = 5.0
"""A data-plane peer that makes no progress this long fails the transfer. A peer that dies is
noticed at once (its connections reset, in milliseconds); this catches one that hangs or whose
machine vanished silently. Shorter gives false alarms on busy hosts: 1 s failed 256 MiB puts
with 4 ranks and their host stores on 2 cores."""
READ_BLOCK_BYTES = 16 << 20  # read-ahead: DCP reads a file item by item, in offset order
READ_AHEAD_BLOCKS = 4  # blocks requested ahead of the reader (transfers overlap deserializing)


class IncompleteVersionError(CheckpointError, ValueError):
    """A commit names a data file that is missing, incomplete or of the wrong size on one of
    its holders: the version is not committed."""


class ReplicationError(CheckpointError, RuntimeError):
    """A copy of a shard could not be delivered (a holder died, or refused it): the version
    is not committed. The message names the rank, the step, the holder slot and node."""


@dataclass
class RayStoreStats:
    """Bytes moved by this client (for tests, benchmarks and logs)."""

    bytes_put: int = 0
    last_put_s: float = 0.0
    bytes_read_local: int = 0
    bytes_read_peer: int = 0


def connect_ray_store(config: CheckpointConfig, *, rank: int, world_size: int) -> "RayStore":
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
            "uses the same name to find them. (gemini_ckpt.ray_train uses the run name.)")
    ensure_ray()
    namespace = config.resolved_namespace
    node_id = current_node_id()
    registry = get_or_create_registry(namespace)
    _start_local_store(config, node_id)
    try:
        joined = ray.get(registry.join.remote(rank, world_size, node_id, config.timeout_s),
                         timeout=config.timeout_s + 10)
        table = SlotTable.from_registry(namespace, joined)
    except RayTaskError as exc:
        raise _cause(exc) from None
    except GetTimeoutError:
        raise CheckpointTimeoutError(f"rank {rank}: the registry of namespace {namespace!r} did not answer "
                                     f"within {config.timeout_s}s") from None
    # This rendezvous's epoch fences the writes of any earlier attempt on this host.
    ray.get(find_store(namespace, node_id).fence.remote(table.epoch), timeout=config.timeout_s)
    return RayStore(config, rank=rank, world_size=world_size, node_id=node_id, table=table, registry=registry,
                    secret=joined["secret"])


def _start_local_store(config: CheckpointConfig, node_id: str) -> None:
    # A store killed a moment ago may still hold its name; retry until a live one answers.
    deadline = time.monotonic() + config.timeout_s
    while True:
        handle = get_or_create_store(config.resolved_namespace, node_id, config.host_memory_budget_bytes)
        try:
            ray.get(handle.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
            return
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        except GetTimeoutError:
            raise CheckpointTimeoutError(f"the host store on node {node_id[:12]} did not start within "
                                         f"{config.timeout_s}s (CheckpointConfig.timeout_s)") from None


class RayStore:
    """One rank's view of the host stores of its namespace (see the module docstring)."""

    copies_on_put = True  # put_file copies the bytes out: a writer may reuse its buffer at once

    def __init__(self, config: CheckpointConfig, *, rank: int, world_size: int, node_id: str,
                 table: SlotTable, registry=None, secret: str = "") -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.node_id = node_id
        self.table = table
        self.slot = table.slot_of(node_id)
        self.stats = RayStoreStats()
        self._registry = registry
        self._lock = threading.Lock()
        self._handles = {s: find_store(config.resolved_namespace, n) for s, n in enumerate(table.nodes)}
        self._dead: dict[int, str] = {s: "no host store" for s, h in self._handles.items() if h is None}
        for s, why in self._dead.items():
            log.warning("rank %d: slot %d (node %s) has %s; versions skip it", rank, s, table.nodes[s][:12], why)
        # step -> file -> (bytes, slots holding a complete copy, in read order)
        self._where: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {}
        self._chosen: dict[int, tuple[int, ...]] = {}  # step -> slots holding its newest whole commit
        self._stream: Optional[_BlockStream] = None  # read-ahead over the file being read
        self._secret = secret
        self._transport: Optional[TcpTransport] = None  # the data plane, opened by the first put
        self._channels: dict[int, Any] = {}  # slot -> Channel to its host store
        self._read_sink = _ReadSink()  # peers push restore reads here
        self._read_listener = None
        self._peers_started: set[int] = set()
        if table.hosts < config.replicas:
            raise ConfigError(
                f"CheckpointConfig.replicas={config.replicas} needs {config.replicas} hosts but this job's "
                f"ranks run on {table.hosts}; lower replicas to at most {table.hosts} or use more hosts")

    # --- placement -----------------------------------------------------------------------------
    @property
    def dead_slots(self) -> dict[int, str]:
        with self._lock:
            return dict(self._dead)

    def holders(self) -> tuple[int, ...]:
        """Where this rank's shard of the next version goes (owner slot first when alive)."""
        with self._lock:
            dead = set(self._dead)
        return holders_for(self.slot, hosts=self.table.hosts, replicas=self.config.replicas,
                           strategy=self.config.placement, dead=dead)

    def _live(self) -> dict[int, object]:
        with self._lock:
            return {s: h for s, h in self._handles.items() if s not in self._dead}

    def _mark_dead(self, slot: int, why: str) -> None:
        with self._lock:
            if slot in self._dead:
                return
            self._dead[slot] = why
        message = (f"rank {self.rank}: host store of slot {slot} (node {self.table.nodes[slot][:12]}) is "
                   f"unusable: {why}; later versions are placed over the surviving hosts")
        log.error("%s", message)
        if self._registry is not None:
            self._registry.report_failure.remote(slot, self.table.nodes[slot], message)

    # --- write ---------------------------------------------------------------------------------
    def put_file(self, step: int, name: str, data) -> None:
        """Send the file to every holder over the data plane, in parallel, straight into their
        buffers; return when every holder acknowledged it (see the module docstring)."""
        arr = as_uint8(data)
        self._forget_cached(step)
        slots = self.holders()
        total = arr.nbytes
        put_id = uuid.uuid4().hex
        deadline = time.monotonic() + self.config.timeout_s
        t0 = time.perf_counter()
        if total == 0:
            return self._put_empty(step, name, put_id, slots, deadline)
        header = Header(self.config.resolved_namespace, step, name, 0, total, total=total, put_id=put_id,
                        meta=json.dumps({"owner": self.slot, "holders": list(slots),
                                         "epoch": self.table.epoch}).encode())
        sends = []
        try:
            for slot in slots:
                sends.append((slot, self._send(slot, header, arr)))
            # The first holder to fail fails the put at once, not after the others finished.
            concurrent.futures.wait([sent for _, sent in sends], return_when=concurrent.futures.FIRST_EXCEPTION,
                                    timeout=max(0.001, deadline - time.monotonic()))
            for slot, sent in sorted(sends, key=lambda ss: not (ss[1].done() and ss[1].exception())):
                self._await_sent(slot, sent, step, name, deadline)
        except BaseException:
            # Transfers still running read ``arr``, which the caller reuses once we return:
            # closing their channels stops them (and their holders drop the partial copies).
            for slot, sent in sends:
                if not sent.done():
                    with self._lock:
                        channel = self._channels.pop(slot, None)
                    if channel is not None:
                        channel.close()
            # The holders that took part of the file would keep it until the next commit.
            live = self._live()
            for slot in slots:
                if slot in live:
                    live[slot].discard.remote(step, name, put_id, self.table.epoch)
            raise
        self.stats.bytes_put += total
        self.stats.last_put_s = time.perf_counter() - t0

    def _send(self, slot: int, header: Header, arr: np.ndarray):
        """Start sending; a cached channel found broken (its peer restarted or died since the
        last version) is reopened once, which tells a dead store from a restarted one."""
        try:
            return self._channel(slot, header.step, header.name).send_async(header, arr)
        except TransportError:
            with self._lock:
                self._channels.pop(slot, None)
        try:
            return self._channel(slot, header.step, header.name).send_async(header, arr)
        except TransportError as exc:
            with self._lock:
                self._channels.pop(slot, None)
            raise ReplicationError(f"rank {self.rank}: step {header.step}: cannot send {header.name} to "
                                   f"{self._describe_slot(slot)}: {type(exc).__name__}: {exc}") from None

    def _channel(self, slot: int, step: int, name: str):
        """The data-plane channel to ``slot``'s host store (opened, and its listener started,
        on first use; reopened after a failure)."""
        with self._lock:
            channel = self._channels.get(slot)
        if channel is not None:
            return channel
        transport = self._data_plane()
        handle = self._live().get(slot)
        where = self._describe_slot(slot)
        if handle is None:
            raise ReplicationError(f"rank {self.rank}: step {step}: the host store of {where} is gone; {name} "
                                   f"cannot be copied there and the version is not committed")
        try:
            endpoint = ray.get(handle.start_data_plane.remote(self._secret), timeout=self.config.timeout_s)
            channel = transport.connect(endpoint)
        except RayActorError:
            self._mark_dead(slot, "died")
            raise ReplicationError(f"rank {self.rank}: step {step}: the host store of {where} died; the version "
                                   f"is not committed and the next one goes to the surviving hosts") from None
        except (TransportError, GetTimeoutError, RayTaskError) as exc:
            raise ReplicationError(f"rank {self.rank}: step {step}: cannot open the data plane to {where}: "
                                   f"{type(exc).__name__}: {exc}") from None
        with self._lock:
            self._channels[slot] = channel
        return channel

    def _await_sent(self, slot: int, sent, step: int, name: str, deadline: float) -> None:
        where = f"slot {slot} (node {self.table.nodes[slot][:12]})"
        try:
            concurrent.futures.wait([sent], timeout=max(0.001, deadline - time.monotonic()))
            if sent.done():
                sent.result()  # a transport error is raised here (ProgressTimeoutError is a TimeoutError)
                return
            raise CheckpointTimeoutError(
                f"rank {self.rank}: step {step}: the host store of {where} did not acknowledge {name} "
                f"within {self.config.timeout_s}s (CheckpointConfig.timeout_s); the version is not "
                f"committed") from None
        except TransferRejectedError as exc:
            # The holder's refusal reads "<built-in exception>: <its message>".
            found = re.search(r"\b(MemoryError|PermissionError): (.*)", str(exc), re.S)
            kind, why = found.groups() if found else ("", str(exc))
            message = f"rank {self.rank}: step {step}: {where} refused {name}: {why}"
            raise {"MemoryError": MemoryBudgetError, "PermissionError": FencedError}.get(
                kind, ReplicationError)(message) from None
        except TransportError as exc:
            with self._lock:
                self._channels.pop(slot, None)
            if not self._alive(slot):
                self._mark_dead(slot, f"died ({type(exc).__name__})")
                raise ReplicationError(
                    f"rank {self.rank}: step {step}: the host store of {where} died while receiving {name}; "
                    f"the version is not committed and the next one goes to the surviving hosts") from None
            raise ReplicationError(f"rank {self.rank}: step {step}: copying {name} to {where} failed: "
                                   f"{type(exc).__name__}: {exc}") from None

    def _alive(self, slot: int) -> bool:
        handle = self._live().get(slot)
        if handle is None:
            return False
        try:
            ray.get(handle.ping.remote(), timeout=min(5.0, self.config.timeout_s))
            return True
        except RayActorError:
            return False
        except GetTimeoutError:
            return True  # busy, not known dead

    def _put_empty(self, step: int, name: str, put_id: str, slots: tuple[int, ...], deadline: float) -> None:
        live = self._live()
        acks = [(s, live[s].put_chunk.remote(step, name, put_id, 0, 0, np.empty(0, np.uint8), self.slot, slots,
                                             self.table.epoch)) for s in slots if s in live]
        self._await_acks(acks, step, name, deadline)

    def close(self) -> None:
        """Close the data-plane channels (the host stores keep every version)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            transport, self._transport = self._transport, None
            listener, self._read_listener = self._read_listener, None
            self._peers_started = set()
        for channel in channels:
            channel.close()
        if listener is not None:
            listener.close()
        if transport is not None:
            transport.close()

    def _await_acks(self, acks, step: int, name: str, deadline: float) -> None:
        for slot, ack in acks:
            where = f"slot {slot} (node {self.table.nodes[slot][:12]})"
            try:
                ray.get(ack, timeout=max(0.001, deadline - time.monotonic()))
            except GetTimeoutError:
                raise CheckpointTimeoutError(
                    f"rank {self.rank}: step {step}: the host store of {where} did not acknowledge {name} "
                    f"within {self.config.timeout_s}s (CheckpointConfig.timeout_s); the version is not "
                    f"committed") from None
            except RayTaskError as exc:
                raise _cause(exc, f"rank {self.rank}: step {step}: {where} refused {name}: ") from None
            except RayActorError as exc:
                self._mark_dead(slot, f"died ({type(exc).__name__})")
                raise ReplicationError(
                    f"rank {self.rank}: step {step}: the host store of {where} died while receiving {name}; "
                    f"the version is not committed and the next one goes to the surviving hosts") from None
            except RayError as exc:
                raise ReplicationError(f"rank {self.rank}: step {step}: copying {name} to {where} failed: "
                                       f"{type(exc).__name__}: {exc}") from None

    def commit(self, step: int, manifest: VersionManifest) -> None:
        index = self._gather("index")
        problems, holder_slots, put_ids = [], set(), {}
        for name, size in sorted(manifest.file_sizes.items()):
            records = [(s, ix[step]["files"][name]) for s, ix in index.items()
                       if step in ix and name in ix[step]["files"]]
            if not records:
                problems.append(f"{name} is on no live host store (never put, or every holder died)")
                continue
            # The newest put of the file is this version's; older copies (a failed attempt, or
            # an earlier version of the same step on hosts that are no longer its holders) go.
            newest = max(records, key=lambda sr: sr[1]["put_unix"])[1]
            put_ids[name] = newest["put_id"]
            declared = tuple(newest["holders"])
            holder_slots.update(declared)
            held = {s for s, r in records if r["put_id"] == newest["put_id"] and r["complete"]
                    and r["nbytes"] == size}
            missing = sorted(set(declared) - held)
            if newest["nbytes"] != size:
                problems.append(f"{name} holds {newest['nbytes']} bytes, the manifest says {size}")
            elif missing:
                problems.append(f"{name} has no complete copy on holder slot(s) {missing} "
                                f"({', '.join(self._describe_slot(s) for s in missing)})")
        if problems:
            raise IncompleteVersionError(f"cannot commit step {step}: " + "; ".join(problems)
                                         + "; the version is not committed")
        # The host stores keep the manifest as opaque bytes: JSON plus the metadata bytes
        # (checked by their CRC32C), signed when a key is set; never a pickle.
        encoded = encode_manifest(sign(manifest, resolve_key(self.config.signing_key)))
        failed = self._gather("commit", step, encoded, dict(manifest.file_sizes),
                              uuid.uuid4().hex, put_ids, self.table.epoch, errors=True)
        self._forget_cached(step)
        fatal = {s: e for s, e in failed.items() if s in holder_slots or not isinstance(e, RayActorError)}
        if not fatal and len(failed) < len(index):
            # Older versions that lost every copy of some file can never be restored: free them.
            for old in resolve_versions(index).values():
                if old.step < step and old.had_commit and not old.committed:
                    log.warning("rank %d: step %d lost every copy of a shard; dropping what is left of it",
                                self.rank, old.step)
                    self.drop(old.step)
            return
        self.drop(step)  # roll back: no store keeps a half-committed version
        first = next(iter(fatal.values()), next(iter(failed.values()), None))
        if isinstance(first, ValueError):
            raise IncompleteVersionError(f"cannot commit step {step}: {first}; the version is not committed")
        if isinstance(first, CheckpointError):
            raise first
        raise ReplicationError(f"cannot commit step {step}: host store(s) of slot(s) {sorted(failed)} failed "
                               f"while committing: {first}; the version is not committed")

    # --- read ----------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps with a commit whose every file has a complete copy on a live store that
        holds that same commit (so manifest and bytes always come from one version)."""
        versions = resolve_versions(self._gather("index"), local_slot=self.slot)
        with self._lock:
            self._where = {step: v.files for step, v in versions.items()}
            self._chosen = {step: v.commit_slots for step, v in versions.items() if v.committed}
            return sorted(self._chosen)

    def manifest(self, step: int) -> VersionManifest:
        with self._lock:
            slots = self._chosen.get(step)
        if slots is None:
            self.committed_steps()
            with self._lock:
                slots = self._chosen.get(step)
        if slots is None:
            raise VersionNotFoundError(f"step {step} is not committed on the live host stores of namespace "
                                       f"{self.config.resolved_namespace!r}")
        damaged: Optional[VerificationError] = None
        for slot in sorted(slots, key=lambda s: (s != self.slot, s)):
            handle = self._live().get(slot)
            if handle is None:
                continue
            try:
                return decode_manifest(ray.get(handle.manifest.remote(step), timeout=self.config.timeout_s))
            except VerificationError as exc:
                damaged = VerificationError(f"step {step}: the manifest held by {self._describe_slot(slot)} "
                                            f"is damaged: {exc}")
                log.warning("rank %d: %s; trying another holder", self.rank, damaged)
            except RayActorError:
                self._mark_dead(slot, "died")
            except RayTaskError as exc:
                if not isinstance(exc.cause, LookupError):
                    raise _cause(exc) from None
            except GetTimeoutError:
                log.warning("rank %d: %s did not answer manifest(%d)", self.rank, self._describe_slot(slot), step)
        if damaged is not None:
            raise damaged
        raise VersionNotFoundError(f"step {step}: no live host store that committed it answers")

    def read_range(self, step: int, name: str, offset: int, length: int, *, skip: int = 0) -> memoryview:
        """Bytes of a committed version's file from the first live holder that answers (local
        first). Small ranges come through a read-ahead stream over the file in
        ``READ_BLOCK_BYTES`` blocks, ``READ_AHEAD_BLOCKS`` of them requested ahead of the reader.
        ``skip=n`` passes over the first ``n`` holders that answer and reads exactly this range
        from the next one (a reader whose copy failed its checksum); LookupError when there is
        no further holder."""
        size, slots = self._locate(step, name)
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside {name} ({size} bytes)")
        if length == 0:
            return memoryview(b"")
        if not skip and length < READ_BLOCK_BYTES:
            with self._lock:
                stream = self._stream
            if stream is not None and stream.key == (step, name) and stream.slot not in self.dead_slots:
                try:
                    out = stream.read(offset, length)
                    self._count_read(stream.slot, length)
                    return out
                except RayActorError:
                    self._mark_dead(stream.slot, "died")
                except (RayTaskError, GetTimeoutError) as exc:
                    log.warning("rank %d: read-ahead of %s from %s failed (%s); reading again",
                                self.rank, name, self._describe_slot(stream.slot), type(exc).__name__)
                with self._lock:
                    self._stream = None
        answered = 0
        for slot in slots:
            handle = self._live().get(slot)
            if handle is None:
                continue
            stream = None
            try:
                if not skip and length < READ_BLOCK_BYTES:
                    stream = _BlockStream((step, name), slot, size, self._fetcher(slot, handle, step, name),
                                          self._resolve)
                    out = stream.read(offset, length)
                else:
                    out = memoryview(self._resolve(self._fetcher(slot, handle, step, name)(offset, length)))
            except RayActorError:
                self._mark_dead(slot, "died")
                continue
            except RayTaskError as exc:
                if isinstance(exc.cause, ConnectionError):  # the data plane to that holder broke
                    log.warning("rank %d: reading %s from %s failed: %s", self.rank, name,
                                self._describe_slot(slot), exc.cause)
                    continue
                if isinstance(exc.cause, LookupError):
                    continue
                raise _cause(exc) from None
            except GetTimeoutError:
                log.warning("rank %d: %s did not answer a read of %s", self.rank, self._describe_slot(slot), name)
                continue
            answered += 1
            if answered <= skip:
                continue
            if stream is not None:
                with self._lock:
                    self._stream = stream
            self._count_read(slot, length)
            return out
        if skip:
            raise VersionNotFoundError(f"step {step}: no live host store holds copy {skip + 1} of {name!r}")
        raise VersionNotFoundError(f"step {step}: no live host store holds a complete copy of {name!r}")

    def _fetcher(self, slot: int, handle, step: int, name: str):
        """``fetch(offset, length) -> pending read``: from the local store through Ray (which
        maps its result without another copy), from a peer over the data plane (the peer
        pushes the range straight into a buffer of ours)."""
        if slot == self.slot:
            return lambda offset, length: _PendingRead(handle.read.remote(step, name, offset, length))
        endpoint = self._reader_endpoint(slot, handle)

        def fetch(offset: int, length: int) -> _PendingRead:
            tag, into = uuid.uuid4().hex, np.empty(length, dtype=np.uint8)
            self._read_sink.expect(tag, into)
            return _PendingRead(handle.push_range.remote(step, name, offset, length, endpoint, tag), into, tag)

        return fetch

    def _resolve(self, pending: "_PendingRead"):
        try:
            out = ray.get(pending.ref, timeout=self.config.timeout_s)
        finally:
            if pending.tag:
                self._read_sink.forget(pending.tag)
        return out if pending.into is None else pending.into

    def _reader_endpoint(self, slot: int, handle) -> Endpoint:
        """This reader's data-plane listener (started on first use), after making sure the
        peer's data plane runs (it pushes to us with the namespace's secret)."""
        with self._lock:
            started = slot in self._peers_started
            listener = self._read_listener
        if not started:
            ray.get(handle.start_data_plane.remote(self._secret), timeout=self.config.timeout_s)
            with self._lock:
                self._peers_started.add(slot)
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
                self._transport = TcpTransport(
                    bytes.fromhex(self._secret), self.config.resolved_namespace, host_name=self.node_id,
                    config=TcpConfig(max_send_bytes_per_s=self.config.replication_bandwidth,
                                 progress_timeout_s=PROGRESS_TIMEOUT_S))
            return self._transport

    def _count_read(self, slot: int, nbytes: int) -> None:
        if slot == self.slot:
            self.stats.bytes_read_local += nbytes
        else:
            self.stats.bytes_read_peer += nbytes

    def _locate(self, step: int, name: str) -> tuple[int, tuple[int, ...]]:
        with self._lock:
            found = self._where.get(step, {}).get(name)
        if found is None:
            self.committed_steps()  # refreshes the locations of every step
            with self._lock:
                found = self._where.get(step, {}).get(name)
        if found is None:
            raise VersionNotFoundError(f"step {step} has no data file {name!r} on any live host store")
        return found

    # --- durable tier --------------------------------------------------------------------------
    def persist(self, step: int, uri: str, directory: str) -> dict[int, int]:
        """Have the host stores write ``step``'s data files to ``uri``/``directory`` from their
        memory, in parallel: each file by its owner's host when that host holds it (so each
        host writes its own ranks' shards), else by the first other live holder. Returns bytes
        written per slot. Called by the coordinator; the trainer's memory is not involved."""
        self.committed_steps()  # refresh where every file lives
        with self._lock:
            files = dict(self._where.get(step, {}))
        if not files:
            raise VersionNotFoundError(f"step {step} is not held by any live host store")
        index = self._gather("index")
        by_slot: dict[int, list[str]] = {}
        for name, (_, slots) in files.items():
            owner = next((index[s][step]["files"][name]["owner"] for s in slots
                          if s in index and step in index[s] and name in index[s][step]["files"]), None)
            writer = owner if owner in slots else slots[0]
            by_slot.setdefault(writer, []).append(name)
        live = self._live()
        calls = {s: live[s].persist_files.remote(step, uri, directory, names) for s, names in by_slot.items()}
        written = {}
        for slot, ref in calls.items():
            try:
                written[slot] = ray.get(ref, timeout=self.config.timeout_s)
            except RayActorError:
                self._mark_dead(slot, "died while persisting")
                raise ReplicationError(f"step {step}: the host store of {self._describe_slot(slot)} died while "
                                       f"writing to the durable tier; the version is not persisted") from None
            except RayTaskError as exc:
                raise _cause(exc, f"step {step}: persisting from {self._describe_slot(slot)}: ") from None
        return written

    # --- retention -----------------------------------------------------------------------------
    def drop(self, step: int) -> None:
        self._gather("drop", step, self.table.epoch)
        self._forget_cached(step)

    def _forget_cached(self, step: int) -> None:
        with self._lock:
            self._where.pop(step, None)
            self._chosen.pop(step, None)
            if self._stream is not None and self._stream.key[0] == step:
                self._stream = None

    # --- helpers -------------------------------------------------------------------------------
    def _gather(self, method: str, *args, errors: bool = False) -> dict:
        """Call ``method`` on every live store in parallel. Returns slot -> result, or with
        ``errors=True`` slot -> exception for the stores that failed. Dead stores are marked;
        stores that do not answer in time are left out (and logged)."""
        calls = {s: getattr(h, method).remote(*args) for s, h in self._live().items()}
        deadline = time.monotonic() + self.config.timeout_s
        results, failures = {}, {}
        for slot, ref in calls.items():
            try:
                results[slot] = ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
            except RayActorError as exc:
                self._mark_dead(slot, f"died ({type(exc).__name__})")
                failures[slot] = exc
            except RayTaskError as exc:
                if not errors:
                    raise _cause(exc, f"{self._describe_slot(slot)}: ") from None
                failures[slot] = _cause(exc, f"{self._describe_slot(slot)}: ")
            except GetTimeoutError as exc:
                log.warning("rank %d: %s did not answer %s within %ss", self.rank, self._describe_slot(slot),
                            method, self.config.timeout_s)
                failures[slot] = exc
        return failures if errors else results

    def _describe_slot(self, slot: int) -> str:
        why = self._dead.get(slot)
        state = f", {why}" if why else ""
        return f"slot {slot} on node {self.table.nodes[slot][:12]}{state}"


@dataclass(frozen=True)
class ResolvedVersion:
    """What the live stores hold of one step, by the rule of ``committed_steps``."""

    step: int
    committed: bool
    commit_slots: tuple[int, ...]  # stores holding the chosen commit (empty: not committed)
    files: dict[str, tuple[int, tuple[int, ...]]]  # name -> (bytes, slots with a complete copy, read order)
    had_commit: bool = False  # some store holds a commit of it (committed=False then: a copy is lost)


class _BlockStream:
    """One file of one version read from one holder on a fixed grid of ``READ_BLOCK_BYTES``
    blocks, up to ``READ_AHEAD_BLOCKS`` requested ahead of the reader. DCP reads a file's
    items in offset order, so blocks behind the reader are dropped as it moves on."""

    def __init__(self, key: tuple[int, str], slot: int, size: int, fetch, resolve) -> None:
        self.key, self.slot, self.size, self.fetch, self.resolve = key, slot, size, fetch, resolve
        self.blocks: dict[int, Any] = {}  # block index -> a pending read, then the bytes once fetched

    def read(self, offset: int, length: int) -> memoryview:
        first, last = offset // READ_BLOCK_BYTES, max(offset + length - 1, offset) // READ_BLOCK_BYTES
        for i in [i for i in self.blocks if i < first]:
            del self.blocks[i]
        n_blocks = -(-self.size // READ_BLOCK_BYTES)
        for i in range(first, min(last + 1 + READ_AHEAD_BLOCKS, n_blocks)):
            if i not in self.blocks:
                start = i * READ_BLOCK_BYTES
                self.blocks[i] = self.fetch(start, min(READ_BLOCK_BYTES, self.size - start))
        parts = []
        for i in range(first, last + 1):
            block = self.blocks[i]
            if isinstance(block, _PendingRead):
                block = self.blocks[i] = self.resolve(block)
            lo = max(offset - i * READ_BLOCK_BYTES, 0)
            hi = min(offset + length - i * READ_BLOCK_BYTES, READ_BLOCK_BYTES)
            parts.append(block[lo:hi])
        return memoryview(parts[0] if len(parts) == 1 else np.concatenate(parts))


@dataclass(frozen=True)
class _PendingRead:
    """A read in flight: the call's ref, and for a peer's push the buffer it lands in."""

    ref: Any
    into: Optional[np.ndarray] = None
    tag: str = ""


class _ReadSink:
    """Where peers push the ranges a restore asked for (one buffer per request tag)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, np.ndarray] = {}

    def expect(self, tag: str, into: np.ndarray) -> None:
        with self._lock:
            self._expected[tag] = into

    def forget(self, tag: str) -> None:
        with self._lock:
            self._expected.pop(tag, None)

    def buffer_for(self, header: Header) -> memoryview:
        with self._lock:
            into = self._expected.get(header.put_id)
        if into is None or into.nbytes != header.length:
            raise ValueError(f"no read of {header.length} bytes of {header.name} is expected under this tag")
        return memoryview(into)

    def received(self, header: Header) -> None:
        pass  # the push call's return says so

    def failed(self, header: Header, error: BaseException) -> None:
        pass  # the push call raises


def resolve_versions(index: dict[int, dict], *, local_slot: Optional[int] = None) -> dict[int, ResolvedVersion]:
    """Decide, from every live store's ``index()`` (slot -> index), which steps are committed
    and where each file's readable copies are. A step is committed when some commit of it
    (``commit_id``) has every file complete on stores holding that same commit; the newest
    such commit wins and its stores are where it is read from. Otherwise its complete files
    (the newest put of each) stay readable, but the step is not listed."""
    out: dict[int, ResolvedVersion] = {}
    for step in sorted({st for ix in index.values() for st in ix}):
        commits: dict[str, list[int]] = {}
        for slot, ix in index.items():
            v = ix.get(step)
            if v is not None and v["committed"]:
                commits.setdefault(v["commit_id"], []).append(slot)
        newest_first = sorted(commits.values(), key=lambda slots: -max(index[s][step]["committed_unix"]
                                                                        for s in slots))
        for slots in newest_first:
            needs = index[slots[0]][step]["needs"]
            files = _copies(index, step, slots, local_slot)
            if all(name in files and files[name][0] == size for name, size in needs.items()):
                out[step] = ResolvedVersion(step, True, tuple(slots), files, True)
                break
        else:
            out[step] = ResolvedVersion(step, False, (), _copies(index, step, list(index), local_slot),
                                        bool(commits))
    return out


def _copies(index: dict, step: int, slots, local_slot: Optional[int]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """file -> (bytes, slots with a complete copy of its newest put; local, then placement order)."""
    records: dict[str, list[tuple[int, dict]]] = {}
    for slot in slots:
        for name, rec in index[slot].get(step, {"files": {}})["files"].items():
            if rec["complete"]:
                records.setdefault(name, []).append((slot, rec))
    out = {}
    for name, recs in records.items():
        newest = max(recs, key=lambda sr: sr[1]["put_unix"])[1]
        declared = tuple(newest["holders"])
        same = [s for s, r in recs if r["put_id"] == newest["put_id"]]

        def key(s: int, declared=declared):
            return (s != local_slot, declared.index(s) if s in declared else len(declared), s)

        out[name] = (newest["nbytes"], tuple(sorted(same, key=key)))
    return out


def _cause(exc: RayTaskError, prefix: str = "") -> BaseException:
    """The library's exception for what an actor raised (actors raise built-ins; see
    :mod:`gemini_ckpt._host_store`), with ``prefix`` in front of its message."""
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
