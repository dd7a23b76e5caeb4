"""The actors: the host store (one per host, shards of recent versions in its own heap) and
the slot registry (one per namespace).

Every byte a host store keeps is copied out of Ray's object store into a numpy array the
actor owns: an ``ObjectRef`` is owned by the worker that put it and dies with that worker,
but the whole point of the host store is that a crashed training process finds its state
here. Each kept file records which slot owns it and the holders it was sent to, so a
status report can say "own" or "replica" and a commit can check that every copy arrived.

Roles and call order (see :mod:`gemini_ckpt._ray_store`, the only caller besides status):

1. each rank, per data file: the file's bytes to every holder of its host, in parallel, over
   the data plane (``start_data_plane`` once: an authenticated TCP listener on the node's
   address; the transport writes straight into the buffer the first bytes reserved against
   the memory budget, see :mod:`gemini_ckpt.ray.transport`). ``put_chunk`` does the same
   through Ray, for empty files;
2. the coordinator (rank 0): ``index`` on every live store to check every copy, then
   ``commit`` on every live store, naming the put of each file that belongs to the version
   and a commit id shared by all stores. Committing step s forgets abandoned (never
   committed) versions older than s. A put into a committed step replaces that version;
3. readers: ``index``, ``manifest``, ``read``;
4. the coordinator, for retention: ``drop``.

The store never interprets the bytes (the manifest arrives encoded and leaves as it came);
checksums are verified by the reader, end to end.

This module is self-contained on purpose (stdlib, numpy and the transport, which is stdlib
only): :mod:`gemini_ckpt._cluster` ships these classes and the transport to Ray by value, so
an actor's process never imports torch and starts in about a second. So actors raise
built-in exceptions, which the client maps onto the library's: ``MemoryError`` (budget),
``LookupError`` (no such version or file), ``ValueError`` (refused), ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gemini_ckpt.ray.transport import Endpoint, Header, TcpConfig, TcpTransport, TransportError

log = logging.getLogger("gemini_ckpt")

PROGRESS_TIMEOUT_S = 5.0  # as the client's (gemini_ckpt._ray_store.PROGRESS_TIMEOUT_S): a dead peer resets at once
DEFAULT_BUDGET_FRACTION = 0.3
"""Default per-host budget: this fraction of the node's RAM (``host_memory_budget_bytes=None``)."""


def default_budget_bytes() -> int:
    import psutil  # a Ray dependency

    return int(DEFAULT_BUDGET_FRACTION * psutil.virtual_memory().total)


@dataclass
class _File:
    array: np.ndarray  # exactly the file's bytes: a view of the first bytes of ``buffer``
    buffer: np.ndarray  # what is reserved against the budget (reused after the version is dropped)
    put_id: str
    owner_slot: int
    holders: tuple[int, ...]
    put_unix: float = 0.0
    received: int = 0
    writers: int = 0  # transfers still using ``buffer`` (writing a put into it, or sending it to a reader)
    orphaned: bool = False  # dropped while written into: its buffer is freed when they stop

    @property
    def complete(self) -> bool:
        return self.received >= self.array.nbytes


@dataclass
class _Version:
    files: dict[str, _File] = field(default_factory=dict)
    manifest: Optional[bytes] = None  # the encoded VersionManifest (opaque here), once committed
    needs: dict[str, int] = field(default_factory=dict)  # its file sizes
    commit_id: str = ""
    committed_unix: float = 0.0


class HostStore:
    """Shards of recent versions, kept in this actor's heap, within a memory budget.

    Run as a Ray actor (see :func:`gemini_ckpt._cluster.get_or_create_store`): detached,
    ``max_restarts=0``, pinned to its node, threaded so puts from several ranks and reads
    proceed in parallel (numpy copies release the GIL).
    """

    def __init__(self, namespace: str, node_id: str, budget_bytes: Optional[int] = None) -> None:
        self.namespace = namespace
        self.node_id = node_id
        self.budget_bytes = int(budget_bytes) if budget_bytes else default_budget_bytes()
        self.started_unix = time.time()
        self._lock = threading.Lock()
        self._versions: dict[int, _Version] = {}
        self._held = 0  # bytes reserved by kept files (complete or not)
        # Buffers of dropped versions, reused by the next ones: a fresh allocation costs a page
        # fault per page on first touch, which is slower than the copy itself. They count
        # against the budget too, and are released first when a put needs the room.
        self._free: list[np.ndarray] = []
        self._discarded: set[str] = set()  # puts given up by their rank: late chunks are ignored
        # Fencing: the newest rendezvous epoch of the namespace seen here. Writes that carry an
        # older one come from a zombie of an earlier attempt (or a second job sharing the
        # namespace by mistake) and are refused, so they can never touch the newer versions.
        self._epoch = 0
        self._listener = None  # the data plane (``start_data_plane``)
        self._writing: dict[tuple, _File] = {}  # transfers in progress -> the record they fill
        self._transport = None
        self._readers: dict[tuple, object] = {}  # (host, port) of a restoring reader -> its channel
        self._secret = b""

    # --- liveness and configuration ---------------------------------------------------------
    def ping(self) -> str:
        return self.node_id

    def fence(self, epoch: int) -> int:
        """The ranks of a new rendezvous (``epoch``) took over: refuse older epochs' writes."""
        with self._lock:
            self._epoch = max(self._epoch, int(epoch))
            return self._epoch

    def _check_epoch(self, epoch: int, what: str) -> None:
        if epoch < self._epoch:
            raise PermissionError(
                f"host store on node {self.node_id[:12]} (namespace {self.namespace!r}) refused {what} from "
                f"epoch {epoch}: a newer Checkpointer (epoch {self._epoch}) took over this namespace")

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self.budget_bytes = int(budget_bytes)

    # --- write ---------------------------------------------------------------------------------
    def put_chunk(self, step: int, name: str, put_id: str, offset: int, total: int, chunk: np.ndarray,
                  owner_slot: int, holders: tuple[int, ...], epoch: int = 0) -> int:
        """Copy ``chunk`` into bytes ``[offset, offset + len(chunk))`` of file ``name`` of
        ``step`` (``total`` bytes long). A new ``put_id`` replaces an earlier put of the same
        file; a put into a committed step replaces that version here (it is uncommitted at
        once, as the store protocol says). Returns the bytes of the file received so far."""
        n = int(chunk.nbytes)
        if offset < 0 or offset + n > total:
            raise ValueError(f"chunk [{offset}, {offset + n}) is outside {name} ({total} bytes)")
        with self._lock:
            record = self._record_for(step, name, put_id, total, owner_slot, holders, epoch)
            if record is None:
                return 0
        # The copy out of the object store runs without the lock: other ranks' puts and
        # reads of other files proceed meanwhile.
        if n:
            record.array[offset : offset + n] = np.asarray(chunk, dtype=np.uint8).reshape(-1)
        with self._lock:
            record.received += n
            return record.received

    def _record_for(self, step: int, name: str, put_id: str, total: int, owner_slot: int,
                    holders: tuple[int, ...], epoch: int) -> Optional[_File]:
        """The record a put of ``name`` writes into, reserved against the budget on its first
        bytes; None for a put its rank gave up on. Call with the lock held."""
        self._check_epoch(epoch, f"a put of {name} of step {step}")
        if put_id in self._discarded:
            return None
        version = self._versions.get(step)
        if version is not None and version.manifest is not None:
            log.info("node %s: step %d is saved again; its committed version here is replaced",
                     self.node_id[:12], step)
            self._forget(step)
            version = None
        record = version.files.get(name) if version is not None else None
        if record is None or record.put_id != put_id:
            replaced = record.buffer.nbytes if record is not None else 0
            if self._held - replaced + total > self.budget_bytes:
                raise MemoryError(self._budget_message(step, name, total, replaced))
            if version is None:
                version = self._versions[step] = _Version()
            if record is not None:
                self._release(record)
            buffer = self._reserve(total)
            record = _File(buffer[:total], buffer, put_id, int(owner_slot), tuple(holders), time.time())
            version.files[name] = record
        return record

    # --- data plane: puts arrive over the transport, straight into the kept buffers ----------
    def start_data_plane(self, secret_hex: str) -> Endpoint:
        """Listen for puts from this namespace's ranks on the node's address (idempotent; a
        new secret, after the registry was recreated, restarts the listener). Returns the
        endpoint ranks connect to."""
        secret = bytes.fromhex(secret_hex)
        with self._lock:
            if self._listener is not None and self._secret == secret:
                return self._listener.endpoint
            old, self._listener, self._secret = self._listener, None, secret
        if old is not None:
            old.close()
        import ray

        transport = TcpTransport(secret, self.namespace, host_name=self.node_id,
                                 config=TcpConfig(progress_timeout_s=PROGRESS_TIMEOUT_S))
        listener = transport.listen(ray.util.get_node_ip_address(), _PutSink(self))
        with self._lock:
            self._listener, self._transport, self._readers = listener, transport, {}
        return listener.endpoint

    def push_range(self, step: int, name: str, offset: int, length: int, reader: Endpoint, tag: str) -> int:
        """Send bytes ``[offset, offset + length)`` of a complete file to a reader's data-plane
        listener (a restore reading from a peer); returns once the reader has them. The buffer
        is not reused while it is being sent, whatever happens to the version meanwhile."""
        with self._lock:
            version = self._versions.get(step)
            record = version.files.get(name) if version is not None else None
            if record is None or not record.complete:
                raise LookupError(f"step {step} has no complete data file {name!r} on node {self.node_id[:12]}")
            if offset < 0 or length <= 0 or offset + length > record.array.nbytes:
                raise ValueError(f"range [{offset}, {offset + length}) is outside {name} ({record.array.nbytes} bytes)")
            if self._transport is None:
                raise LookupError(f"the data plane of node {self.node_id[:12]} is not started")
            record.writers += 1
            transport, key = self._transport, (reader.host, reader.port)
            channel = self._readers.get(key)
        try:
            if channel is None:
                channel = transport.connect(reader)
                with self._lock:
                    self._readers[key] = channel
            channel.send(Header(self.namespace, step, name, offset, length, total=record.array.nbytes, put_id=tag),
                         record.array[offset : offset + length], timeout=600)
        except TransportError as exc:
            with self._lock:
                self._readers.pop(key, None)
            raise ConnectionError(f"node {self.node_id[:12]} could not send {name} to the reader: {exc}") from None
        finally:
            with self._lock:
                record.writers -= 1
                if record.orphaned and not record.writers:
                    self._release(record)
        return length

    def _incoming(self, header: Header) -> memoryview:
        put = json.loads(header.meta)
        with self._lock:
            record = self._record_for(header.step, header.name, header.put_id, header.total, put["owner"],
                                      tuple(put["holders"]), put["epoch"])
            if record is None:
                raise ValueError(f"the put of {header.name} of step {header.step} was given up by its rank")
            if record.array.nbytes != header.total:
                raise ValueError(f"{header.name}: {header.total} bytes announced, {record.array.nbytes} reserved")
            record.writers += 1
            self._writing[_transfer_key(header)] = record
        return memoryview(record.array[header.offset : header.offset + header.length])

    def _transfer_ended(self, header: Header, ok: bool) -> None:
        with self._lock:
            record = self._writing.pop(_transfer_key(header), None)
            if record is None:
                return
            record.writers -= 1
            if ok and not record.orphaned:
                record.received += header.length
            if record.orphaned and not record.writers:
                self._release(record)

    def _reserve(self, total: int) -> np.ndarray:
        """A buffer of at least ``total`` bytes: a pooled one of about that size, else a new one
        (after releasing pooled buffers as far as the budget needs). Call with the lock held."""
        slack = max(1 << 20, total // 8)
        fits = [b for b in self._free
                if total <= b.nbytes <= total + slack and self._held + b.nbytes <= self.budget_bytes]
        if fits:
            buffer = min(fits, key=lambda b: b.nbytes)
            self._free = [b for b in self._free if b is not buffer]
        else:
            pooled = sum(b.nbytes for b in self._free)
            while self._free and self._held + pooled + total > self.budget_bytes:
                pooled -= self._free.pop(0).nbytes
            buffer = np.empty(total, dtype=np.uint8)
        self._held += buffer.nbytes
        return buffer

    def _release(self, record: _File) -> None:
        if record.writers:
            record.orphaned = True  # the transport still writes into it: never reuse it before it stops
            return
        buffer = record.buffer
        self._held -= buffer.nbytes
        if buffer.nbytes:
            self._free.append(buffer)

    def _budget_message(self, step: int, name: str, total: int, replaced: int) -> str:
        held = {s: sum(f.buffer.nbytes for f in v.files.values()) for s, v in sorted(self._versions.items())}
        return (
            f"host store on node {self.node_id[:12]} (namespace {self.namespace!r}): keeping {name} of "
            f"step {step} ({total:,} bytes) would exceed the memory budget of {self.budget_bytes:,} bytes "
            f"(CheckpointConfig.host_memory_budget_bytes); it already holds {self._held - replaced:,} bytes "
            f"in steps {held}. A host needs about (keep_in_memory + 1) x replicas x shard bytes; raise "
            f"host_memory_budget_bytes, or lower keep_in_memory or replicas"
        )

    def commit(self, step: int, manifest: bytes, needs: dict[str, int], commit_id: str,
               put_ids: dict[str, str], epoch: int = 0) -> None:
        """Keep ``manifest`` (encoded by the client, never read here; ``needs`` are its file
        sizes) and mark ``step`` committed
        here as ``commit_id``. ``put_ids`` names
        the put of each file that belongs to this version; other copies (an earlier attempt, or
        an earlier version of the same step) are discarded. Raises when a file of the version
        held here is incomplete or not of the size the manifest names."""
        with self._lock:
            self._check_epoch(epoch, f"committing step {step}")
            version = self._versions.setdefault(step, _Version())
            for name, record in list(version.files.items()):
                if put_ids.get(name) != record.put_id:
                    self._release(record)
                    del version.files[name]
                    continue
                size = needs[name]
                if record.array.nbytes != size or not record.complete:
                    raise ValueError(
                        f"cannot commit step {step} on node {self.node_id[:12]}: {name} holds "
                        f"{record.received} of {record.array.nbytes} bytes, the manifest says {size}")
            version.manifest = manifest
            version.needs = dict(needs)
            version.commit_id = commit_id
            version.committed_unix = time.time()
            for old in [s for s, v in self._versions.items() if s < step and v.manifest is None]:
                self._forget(old)  # an abandoned save: its bytes would never be read

    # --- read ----------------------------------------------------------------------------------
    def index(self) -> dict[int, dict]:
        """Per step: ``committed``, ``commit_id``, ``committed_unix``, the files the manifest
        needs (name -> bytes) and the files held here (name -> bytes, complete, owner slot,
        holders, put id, put time)."""
        with self._lock:
            return {
                step: {
                    "committed": v.manifest is not None,
                    "commit_id": v.commit_id,
                    "committed_unix": v.committed_unix,
                    "needs": dict(v.needs),
                    "files": {
                        name: {"nbytes": f.array.nbytes, "complete": f.complete, "owner": f.owner_slot,
                               "holders": f.holders, "put_id": f.put_id, "put_unix": f.put_unix}
                        for name, f in v.files.items()
                    },
                }
                for step, v in self._versions.items()
            }

    def manifest(self, step: int) -> bytes:
        with self._lock:
            version = self._versions.get(step)
            if version is None or version.manifest is None:
                raise LookupError(f"step {step} is not committed on node {self.node_id[:12]}")
            return version.manifest

    def read(self, step: int, name: str, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of a complete file, as a numpy slice (Ray hands
        it to a reader on this node without another copy)."""
        with self._lock:
            version = self._versions.get(step)
            record = version.files.get(name) if version is not None else None
            if record is None or not record.complete:
                raise LookupError(f"step {step} has no complete data file {name!r} on node "
                                           f"{self.node_id[:12]}")
            arr = record.array
        if offset < 0 or length < 0 or offset + length > arr.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside {name} ({arr.nbytes} bytes)")
        return arr[offset : offset + length]

    def corrupt_for_test(self, step: int, name: str, offset: int) -> int:
        """Flip one byte of a kept copy (in place): lets tests and the chaos harness prove that
        checksums bite and that a reader moves on to another holder. Returns ``offset``."""
        with self._lock:
            record = self._versions[step].files[name]
            record.array[offset] ^= 0xFF
        return offset

    def persist_files(self, step: int, uri: str, directory: str, names: list[str]) -> int:
        """Write these complete data files of ``step`` to ``directory`` (a path inside the
        ``pyarrow.fs`` location ``uri``), straight from this store's memory: the durable tier's
        step 1 for this host. Returns the bytes written. The coordinator writes the metadata
        and the completion marker once every host returned."""
        import os
        import posixpath

        import pyarrow.fs as pafs

        if "://" in uri:
            fs, root = pafs.FileSystem.from_uri(uri)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        target = posixpath.join(root, directory)
        fs.create_dir(target, recursive=True)
        written = 0
        for name in names:
            with self._lock:
                version = self._versions.get(step)
                record = version.files.get(name) if version is not None else None
                if record is None or not record.complete:
                    raise LookupError(f"step {step} has no complete data file {name!r} on node {self.node_id[:12]}")
                arr = record.array
            with fs.open_output_stream(posixpath.join(target, name)) as out:
                out.write(arr)
            written += arr.nbytes
        return written

    def discard(self, step: int, name: str, put_id: str, epoch: int = 0) -> None:
        """Forget a put its rank gave up on (another holder failed): its partial copy would
        only take memory until the next commit."""
        with self._lock:
            self._check_epoch(epoch, f"a discard of {name} of step {step}")
            self._discarded.add(put_id)
            if len(self._discarded) > 1024:
                self._discarded.pop()
            version = self._versions.get(step)
            record = version.files.get(name) if version is not None else None
            if record is not None and record.put_id == put_id and version.manifest is None:
                self._release(record)
                del version.files[name]

    # --- retention -----------------------------------------------------------------------------
    def drop(self, step: int, epoch: int = 0) -> int:
        """Forget ``step`` (idempotent); returns the bytes freed."""
        with self._lock:
            self._check_epoch(epoch, f"dropping step {step}")
            return self._forget(step)

    def _forget(self, step: int) -> int:
        version = self._versions.pop(step, None)
        if version is None:
            return 0
        freed = 0
        for record in version.files.values():
            freed += record.buffer.nbytes
            self._release(record)
        return freed

    # --- status --------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What ``gemini_ckpt status`` shows for this host (plain data, JSON-ready)."""
        with self._lock:
            return {
                "namespace": self.namespace,
                "node_id": self.node_id,
                "budget_bytes": self.budget_bytes,
                "held_bytes": sum(f.array.nbytes for v in self._versions.values() for f in v.files.values()),
                "reserved_bytes": self._held + sum(b.nbytes for b in self._free),
                "started_unix": self.started_unix,
                "versions": {
                    step: {
                        "committed": v.manifest is not None,
                        "committed_unix": v.committed_unix,
                        "files": {name: {"nbytes": f.array.nbytes, "complete": f.complete,
                                         "owner": f.owner_slot, "holders": list(f.holders)}
                                  for name, f in sorted(v.files.items())},
                    }
                    for step, v in sorted(self._versions.items())
                },
            }


def _transfer_key(header: Header) -> tuple:
    return (header.step, header.name, header.put_id, header.offset)


class _PutSink:
    """The transport's view of a host store: puts land straight in the kept buffers."""

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def buffer_for(self, header: Header) -> memoryview:
        return self.store._incoming(header)

    def received(self, header: Header) -> None:
        self.store._transfer_ended(header, ok=True)

    def failed(self, header: Header, error: BaseException) -> None:
        # The partial copy stays incomplete, so no commit can use it; the rank discards it.
        self.store._transfer_ended(header, ok=False)
        log.info("node %s: a put of %s failed: %s", self.store.node_id[:12], header.describe(), error)


# --- the slot registry ---------------------------------------------------------------------------
_MAX_REPORTS = 50  # failure reports and events the registry keeps for status


def alive_node_ids() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


@dataclass
class _Round:
    pending: dict[int, str] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    table: Optional[dict] = None


class Registry:
    """Slot table of one namespace (see :mod:`gemini_ckpt._cluster` for the rule), plus the
    failures ranks reported and the slot events, for status. An async actor: ``join`` waits."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._nodes: list[str] = []
        self._epoch = 0
        self._round: Optional[_Round] = None
        self._failures: list[dict] = []
        self._events: list[dict] = []
        # The data plane's shared secret: ranks get it at the rendezvous, host stores from their
        # ranks; a connection that cannot prove it gets no bytes and can write none.
        self._secret = os.urandom(32).hex()

    async def join(self, rank: int, world_size: int, node_id: str, timeout_s: float) -> dict:
        """Rendezvous of all ranks; returns the slot table (``nodes``, ``epoch``, ``ranks``)
        that every rank of this round shares."""
        if self._round is None:
            self._round = _Round()
        rnd = self._round
        rnd.pending[rank] = node_id
        for stale in [r for r in rnd.pending if r >= world_size]:
            del rnd.pending[stale]
        if all(r in rnd.pending for r in range(world_size)):
            rnd.table = self._assign(rnd.pending)
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

    def _assign(self, pending: dict[int, str]) -> dict:
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
        self._epoch += 1
        return {"nodes": list(self._nodes), "epoch": self._epoch, "ranks": dict(pending), "secret": self._secret}

    def table(self) -> Optional[dict]:
        if not self._nodes:
            return None
        return {"nodes": list(self._nodes), "epoch": self._epoch, "ranks": {}}

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
