"""The tier's read side (restore, persist, holders): which steps the live host stores hold
committed and where each shard's copies are (every store's ``index``, resolved by
:mod:`gemini_ckpt.hoststore.resolve`), a version opened for reading, and this reader's data-plane
listener, where peers push the ranges :mod:`gemini_ckpt.hoststore.readahead` asks for
(:attr:`TierReads.peer_reads`). A shard held on this node is mapped (no transfer); one held only
by peers is pushed by a peer into a buffer here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..settings import StoreSettings
from ..errors import ReadNotStoppedError, ShardFormatError, VersionNotFoundError
from ..format.shards import ShardPlan, ShardRecord
from ..stores.views import MemoryVersion, ShardCopy
from ..timeouts import TIMEOUTS
from .attach_client import AttachClient
from .hosts import HostStores
from .readahead import LocalCopy, PeerCopy, PeerReads, ReadSink
from .resolve import Resolved, resolve
from ..dataplane import Endpoint, TcpConfig, TcpTransport, TransportError

log = logging.getLogger("gemini_ckpt")


class TierReads:
    """One rank's reads of its namespace's host stores (see the module docstring): ``hosts``
    says which stores are live, ``attach`` maps this node's copies, ``secret`` opens the data
    plane."""

    def __init__(
        self,
        settings: StoreSettings,
        *,
        rank: int,
        slot: int,
        node_id: str,
        secret: bytes,
        attach: AttachClient,
        hosts: HostStores,
    ) -> None:
        self.settings, self.rank, self.slot, self.node_id = settings, rank, slot, node_id
        self._secret, self._attach, self._hosts = secret, attach, hosts
        self._lock = threading.Lock()
        self._where: dict[int, Resolved] = {}
        self._surveyed_infos: dict[int, dict] = {}  # step -> slot -> {rank: (plan, record)}, from the survey
        self._prefetched: dict[int, tuple] = {}  # slot -> (its newest committed step, {rank: (plan, record)})
        self._transport: Optional[TcpTransport] = None
        self._read_sink = ReadSink()
        self._read_listener = None
        self.peer_reads = PeerReads(
            sink=self._read_sink,
            endpoint=self._reader_endpoint,
            cancel=self._cancel,
            lost=hosts.mark_dead,
            describe=hosts.describe,
            timeout_s=settings.timeout_s,
        )

    def where(self, step: int) -> Optional[Resolved]:
        """Where ``step``'s copies are, as the last survey found (None: not seen)."""
        with self._lock:
            return self._where.get(step)

    def committed_steps(self, *, prefetch: bool = False) -> list[int]:
        """``prefetch``: each store also sends, read with its index, the plans and records of its
        shards of the newest step it holds committed (its ``survey``; what :meth:`survey_state`
        then asks it for again only when it wants another step): a restore's survey in one round
        of calls instead of two."""
        replies = None
        if prefetch:
            try:
                replies = self._hosts.gather("survey")
            except AttributeError:  # a store left running by a release before ``survey``: two rounds
                log.info("rank %d: a host store has no survey (an earlier release): asking for its index", self.rank)
        if replies is not None:
            index = {slot: reply["index"] for slot, reply in replies.items()}
            fetched = {slot: (reply["newest"], reply["infos"]) for slot, reply in replies.items()}
        else:
            index, fetched = self._hosts.gather("index"), {}
        found = resolve(index, local_slot=self.slot)
        with self._lock:
            self._where, self._prefetched = found, fetched
        return sorted(s for s, r in found.items() if r.committed)

    def survey_state(self) -> dict:
        with self._lock:
            where = dict(self._where)
        newest = max((s for s, r in where.items() if r.committed), default=None)
        # Restore opens the newest version, and skips it if its records say it is unhealthy: then
        # the newest one the stores call healthy is opened too.
        healthy = max((s for s, r in where.items() if r.committed and r.health != "unhealthy"), default=None)
        wanted = {s for s in (newest, healthy) if s is not None}
        with self._lock:
            fetched, self._prefetched = self._prefetched, {}
        infos = {s: _once_each(self._shard_infos(s, where[s], fetched)) for s in wanted}
        with self._lock:
            self._surveyed_infos = dict(infos)  # this rank opens the version too: no second round of calls
        return {"where": where, "infos": infos}

    def use_survey_state(self, state: dict) -> None:
        if not state:
            return
        # The surveying rank put its own node's copies first; this rank reads its own node's first.
        where = {
            step: dataclasses.replace(
                r, copies={rank: tuple(sorted(slots, key=lambda s: s != self.slot)) for rank, slots in r.copies.items()}
            )
            for step, r in state["where"].items()
        }
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
            raise VersionNotFoundError(
                f"step {step} is not committed on the live host stores of namespace {self.settings.namespace!r}"
            )
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
                    problems.append(f"{self._hosts.describe(slot)}: rank {rank}: {exc}")
                    log.warning(
                        "rank %d: the plan or record of rank %d held by %s is damaged: %s",
                        self.rank,
                        rank,
                        self._hosts.describe(slot),
                        exc,
                    )
            if rank not in plans:
                raise ShardFormatError(
                    f"step {step}: no live store has an intact plan and record of rank {rank}'s "
                    f"shard" + (f" ({'; '.join(problems)})" if problems else "")
                )
            copies[rank] = [self._copy(step, rank, slot, plans[rank].region_bytes) for slot in where.copies[rank]]
        return MemoryVersion(step, plans, records, copies, on_close=lambda: self._release_maps(copies))

    def _shard_infos(self, step: int, where: Resolved, fetched: Optional[dict] = None) -> dict[int, dict]:
        """slot -> {rank: (plan bytes, record bytes)} from every live store holding a copy: what
        a store sent with its index when ``step`` is its newest committed (``fetched``, see
        :meth:`committed_steps`), else asked for now."""
        wanted: dict[int, list[int]] = {}
        for rank, slots in where.copies.items():
            for slot in slots:
                wanted.setdefault(slot, []).append(rank)
        out = {}
        for slot, ranks in list(wanted.items()):
            newest, held = (fetched or {}).get(slot, (None, {}))
            if newest == step:  # read with the index ``where`` comes from: the same version
                out[slot] = {rank: held[rank] for rank in ranks if rank in held}
                del wanted[slot]
        live = self._hosts.live()
        calls = {slot: live[slot].shard_info.remote(step, ranks) for slot, ranks in wanted.items() if slot in live}
        for slot, ref in calls.items():
            try:
                out[slot] = ray.get(ref, timeout=self.settings.timeout_s)
            except RayActorError:
                self._hosts.mark_dead(slot, "died")
            except (RayTaskError, GetTimeoutError) as exc:
                log.warning(
                    "rank %d: %s did not say what it holds of step %d: %s",
                    self.rank,
                    self._hosts.describe(slot),
                    step,
                    type(exc).__name__,
                )
        return out

    def _copy(self, step: int, rank: int, slot: int, nbytes: int) -> ShardCopy:
        if slot == self.slot:
            local = LocalCopy(self._attach, step, rank)
            if rank == self.rank:
                local.prepare()  # the shard this rank reads when nothing is resharded: mapped while the ranks agree
            return ShardCopy("local", local.fetch, "this node", release=local.release)
        handle = self._hosts.live().get(slot)
        peer = PeerCopy(self.peer_reads, slot, handle, step, rank, nbytes)
        return ShardCopy("peer", peer.fetch, self._hosts.describe(slot), receive_into=peer.receive_into)

    def _release_maps(self, copies: dict[int, list[ShardCopy]]) -> None:
        for rank_copies in copies.values():
            for copy in rank_copies:
                if copy.release is not None:
                    copy.release()

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

    def _cancel(self, tags: tuple) -> None:
        """Give up on the pushes under ``tags``: the sink refuses them from now on, and the
        listener stops those already arriving (dropping their senders' connections, so the
        stores stop sending) and confirms that no stream writes into their buffers any more.
        Without that confirmation nothing may be loaded into those buffers again: raises
        :class:`~gemini_ckpt.errors.ReadNotStoppedError`."""
        for tag in tags:
            self._read_sink.forget(tag)
        with self._lock:
            listener = self._read_listener
        if listener is None:
            return
        try:
            listener.abort(tags, timeout=TIMEOUTS.abort_s)
        except TransportError as exc:
            raise ReadNotStoppedError(f"rank {self.rank}: a push given up on could not be stopped: {exc}") from None

    def _data_plane(self) -> TcpTransport:
        with self._lock:
            if self._transport is None:
                self._transport = TcpTransport(
                    self._secret,
                    self.settings.namespace,
                    host_name=self.node_id,
                    config=TcpConfig(progress_timeout_s=TIMEOUTS.progress_s),
                )
            return self._transport

    def close(self) -> None:
        """Close this reader's listener and data plane."""
        with self._lock:
            transport, self._transport = self._transport, None
            listener, self._read_listener = self._read_listener, None
        if listener is not None:
            listener.close()
        if transport is not None:
            transport.close()


def _once_each(infos: dict[int, dict]) -> dict[int, dict]:
    """``slot -> {rank: (plan, record)}`` with the bytes of a rank's shard kept once where several
    stores hold the same: a reader decodes the first of a rank's it finds, so a second identical
    copy never changes what it reads (copies that differ are all kept) and only lengthens the
    survey every rank receives."""
    kept: dict[int, list] = {}
    out: dict[int, dict] = {}
    for slot, held in infos.items():
        for rank, pair in held.items():
            if pair not in kept.setdefault(rank, []):
                kept[rank].append(pair)
                out.setdefault(slot, {})[rank] = pair
    return out
