"""The direct restore: a memory version loaded at the world size it was saved at, each item's
bytes going straight from the copy that holds them into the live tensor they belong to.

The usual restart (same job, same world size) needs no resharding: every tensor the live
state holds is one whole chunk of the saved version. Then DCP's load planning and its
collectives, the intermediate buffers and the per-item ``narrow``/``copy_`` are all overhead,
so :func:`direct_plan` checks, on this rank alone, that every read DCP's planner would issue
(``create_local_plan``, no collective) is a whole saved chunk into a whole, contiguous live
tensor of the same dtype, and :func:`direct_load` then moves the bytes:

- from this node's store: out of the mapped shard (mapped while the ranks agree on the
  version), one copy into the live tensor, whose bytes are then checked against the item's
  CRC32C (memory can change after any earlier check: what lands is what counts). The copy
  goes a cache-sized block at a time and each block is checked right after it landed, from
  the cache;
- from a peer: pushed by the peer's store over the data plane straight into the live
  tensors' memory (``receive_into``, a batch of items per call), then checked against the
  record while the next batches are still on the wire. A peer that does not deliver a batch
  (gone, or not within ``timeout_s``) is given up on: its pushes are cancelled, and only once
  the data plane confirms that no stream writes into those tensors any more are their items
  read from the next copy. So when restore returns (or raises), nothing writes into the live
  state.

An item whose copy fails its check is taken from the next copy (the other holders in order,
then the next view: the durable tier); only when none has it is the version unreadable.
Nothing but raw bytes lands in a tensor, and restore returns (or moves to an older version)
only after every item passed; values come from the verified records through the value
allow-list, as on the DCP path (:mod:`.loader`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from ..checksum import checksum
from ..errors import CheckpointError, ChecksumError, ReadNotStoppedError
from ..format.manifest import as_uint8
from ..state.dcp import RawLocation, dtype_name
from ..stores.views import MemoryVersion, ShardCopy
from .loader import SafeLoadPlanner

log = logging.getLogger("gemini_ckpt")

BLOCK_BYTES = 256 << 10
"""A local copy goes a block of this many bytes at a time, each checked right after it landed,
while it is still in the core's cache (a quarter of a 1-2 MiB L2; source and copy both pass
through it): one pass over memory, where a copy of the whole item followed by its check reads it
back from memory. 512 KiB cost 5-10% more CPU with four ranks on two cores (docs/recovery.md)."""
BATCH_BYTES = 32 << 20
BATCH_ITEMS = 512
"""A peer is asked for items in batches of about this many bytes (or items): one Ray call per
batch, one transfer per item, all in flight at once, so checks overlap later batches."""
IN_FLIGHT_BYTES = 256 << 20
"""Bytes of direct pushes outstanding at once per reader (the rest wait their turn)."""


@dataclass
class DirectItem:
    """One tensor item: where its bytes are saved and the live memory they go to."""

    index: MetadataIndex
    rank: int  # the saved rank whose shard holds it
    at: int
    nbytes: int
    crc: int
    dest: torch.Tensor  # the live tensor (contiguous, same dtype and shape)

    @cached_property
    def dest_bytes(self) -> np.ndarray:
        return self.dest.detach().reshape(-1).view(torch.uint8).numpy()


@dataclass
class DirectPlan:
    planner: SafeLoadPlanner
    tensors: list[DirectItem]
    values: list[Any]  # DCP's ReadItems of the non-tensor items
    in_place: bool  # every target tensor is the live parameter, buffer or optimizer state itself

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def direct_plan(target: dict, version: MemoryVersion, live: set[int]) -> tuple[Optional[DirectPlan], str]:
    """The direct plan of loading ``version`` into ``target`` on this rank, or ``(None, why)``
    when some item needs DCP's load planner (resharding, a non-contiguous or non-CPU target).
    ``live``: the storages of the live tensors (:func:`~gemini_ckpt.save.sources.live_storages`);
    when every target tensor is one of them, loading them is applying them (``in_place``)."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(target, metadata=version.metadata, is_coordinator=False)
    try:
        plan = planner.create_local_plan()
    except (RuntimeError, ValueError, KeyError) as exc:
        return None, f"DCP's planner: {type(exc).__name__}: {exc}"
    tensors, values = [], []
    storage = version.metadata.storage_data
    for req in plan.items:
        if req.type == LoadItemType.BYTE_IO:
            values.append(req)
            continue
        loc = storage.get(req.storage_index)
        if not isinstance(loc, RawLocation):
            return None, f"{req.storage_index.fqn} is not in the memory version"
        saved = version.plans[loc.rank].tensors[loc.item]
        dest = planner.lookup_tensor(req.dest_index)
        whole = (
            tuple(req.lengths) == tuple(dest.shape) == tuple(saved.shape)
            and not any(req.dest_offsets)
            and not any(req.storage_offsets)
        )
        if not whole:
            return None, f"{req.storage_index.fqn} is resharded (a part of a saved chunk)"
        if (
            dest.device.type != "cpu"
            or dest.layout != torch.strided
            or not dest.is_contiguous()
            or dest.is_conj()
            or dest.is_neg()
            or dtype_name(dest.dtype) != saved.dtype
        ):
            return None, (
                f"{req.storage_index.fqn}: the live tensor is not a plain contiguous CPU {saved.dtype} tensor"
            )
        if dest.numel() * dest.element_size() != saved.nbytes:
            return None, f"{req.storage_index.fqn}: {saved.nbytes} bytes saved, the live tensor has another size"
        tensors.append(
            DirectItem(
                req.storage_index, loc.rank, saved.at, saved.nbytes, version.records[loc.rank].crcs[loc.item], dest
            )
        )
    in_place = all(t.dest.untyped_storage().data_ptr() in live for t in tensors)
    return DirectPlan(planner, tensors, values, in_place), ""


def direct_load(plan: DirectPlan, views: list) -> dict[str, int]:
    """Move every item of ``plan`` into its live tensor (see the module docstring); ``views``
    best first (the memory version, then the durable one). Returns bytes per source."""
    version: MemoryVersion = views[0]
    by_rank: dict[int, list[DirectItem]] = {}
    for item in sorted(plan.tensors, key=lambda t: (t.rank, t.at)):
        by_rank.setdefault(item.rank, []).append(item)
    left: list[DirectItem] = []
    for rank, items in by_rank.items():
        left += _load_rank(version, rank, items)
    for item in left:  # no memory copy had it: the next view (the durable tier)
        _from_views(views[1:], item, version)
    for req in plan.values:
        plan.planner.load_value(req, _read_value(views, req.storage_index))
    total: dict[str, int] = {}
    for view in views:
        for source, n in view.bytes_by_source.items():
            total[source] = total.get(source, 0) + n
    return total


def _load_rank(version: MemoryVersion, rank: int, items: list[DirectItem]) -> list[DirectItem]:
    """Every item of one saved rank's shard, from its copies in read order; returns those no
    copy could produce."""
    todo = items
    for copy in version.copies.get(rank, []):
        if not todo:
            break
        todo = _from_copy(version, copy, todo)
    return todo


def _from_copy(version: MemoryVersion, copy: ShardCopy, items: list[DirectItem]) -> list[DirectItem]:
    """Items of one copy; returns those it could not produce (unreadable, or failing the check)."""
    if copy.receive_into is not None:
        return _from_peer(version, copy, items)
    failed: list[DirectItem] = []
    # What landed is checked, every time: memory can change after any earlier check (a flipped bit,
    # a process writing into the segment), and the copy itself could go wrong.
    for item in items:
        try:
            src = as_uint8(copy.fetch(item.at, item.nbytes))
        except (LookupError, OSError, ValueError, CheckpointError) as exc:
            _problem(version, copy, [item], f"{type(exc).__name__}: {exc}")
            failed.append(item)
            continue
        if src.nbytes != item.nbytes:
            _problem(version, copy, [item], f"{src.nbytes} bytes where the record says {item.nbytes}")
            failed.append(item)
            continue
        if _copy_checked(item.dest_bytes, src) != item.crc:
            _problem(version, copy, [item], "checksum mismatch (corrupt copy skipped)")
            failed.append(item)
        else:
            _count(version, copy, item)
    return failed


def _copy_checked(dest: np.ndarray, src: np.ndarray) -> int:
    """Copy ``src`` into ``dest`` a cache-sized block at a time, each block's CRC32C taken from
    ``dest`` right after it landed (still in the cache): the CRC32C of what landed, for one pass
    over memory. Returns it."""
    crc = 0
    for lo in range(0, src.nbytes, BLOCK_BYTES):
        hi = lo + BLOCK_BYTES
        np.copyto(dest[lo:hi], src[lo:hi])
        crc = checksum(dest[lo:hi], crc)
    return crc


def _from_peer(version: MemoryVersion, copy: ShardCopy, items: list[DirectItem]) -> list[DirectItem]:
    """Items pushed by a peer straight into the live tensors, a batch per call, each batch checked
    once it landed while later ones are on the wire. A batch the peer does not deliver (gone,
    refused, or not in time) ends this copy: the batches still on the wire are cancelled, and
    their items and those not asked for yet are returned with the failed ones, for the next
    copy. Once this returns or raises, nothing writes into the live tensors any more."""
    failed: list[DirectItem] = []
    pending: deque = deque()  # (items, handle): batches on the wire, oldest first
    in_flight = 0
    ok = True
    try:
        for batch in _batches(items):
            while ok and pending and in_flight + _nbytes(batch) > IN_FLIGHT_BYTES:
                done, handle = pending.popleft()
                in_flight -= _nbytes(done)
                ok = _settle(version, copy, done, handle, failed)
            if not ok:
                failed.extend(batch)
                continue
            try:
                pending.append((batch, copy.receive_into([(i.at, i.dest_bytes) for i in batch])))
                in_flight += _nbytes(batch)
            except (LookupError, OSError, ValueError, CheckpointError) as exc:
                _problem(version, copy, batch, f"{type(exc).__name__}: {exc}")
                failed.extend(batch)
                ok = False
        while ok and pending:
            done, handle = pending.popleft()
            ok = _settle(version, copy, done, handle, failed)
    finally:
        if pending:  # given up on this copy (or an error on its way out): stop what is still on the wire
            abandoned = [item for batch, _ in pending for item in batch]
            while pending:
                pending.popleft()[1].cancel()
            _problem(version, copy, abandoned, "not read: an earlier batch from this copy failed")
            failed.extend(abandoned)
    return failed


def _settle(version: MemoryVersion, copy: ShardCopy, batch: list[DirectItem], handle, failed: list) -> bool:
    """Wait for a batch and check what landed; False when the copy did not deliver it."""
    try:
        handle.result()
    except ReadNotStoppedError:
        raise
    except (LookupError, OSError, ValueError, CheckpointError) as exc:
        _problem(version, copy, batch, f"{type(exc).__name__}: {exc}")
        failed.extend(batch)
        return False
    for item in batch:
        if checksum(item.dest_bytes) != item.crc:
            _problem(version, copy, [item], "checksum mismatch (corrupt copy skipped)")
            failed.append(item)
        else:
            _count(version, copy, item)
    return True


def _batches(items: list[DirectItem]):
    batch: list[DirectItem] = []
    for item in items:
        batch.append(item)
        if _nbytes(batch) >= BATCH_BYTES or len(batch) >= BATCH_ITEMS:
            yield batch
            batch = []
    if batch:
        yield batch


def _nbytes(items: list[DirectItem]) -> int:
    return sum(i.nbytes for i in items)


def _from_views(views: list, item: DirectItem, version: MemoryVersion) -> None:
    errors = [p for p in version.problems if item.index.fqn in p][-2:]
    for view in views:
        try:
            value = view.read(item.index)
        except (LookupError, ChecksumError) as exc:
            errors.append(f"{view.tier}: {exc}")
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(item.dest.shape):
            errors.append(f"{view.tier}: the item does not fit the live tensor")
            continue
        item.dest.detach().copy_(value)
        return
    raise ChecksumError(f"step {version.step} {item.index.fqn}: no tier holds a good copy: " + "; ".join(errors))


def _read_value(views: list, index: MetadataIndex) -> Any:
    errors = []
    for view in views:
        try:
            return view.read(index)
        except (LookupError, ChecksumError) as exc:
            errors.append(f"{view.tier}: {exc}")
    raise ChecksumError(f"step {views[0].step} {index.fqn}: no tier holds a good copy: " + "; ".join(errors))


def _count(version: MemoryVersion, copy: ShardCopy, item: DirectItem) -> None:
    version.bytes_by_source[copy.source] = version.bytes_by_source.get(copy.source, 0) + item.nbytes


def _problem(version: MemoryVersion, copy: ShardCopy, items: list[DirectItem], why: str) -> None:
    for item in items:
        where = f"step {version.step} {item.index.fqn} (rank {item.rank}, {item.nbytes} bytes)"
        version.problems.append(f"{copy.source} {copy.label}: {where}: {why}")
    if items:
        more = f" and {len(items) - 1} more item(s)" if len(items) > 1 else ""
        log.warning(
            "the %s copy (%s) of step %d %s%s: %s; trying the next copy",
            copy.source,
            copy.label,
            version.step,
            items[0].index.fqn,
            more,
            why,
        )
