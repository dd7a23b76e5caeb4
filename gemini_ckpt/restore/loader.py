"""Loading a version through DCP: a ``StorageReader`` over verified, item-by-item views.

Restore runs ``torch.distributed.checkpoint.load`` (so DCP's load planner reshards at any
world size) with :class:`VersionReader` and :class:`SafeLoadPlanner`. The reader is given the
same step from one or more tiers, best first (memory, then the durable copy); each is a
*version view* (:mod:`gemini_ckpt.stores.views`) that returns an item already verified and
decoded. An item that no copy of a view can produce is taken from the next view; only when none
can is the version unreadable (and restore moves to an older one). Nothing is unpickled with
arbitrary globals.
"""

from __future__ import annotations

import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointError, ChecksumError, VerificationError
from ..state.dcp import RawLocation, local_load_plan
from ..state.torch_private import narrow_to_chunk, set_in_state_dict
from ..trust.items import safe_opaque, torch_load_value


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
                tensor = narrow_to_chunk(value, req.storage_offsets, req.lengths)
            except (RuntimeError, IndexError, ValueError) as exc:
                raise VerificationError(
                    f"step {self.views[0].step} {req.storage_index.fqn}: the saved tensor does "
                    f"not match its metadata ({exc})"
                ) from None
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise VerificationError(
                    f"step {self.views[0].step} {req.storage_index.fqn}: saved shape "
                    f"{tuple(tensor.size())} does not fit the target's {tuple(target.size())}"
                )
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
        if (
            self.flatten_state_dict
            and getattr(self.metadata, "version", None) is None
            and set(self.metadata.state_dict_metadata) - set(self.state_dict)
        ):
            return super().create_local_plan()
        return local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_value(self, read_item, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_in_state_dict(self.original_state_dict, self.mappings[fqn], value)
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
        dcp.load(
            state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group, no_dist=world_size == 1
        )
    return reader.report
