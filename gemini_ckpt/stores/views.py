"""Version views: a verified, item-by-item view of one step in one tier, which is what a
tier's ``open(step)`` returns and what restore reads (:mod:`gemini_ckpt.restore`). Each returns
an item already verified and decoded:

- :class:`MemoryVersion` (shards in this process's or the host stores' memory): the item's raw
  bytes from the first copy whose CRC32C matches the shard record (local memory, then peers in
  placement order), viewed as a tensor without another copy, or a value blob decoded through
  the value allow-list;
- :class:`DurableVersion` (a DCP directory): the item's bytes checked against the completion
  marker, then ``torch.load(weights_only=True)``.

Nothing is unpickled with arbitrary globals: ``.metadata`` and the metadata skeleton of a memory
version go through the metadata allow-list, values through the value allow-list.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

from ..checksum import checksum
from ..errors import CheckpointError, ChecksumError, VerificationError
from ..format.manifest import as_uint8
from ..format.shards import ShardPlan, ShardRecord
from ..health import UNCHECKED_VERDICT, Health, combine, no_verdict
from ..state.dcp import RawLocation, torch_dtype
from ..signing import canonical
from ..trust.items import item_nbytes, safe_opaque, torch_load_value
from ..trust.manifest import canonical_bytes
from ..trust.metadata import metadata_loads
from ..trust.values import value_loads

log = logging.getLogger("gemini_ckpt")


Fetch = Callable[[int, int], Any]
"""``fetch(offset, length)`` -> bytes-like: a range of one copy of a shard's region."""


Receive = Callable[[list], Any]
"""``receive_into([(offset, into), ...])`` -> a handle whose ``result()`` returns once every
``into`` holds the bytes ``[offset, offset + into.nbytes)`` of the copy (or raises ``LookupError``),
and whose ``cancel()`` gives up on them. Once either returns or raises, nothing writes into the
``into`` buffers any more (they may be live tensors)."""


@dataclass(frozen=True)
class ShardCopy:
    """One readable copy of a shard's region: ``source`` is ``local`` or ``peer``. A copy that
    can land bytes straight in the reader's memory (a peer pushing over the data plane) has
    ``receive_into``; one that holds something until the version is closed (a local mapping) has
    ``release``."""

    source: str
    fetch: Fetch
    label: str = ""
    receive_into: Optional[Receive] = None
    release: Optional[Callable[[], None]] = None


class MemoryVersion:
    """A version held as raw shards (see the module docstring). ``plans`` and ``records``
    are per saved rank, already decoded and verified (signatures included); ``copies`` per
    rank in read order."""

    tier = "memory"

    def __init__(
        self,
        step: int,
        plans: dict[int, ShardPlan],
        records: dict[int, ShardRecord],
        copies: dict[int, list[ShardCopy]],
        *,
        on_close: Optional[Callable[[], None]] = None,
    ) -> None:
        self.step = step
        self._on_close = on_close
        self.plans, self.records, self.copies = plans, records, copies
        self.bytes_by_source: dict[str, int] = {}
        self.problems: list[str] = []
        first = records[min(records)]
        self.world_size = first.world_size
        self.epoch = first.epoch
        if sorted(plans) != list(range(self.world_size)) or sorted(records) != list(range(self.world_size)):
            raise VerificationError(
                f"step {step}: shards of ranks {sorted(records)} of a world of "
                f"{self.world_size}; a version needs every rank's"
            )
        ids = {p.plan_id for p in plans.values()} | {r.plan_id for r in records.values()}
        if (
            len(ids) != 1
            or {r.step for r in records.values()} != {step}
            or len({r.epoch for r in records.values()}) != 1
        ):
            raise VerificationError(f"step {step}: its shards come from different versions or plans")
        self.metadata = self._metadata()
        self.fingerprint = checksum(canonical([records[r].fields() for r in sorted(records)]))

    @property
    def health(self) -> Health:
        """The version's verdict, from its shards' verified records (the first unhealthy one). A
        shard whose signed plan asks for the tensor check but whose record carries no verdict was
        not checked by its store: the version is unhealthy (``verdict``), never healthy."""
        for r in sorted(self.records):
            if self.plans[r].checked and self.records[r].health is None:
                return no_verdict(
                    f"its record carries no verdict, though its plan asks for the finite check of "
                    f"{len(self.plans[r].checked)} items: its store did not check it",
                    r,
                )
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
                log.warning(
                    "the %s copy (%s) of %s could not be read (%s: %s); trying the next copy",
                    copy.source,
                    copy.label,
                    where,
                    type(exc).__name__,
                    exc,
                )
                continue
            arr = as_uint8(raw)
            if arr.nbytes != t.nbytes or checksum(arr) != record.crcs[loc.item]:
                self.problems.append(f"{copy.source} {copy.label}: {where}: checksum mismatch (corrupt copy skipped)")
                log.warning(
                    "the %s copy %s of %s failed its checksum; trying the next copy", copy.source, copy.label, where
                )
                continue
            self.bytes_by_source[copy.source] = self.bytes_by_source.get(copy.source, 0) + t.nbytes
            return _tensor_from(arr, t.dtype, t.shape)
        raise ChecksumError(
            f"{where}: no copy in memory passes its checksum: " + "; ".join(p for p in self.problems if where in p)
        )


class DurableVersion:
    """A DCP directory of the durable tier whose manifest (marker + ``.metadata``) was verified."""

    tier = "durable"

    def __init__(self, step: int, manifest, metadata: Metadata, read_range: Callable[[str, int, int], Any]) -> None:
        self.step, self.manifest, self.metadata = step, manifest, metadata
        self.world_size = manifest.world_size
        self._read_range = read_range
        self._crc = manifest.checksum_index()
        self.fingerprint = checksum(canonical_bytes(manifest))
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
        if isinstance(self.metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            return safe_opaque(index.fqn, value)
        if not isinstance(value, torch.Tensor):
            raise VerificationError(
                f"step {self.step} {index.fqn}: the item holds a {type(value).__name__}, not a tensor"
            )
        return value


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
