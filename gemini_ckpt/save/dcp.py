"""Loading a version through DCP: a ``StorageReader`` over verified, item-by-item sources.

Restore runs ``torch.distributed.checkpoint.load`` (so DCP's load planner reshards at any
world size) with :class:`VersionReader` and :class:`SafeLoadPlanner`. The reader is given the
same step from one or more tiers, best first (memory, then the durable copy); each is a
*version view* that returns an item already verified and decoded:

- :class:`MemoryVersion` (shards in this process's or the host stores' memory): the item's raw
  bytes from the first copy whose CRC32C matches the shard record (local memory, then peers in
  placement order), viewed as a tensor without another copy, or a value blob decoded through
  the value allow-list;
- :class:`DurableVersion` (a DCP directory): the item's bytes checked against the completion
  marker, then ``torch.load(weights_only=True)``.

An item that no copy of a view can produce is taken from the next view; only when none can is
the version unreadable (and restore moves to an older one). Nothing is unpickled with
arbitrary globals: ``.metadata`` and the metadata skeleton of a memory version go through the
metadata allow-list, values through the value allow-list.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..checksum import checksum
from ..errors import CheckpointError, ChecksumError
from ..health import UNCHECKED_VERDICT, Health, combine
from ..signing import canonical
from ..stores.manifest import as_uint8
from ..stores.shards import ShardPlan, ShardRecord
from ..trust import (
    VerificationError,
    item_nbytes,
    metadata_loads,
    safe_opaque,
    torch_load_value,
    value_loads,
)
from .chunks import local_load_plan
from .plan import RawLocation
from .stager import torch_dtype

log = logging.getLogger("gemini_ckpt")

Fetch = Callable[[int, int], Any]
"""``fetch(offset, length)`` -> bytes-like: a range of one copy of a shard's region."""


Receive = Callable[[list], Any]
"""``receive_into([(offset, into), ...])`` -> a handle whose ``result()`` returns once every
``into`` holds the bytes ``[offset, offset + into.nbytes)`` of the copy (or raises ``LookupError``)."""


@dataclass(frozen=True)
class ShardCopy:
    """One readable copy of a shard's region: ``source`` is ``local`` or ``peer``. A copy that
    can land bytes straight in the reader's memory (a peer pushing over the data plane) has
    ``receive_into``."""

    source: str
    fetch: Fetch
    label: str = ""
    receive_into: Optional[Receive] = None


class MemoryVersion:
    """A version held as raw shards (see the module docstring). ``plans`` and ``records``
    are per saved rank, already decoded and verified (signatures included); ``copies`` per
    rank in read order."""

    tier = "memory"

    def __init__(self, step: int, plans: dict[int, ShardPlan], records: dict[int, ShardRecord],
                 copies: dict[int, list[ShardCopy]], *, on_close: Optional[Callable[[], None]] = None) -> None:
        self.step = step
        self._on_close = on_close
        self.plans, self.records, self.copies = plans, records, copies
        self.bytes_by_source: dict[str, int] = {}
        self.problems: list[str] = []
        first = records[min(records)]
        self.world_size = first.world_size
        self.epoch = first.epoch
        if sorted(plans) != list(range(self.world_size)) or sorted(records) != list(range(self.world_size)):
            raise VerificationError(f"step {step}: shards of ranks {sorted(records)} of a world of "
                                    f"{self.world_size}; a version needs every rank's")
        ids = {p.plan_id for p in plans.values()} | {r.plan_id for r in records.values()}
        if len(ids) != 1 or {r.step for r in records.values()} != {step} or len({r.epoch for r in records.values()}) != 1:
            raise VerificationError(f"step {step}: its shards come from different versions or plans")
        self.metadata = self._metadata()
        self.fingerprint = checksum(canonical([records[r].fields() for r in sorted(records)]))

    @property
    def health(self) -> Health:
        """The version's verdict, from its shards' verified records (the first unhealthy one)."""
        return combine(self.records[r].health for r in sorted(self.records))

    def _metadata(self) -> Metadata:
        skeleton = self.plans[0].metadata
        if not skeleton:
            raise VerificationError(f"step {self.step}: rank 0's plan carries no metadata")
        metadata = metadata_loads(skeleton)
        storage: dict[MetadataIndex, RawLocation] = {}
        for rank, plan in self.plans.items():
            for i, t in enumerate(plan.tensors):
                chunk = None if t.chunk is None else torch.Size(t.chunk)
                storage[MetadataIndex(t.fqn, chunk, t.index)] = RawLocation(rank, i)
            for j, v in enumerate(plan.values):
                storage[MetadataIndex(v.fqn, None, v.index)] = RawLocation(rank, len(plan.tensors) + j)
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta()
        return metadata

    def close(self) -> None:
        """Let go of what the copies hold for the reader (mapped shards)."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def read(self, index: MetadataIndex) -> Any:
        loc = self.metadata.storage_data.get(index)
        if not isinstance(loc, RawLocation):
            raise LookupError(f"step {self.step}: no item {index.fqn} in memory")
        plan, record = self.plans[loc.rank], self.records[loc.rank]
        if loc.item >= len(plan.tensors):
            j = loc.item - len(plan.tensors)
            return _decode_value(index.fqn, plan.values[j].kind, record.values[j])
        t = plan.tensors[loc.item]
        where = f"step {self.step} {t.fqn} (rank {loc.rank}, {t.nbytes} bytes)"
        for copy in self.copies.get(loc.rank, []):
            try:
                raw = copy.fetch(t.at, t.nbytes)
            except (LookupError, OSError, ValueError, CheckpointError) as exc:
                self.problems.append(f"{copy.source} {copy.label}: {where}: {type(exc).__name__}: {exc}")
                log.warning("the %s copy (%s) of %s could not be read (%s: %s); trying the next copy", copy.source,
                            copy.label, where, type(exc).__name__, exc)
                continue
            arr = as_uint8(raw)
            if arr.nbytes != t.nbytes or checksum(arr) != record.crcs[loc.item]:
                self.problems.append(f"{copy.source} {copy.label}: {where}: checksum mismatch (corrupt copy skipped)")
                log.warning("the %s copy %s of %s failed its checksum; trying the next copy", copy.source,
                            copy.label, where)
                continue
            self.bytes_by_source[copy.source] = self.bytes_by_source.get(copy.source, 0) + t.nbytes
            return _tensor_from(arr, t.dtype, t.shape)
        raise ChecksumError(f"{where}: no copy in memory passes its checksum: "
                            + "; ".join(p for p in self.problems if where in p))


class DurableVersion:
    """A DCP directory of the durable tier whose manifest (marker + ``.metadata``) was verified."""

    tier = "durable"

    def __init__(self, step: int, manifest, metadata: Metadata, read_range: Callable[[str, int, int], Any]) -> None:
        self.step, self.manifest, self.metadata = step, manifest, metadata
        self.world_size = manifest.world_size
        self._read_range = read_range
        self._crc = manifest.checksum_index()
        self.fingerprint = checksum(_canonical_manifest(manifest))
        self.bytes_by_source: dict[str, int] = {}
        self.problems: list[str] = []

    @property
    def health(self) -> Health:
        """The verdict its checked (and, with a key, signed) manifest records."""
        return UNCHECKED_VERDICT if self.manifest.health is None else Health.from_json(self.manifest.health)

    def close(self) -> None:
        pass

    def read(self, index: MetadataIndex) -> Any:
        info = self.metadata.storage_data.get(index)
        if info is None or not hasattr(info, "relative_path"):
            raise LookupError(f"step {self.step}: no item {index.fqn} in the durable copy")
        where = f"step {self.step} {info.relative_path}@{info.offset} ({info.length} bytes)"
        expected = self._crc.get((info.relative_path, info.offset))
        if expected is None or expected.length != info.length:
            raise ChecksumError(f"{where}: no checksum recorded for this item; refusing to load it")
        try:
            raw = as_uint8(self._read_range(info.relative_path, info.offset, info.length))
        except (OSError, ValueError, CheckpointError) as exc:
            self.problems.append(f"durable: {where}: {type(exc).__name__}: {exc}")
            raise ChecksumError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None
        if raw.nbytes != info.length or checksum(raw) != expected.crc:
            self.problems.append(f"durable: {where}: checksum mismatch")
            raise ChecksumError(f"{where}: fails its checksum (damaged)")
        self.bytes_by_source["durable"] = self.bytes_by_source.get("durable", 0) + raw.nbytes
        # torch.load only once the archive's records agree with what the metadata says the item holds
        value = torch_load_value(raw, f"step {self.step} {index.fqn}", storage_bytes=item_nbytes(self.metadata, index))
        if isinstance(self.metadata.state_dict_metadata.get(index.fqn), _bytes_md()):
            return safe_opaque(index.fqn, value)
        if not isinstance(value, torch.Tensor):
            raise VerificationError(f"step {self.step} {index.fqn}: the item holds a {type(value).__name__}, "
                                    f"not a tensor")
        return value


def _bytes_md():
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return BytesStorageMetadata


def _canonical_manifest(manifest) -> bytes:
    from ..trust import canonical_bytes

    return canonical_bytes(manifest)


def _tensor_from(arr: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes as a tensor, without a copy (the caller copies it into the live tensor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: we never write through this view
        base = torch.from_numpy(arr) if arr.nbytes else torch.empty(0, dtype=torch.uint8)
    return base.view(torch_dtype(dtype)).reshape(shape)


def _decode_value(fqn: str, kind: str, blob: bytes) -> Any:
    if kind == "bytes":
        return safe_opaque(fqn, blob)
    return value_loads(blob, fqn)


@dataclass
class ReadReport:
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class VersionReader(StorageReader):
    """Reads one step from ``views`` (best first), item by item, with fallback to the next."""

    def __init__(self, views: list) -> None:
        super().__init__()
        self.views = views
        self.metadata = views[0].metadata
        self.report = ReadReport()

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = uuid.uuid4().hex
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError("VersionReader loads only through SafeLoadPlanner")
        for req in sorted(plan.items, key=self._order):
            value = self._read(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_value(req, value)
                continue
            if not isinstance(value, torch.Tensor):
                raise VerificationError(f"step {self.views[0].step} {req.storage_index.fqn}: not a tensor")
            try:
                tensor = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
            except (RuntimeError, IndexError, ValueError) as exc:
                raise VerificationError(f"step {self.views[0].step} {req.storage_index.fqn}: the saved tensor does "
                                        f"not match its metadata ({exc})") from None
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise VerificationError(f"step {self.views[0].step} {req.storage_index.fqn}: saved shape "
                                        f"{tuple(tensor.size())} does not fit the target's {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        for view in self.views:
            for source, n in view.bytes_by_source.items():
                self.report.bytes_by_source[source] = self.report.bytes_by_source.get(source, 0) + n
            self.report.problems.extend(view.problems)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _order(self, req):
        loc = self.metadata.storage_data.get(req.storage_index)
        if isinstance(loc, RawLocation):
            return (loc.rank, loc.item, 0)
        return (getattr(loc, "relative_path", ""), getattr(loc, "offset", 0), 0)

    def _read(self, index: MetadataIndex) -> Any:
        errors = []
        for view in self.views:
            try:
                return view.read(index)
            except LookupError as exc:
                errors.append(f"{view.tier}: {exc}")
            except ChecksumError as exc:
                errors.append(f"{view.tier}: {exc}")
        raise ChecksumError(f"step {self.views[0].step} {index.fqn}: no tier holds a good copy: " + "; ".join(errors))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except for non-tensor items: DCP's loads them with
    ``torch.load(weights_only=False)`` (any pickle runs); here :class:`VersionReader` hands over
    values it already decoded through the allow-lists (:meth:`load_value`), and a stock reader's
    bytes are decoded with ``weights_only=True`` (:meth:`load_bytes`)."""

    def create_local_plan(self) -> LoadPlan:
        """DCP's, its DTensor chunks computed without index tensors (:mod:`.chunks`). A
        checkpoint that does not say which DCP version wrote it (every one of ours does) and
        holds keys this state lacks may use DCP's pre-2.4 flattening: DCP's own plan finds them."""
        if self.metadata is None:
            raise ValueError("the load planner was set up without the checkpoint's metadata")
        if (self.flatten_state_dict and getattr(self.metadata, "version", None) is None
                and set(self.metadata.state_dict_metadata) - set(self.state_dict)):
            return super().create_local_plan()
        return local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_value(self, read_item, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def load_bytes(self, read_item, value) -> None:
        """A stock reader's non-tensor item (``init_from``): ``weights_only=True``, and our
        opaque blobs through the value allow-list."""
        fqn = read_item.dest_index.fqn
        self.load_value(read_item, safe_opaque(fqn, torch_load_value(value.getbuffer(), fqn)))


def load(state_dict: dict, views: list, *, group, world_size: int) -> ReadReport:
    """``dcp.load`` of one step into ``state_dict`` in place, from ``views`` (best first)."""
    reader = VersionReader(views)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group,
                 no_dist=world_size == 1)
    return reader.report
