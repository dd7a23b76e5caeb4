"""DCP storage plugin: a ``StorageWriter``/``StorageReader`` pair over a :class:`Store`.

The writer lays each rank's bytes out exactly as DCP's ``FileSystemWriter`` (one thread,
one file per rank) lays out ``__{rank}_0.distcp``: BYTE_IO items first, then tensors, each
tensor serialized with ``torch.save``, in plan order; ``.metadata`` is the same pickled
``Metadata``. So a version dumped as files is a stock DCP checkpoint, and a stock DCP
checkpoint directory is readable by the reader. Each item also gets a CRC32C, recorded in
the version's manifest and verified by the reader before the bytes are used; so does
``.metadata``. Nothing read is unpickled with arbitrary globals: ``.metadata`` goes through
``_trust``'s allow-list, tensors and non-tensor items through ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`), our opaque blobs through the value allow-list.

Call order (DCP drives it): writer on every rank ``set_up_storage_writer`` ->
``prepare_local_plan``; coordinator ``prepare_global_plan``; every rank ``write_data``
(serializes and ``put_file``s its data file); coordinator ``finish`` (``commit``s the
manifest, after every rank's ``write_data`` has returned, which DCP guarantees).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, cast

import numpy as np
import torch
from torch.futures import Future
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index

from ._checksum import checksum
from ._errors import CheckpointError, ChecksumError
from ._faults import fire
from ._fast_save import save_tensor
from ._store import ItemChecksum, Store, VersionManifest, as_uint8
from ._trust import VerificationError, load_metadata, resolve_key, safe_opaque, sign, torch_load_value

log = logging.getLogger("gemini_ckpt")
DCP_VERSION = "1.0.0"  # what FileSystemWriter stamps into Metadata.version
DATA_SUFFIX = ".distcp"


def data_file_name(rank: int) -> str:
    return f"__{rank}_0{DATA_SUFFIX}"


@dataclass(frozen=True)
class _ChecksummedInfo:
    """What a rank's ``write_data`` returns per item: the standard storage info plus the CRC.
    ``finish`` strips the CRC into the manifest so ``.metadata`` stays stock."""

    info: _StorageInfo
    crc: int


class SerialBuffer:
    """A file-like, write-only buffer reused from one version to the next: serializing into
    memory that is already mapped runs ~5x faster than into a new ``BytesIO`` (whose pages
    are faulted in again on every save). Only for stores that copy the bytes on ``put_file``."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self._pos = 0

    def reset(self) -> "SerialBuffer":
        self._pos = 0
        return self

    def write(self, data) -> int:
        src = as_uint8(data)
        end = self._pos + src.nbytes
        if end > self._buf.nbytes:
            grown = np.empty(max(end, 2 * self._buf.nbytes), dtype=np.uint8)
            grown[: self._pos] = self._buf[: self._pos]
            self._buf = grown
        self._buf[self._pos : end] = src
        self._pos = end
        return src.nbytes

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def getbuffer(self) -> np.ndarray:
        return self._buf[: self._pos]

    @property
    def capacity(self) -> int:
        return self._buf.nbytes


def serialize_items(plan: SavePlan, planner: SavePlanner, file_name: str,
                    stream: "io.BytesIO | SerialBuffer | None" = None) -> tuple[Any, list[WriteResult]]:
    """Serialize one rank's items into one buffer, in FileSystemWriter's order and format."""
    stream = io.BytesIO() if stream is None else stream
    results: list[WriteResult] = []
    bytes_items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
    tensor_items = [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
    for item in bytes_items + tensor_items:
        offset = stream.tell()
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            stream.write(cast(io.BytesIO, data).getbuffer())
        else:
            tensor = cast(torch.Tensor, data).detach().cpu()
            if tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # torch.save writes whole storages; keep only our bytes
            save_tensor(tensor, stream)  # torch.save's bytes, without its per-tensor Python work
        length = stream.tell() - offset
        info = _StorageInfo(relative_path=file_name, offset=offset, length=length)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return stream, results


class StoreWriter(StorageWriter):
    """Writes one version (``step``) of this rank into ``store``."""

    def __init__(self, store: Store, step: int, *, world_size: int, job: dict | None = None,
                 buffer: Optional[SerialBuffer] = None, signing_key: bytes | str | None = None) -> None:
        """``buffer``: reused for serializing when the store copies on ``put_file``.
        ``signing_key``: signs the manifest (None: ``$GEMINI_CKPT_SIGNING_KEY`` if set)."""
        super().__init__()
        self.signing_key = resolve_key(signing_key)
        self.store = store
        self.buffer = buffer if getattr(store, "copies_on_put", False) else None
        self.step = step
        self.world_size = world_size
        self.job = dict(job or {})
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self.bytes_written = 0
        self.serialize_s = 0.0
        self.put_s = 0.0

    def reset(self, checkpoint_id=None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        name = f"{prefix}0{DATA_SUFFIX}"
        t0 = time.perf_counter()
        stream, results = serialize_items(plan, planner, name,
                                          self.buffer.reset() if self.buffer is not None else None)
        data = as_uint8(stream.getbuffer())
        checked = []
        for wr in results:
            info = cast(_StorageInfo, wr.storage_data)
            crc = checksum(data[info.offset : info.offset + info.length])
            checked.append(dataclasses.replace(wr, storage_data=_ChecksummedInfo(info, crc)))
        t1 = time.perf_counter()
        fire("replicate", step=self.step, rank=self.rank, name=name)
        self.store.put_file(self.step, name, data)
        self.put_s = time.perf_counter() - t1
        self.serialize_s = t1 - t0
        self.bytes_written = data.nbytes
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md: dict[MetadataIndex, _StorageInfo] = {}
        checksums: list[ItemChecksum] = []
        file_sizes: dict[str, int] = {}
        for rank_results in results:
            for wr in rank_results:
                ci = cast(_ChecksummedInfo, wr.storage_data)
                storage_md[wr.index] = ci.info
                checksums.append(ItemChecksum(ci.info.relative_path, ci.info.offset, ci.info.length, ci.crc))
                end = ci.info.offset + ci.info.length
                file_sizes[ci.info.relative_path] = max(file_sizes.get(ci.info.relative_path, 0), end)
        metadata.version = DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        metadata_bytes = pickle.dumps(metadata)
        manifest = sign(VersionManifest(
            step=self.step,
            world_size=self.world_size,
            metadata=metadata_bytes,
            checksums=tuple(sorted(checksums, key=lambda c: (c.file, c.offset))),
            file_sizes=file_sizes,
            job={**self.job, "created_unix": time.time()},
            metadata_crc=checksum(metadata_bytes),
        ), self.signing_key)
        fire("commit", step=self.step, rank=self.rank)
        self.store.commit(self.step, manifest)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"gemini-step-{self.step}", save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


_MAX_COPIES = 16  # copies of one item tried within a tier (holders)

RangeFetch = Callable[[str, int, int], Any]
"""``fetch(file, offset, length)`` -> bytes-like: how a reader gets bytes from one source."""


@dataclass(frozen=True)
class Source:
    """One place a version's bytes can be read from, in the order a reader tries them."""

    tier: str  # "memory" or "durable"
    fetch: RangeFetch
    # ``refetch(file, offset, length, n)``: the same range from the n-th other copy within this
    # tier (another holder), raising LookupError when there is none; tried when a copy fails
    # its checksum, before the next tier.
    refetch: Optional[Callable[[str, int, int, int], Any]] = None


class StoreReader(StorageReader):
    """Reads one version, fetching only the byte ranges the load plan asks for.

    Every item's CRC32C is checked before it is deserialized. ``sources`` are tried in order
    for each item: a source that fails (a holder died, a file is missing) or returns bytes
    that fail their checksum is skipped for the next one, so a bad replica is never loaded
    while a good copy exists elsewhere (another holder, or the durable tier).
    """

    def __init__(self, manifest: VersionManifest, sources: list[Source] | RangeFetch, *,
                 metadata: Optional[Metadata] = None) -> None:
        """``metadata``: the manifest's DCP metadata when the caller already verified and
        decoded it (``_trust.load_metadata``); else it is verified and decoded here."""
        super().__init__()
        self.manifest = manifest
        self.metadata = metadata
        self.sources = sources if isinstance(sources, list) else [Source("memory", sources)]
        self._crc = manifest.checksum_index()
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.bytes_read = 0
        self.bytes_by_tier: dict[str, int] = {}
        self.problems: list[str] = []

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.metadata if self.metadata is not None else load_metadata(self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        items = sorted(plan.items, key=lambda r: (self.storage_data[r.storage_index].relative_path,
                                                   self.storage_data[r.storage_index].offset))
        if any(r.type == LoadItemType.BYTE_IO for r in items) and not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError("StoreReader loads non-tensor items only through SafeLoadPlanner "
                                  "(DCP's default planner unpickles them with weights_only=False)")
        for req in items:
            info = self.storage_data[req.storage_index]
            raw = self.read_item(info)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(raw)))
            else:
                # Straight from the fetched bytes: no intermediate copy (a copy of every item
                # into a fresh bytes object cost as much as the deserializing itself).
                fqn = req.storage_index.fqn
                tensor = torch_load_value(raw, f"step {self.manifest.step} {fqn}")
                if not isinstance(tensor, torch.Tensor):
                    raise VerificationError(f"step {self.manifest.step} {fqn}: the item holds a "
                                            f"{type(tensor).__name__}, not a tensor")
                try:
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                except (RuntimeError, IndexError, ValueError) as exc:
                    raise VerificationError(f"step {self.manifest.step} {fqn}: the saved tensor does not "
                                            f"match its metadata ({exc})") from None
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise VerificationError(f"step {self.manifest.step} {fqn}: saved shape "
                                            f"{tuple(tensor.size())} does not fit the target's "
                                            f"{tuple(target.size())} (the item disagrees with its metadata)")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def read_item(self, info: _StorageInfo) -> np.ndarray:
        """The item's bytes (a uint8 array, possibly a view of the source's buffer), checked."""
        expected = self._crc.get((info.relative_path, info.offset))
        where = f"step {self.manifest.step} {info.relative_path}@{info.offset} ({info.length} bytes)"
        if expected is None:
            raise ChecksumError(f"{where}: no checksum recorded for this item; refusing to load it")
        for source in self.sources:
            for attempt in range(_MAX_COPIES):
                try:
                    if attempt == 0:
                        raw = as_uint8(source.fetch(info.relative_path, info.offset, info.length))
                    elif source.refetch is None:
                        break
                    else:
                        raw = as_uint8(source.refetch(info.relative_path, info.offset, info.length, attempt))
                except LookupError as exc:
                    if attempt == 0:
                        self.problems.append(f"{source.tier}: {where}: {type(exc).__name__}: {exc}")
                    break  # no (further) copy in this tier
                except (OSError, ValueError, CheckpointError) as exc:
                    self.problems.append(f"{source.tier}: {where}: {type(exc).__name__}: {exc}")
                    break
                if raw.nbytes != info.length or checksum(raw) != expected.crc:
                    self.problems.append(f"{source.tier}: {where}: checksum mismatch in copy {attempt + 1} "
                                         f"(corrupt copy skipped)")
                    log.warning("%s copy %d of %s failed its checksum; trying the next copy",
                                source.tier, attempt + 1, where)
                    continue
                self.bytes_read += raw.nbytes
                self.bytes_by_tier[source.tier] = self.bytes_by_tier.get(source.tier, 0) + raw.nbytes
                return raw
        raise ChecksumError(f"{where}: no source returned a copy that passes its checksum: "
                            + "; ".join(p for p in self.problems if where in p))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class ViewFile(io.RawIOBase):
    """A read-only, seekable file over a bytes-like object, without copying it first."""

    def __init__(self, data) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        memoryview(buffer).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def save_version(state_dict: dict, writer: StoreWriter, *, planner, group, no_dist: bool) -> None:
    """``dcp.save`` without its single-process warning (which is our normal case, not a guess)."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    _save_state_dict(state_dict=state_dict, storage_writer=writer, process_group=group, no_dist=no_dist,
                     planner=planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except for non-tensor items: DCP's loads them with
    ``torch.load(weights_only=False)`` (any pickle runs); this one with ``weights_only=True``,
    and TrainState's pickled blobs are decoded through the value allow-list and handed on as a
    pickle of what came out (so ``TrainState.apply`` never sees bytes we did not vet)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_opaque(fqn, torch_load_value(value.getbuffer(), fqn))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_version(state_dict: dict, reader: StoreReader, *, group, no_dist: bool) -> None:
    """``dcp.load`` into ``state_dict`` in place (through :class:`SafeLoadPlanner`), without
    the single-process warning."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict=state_dict, storage_reader=reader, process_group=group, no_dist=no_dist,
                     planner=SafeLoadPlanner())
