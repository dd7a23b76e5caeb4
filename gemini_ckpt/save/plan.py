"""The snapshot plan: which items this rank saves and where their bytes go, made once by DCP.

The first version (and any version whose state changed structure) runs DCP's own save
planning through public API (``torch.distributed.checkpoint.save`` with
``DefaultSavePlanner`` and :class:`_PlanCapture`, a ``StorageWriter`` that writes nothing):
the ranks agree on who saves which item (replicated tensors deduplicated, DTensor shards by
their owners) and rank 0 gets the global ``Metadata``. That is the only collective saving ever
runs. The result is this rank's :class:`~gemini_ckpt.format.shards.ShardPlan`: tensor items at
fixed, aligned offsets of a region (in DCP's plan order), non-tensor items as blobs, a
verified ``torch.save`` template per tensor signature (so a host store can write the
durable layout without torch), and, on rank 0, the pickled skeleton of the global metadata.

Every later version reuses the plan while :func:`signature` of the state is unchanged. After a
restore at the same world size, the restored version's plan is taken over when the live state
has the signature it was made for (:func:`adopt`), so the first save after a restart does not
plan again (DCP's planning collective and a template per tensor signature: seconds for a large
state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..format.shards import ShardPlan, TensorItem, ValueItem, align
from ..state.dcp import RawLocation, dtype_name, local_save_plan
from .templates import template_for


@dataclass
class SnapshotPlan:
    """This rank's plan and what the trainer needs to fill it each version."""

    shard: ShardPlan
    signature: tuple
    tensor_index: list[MetadataIndex]
    value_index: list[MetadataIndex]

    @property
    def plan_id(self) -> str:
        return self.shard.plan_id


def digest(sig: tuple) -> str:
    """A plan's record of the signature it was made for (:attr:`ShardPlan.signature`), in key
    order: a restored optimizer holds the same state as the saved one, not always in the order
    the saved one made it (a plan finds each item by its key)."""
    return hashlib.sha256(repr(sorted(sig, key=lambda entry: entry[0])).encode()).hexdigest()


def signature(flat: dict[str, Any]) -> tuple:
    """What a plan depends on: every key, and each tensor's dtype, global and local shape."""
    out = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            local = value._local_tensor
            out.append(
                (
                    key,
                    dtype_name(value.dtype),
                    tuple(value.shape),
                    tuple(local.shape),
                    tuple(value.placements),
                    tuple(value.device_mesh.shape),
                )
            )
        elif isinstance(value, torch.Tensor):
            out.append((key, dtype_name(value.dtype), tuple(value.shape)))
        else:
            out.append((key,))
    return tuple(out)


DCP_VERSION = "1.0.0"
"""What DCP's ``FileSystemWriter`` stamps into ``Metadata.version`` (since 2.4); every version we
write carries it, and a checkpoint without it may use DCP's pre-2.4 key flattening."""


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (no plan caching), its DTensor chunks computed without
    index tensors (:mod:`.chunks`)."""

    def create_local_plan(self) -> SavePlan:
        plan = local_save_plan(self.state_dict)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan


class _PlanCapture(StorageWriter):
    """A ``StorageWriter`` that writes nothing: it keeps DCP's final local plan, the planner
    (to resolve each item to its live tensor) and, on the coordinator, the global metadata.
    The coordinator picks the plan id and hands it to every rank with its plan."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = 0
        self.plan_id = ""
        self.items: list = []
        self.planner: Optional[SavePlanner] = None
        self.metadata: Optional[Metadata] = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plan_id = uuid.uuid4().hex
        return [dataclasses.replace(p, storage_data=(plan_id, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.plan_id, rank = plan.storage_data
        self.items, self.planner = list(plan.items), planner
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        values = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        results = [
            WriteResult(index=item.index, size_in_bytes=0, storage_data=RawLocation(rank, j))
            for j, item in enumerate(tensors + values)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION  # flattened the >= 2.4 way (what a load planner needs to know)
        self.metadata = metadata

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def make_plan(state_dict: dict, *, rank: int, world_size: int, group, job: dict) -> tuple[SnapshotPlan, dict]:
    """Plan ``state_dict`` (the live state: tensors and values) with every rank of ``group``
    (collective when ``world_size > 1``). Returns the plan and the flattened state dict DCP's
    planner resolved (key -> live value), from which the first version is filled."""
    capture = _PlanCapture()
    planner = _SavePlanner()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state_dict, storage_writer=capture, planner=planner, process_group=group, no_dist=world_size == 1)
    flat = planner.state_dict
    tensors, values, templates, keyed = [], [], [], {}
    tensor_index, value_index = [], []
    at = 0
    for item in capture.items:
        if item.type == WriteItemType.BYTE_IO:
            value = planner.lookup_object(item.index)
            kind = "bytes" if isinstance(value, bytes) else "pickle"
            values.append(ValueItem(item.index.fqn, item.index.index, kind))
            value_index.append(item.index)
            continue
        tensor = planner.resolve_data(item)
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        key = (dtype, shape)
        if key not in keyed:
            keyed[key] = len(templates)
            templates.append(template_for(dtype, shape))
        nbytes = tensor.numel() * tensor.element_size()
        at = align(at)
        chunk = None if item.index.offset is None else tuple(int(x) for x in item.index.offset)
        tensors.append(
            TensorItem(item.index.fqn, chunk, item.index.index, dtype_name(dtype), shape, at, nbytes, keyed[key])
        )
        tensor_index.append(item.index)
        at += nbytes
    skeleton = b""
    if capture.metadata is not None:
        bare = dataclasses.replace(capture.metadata, storage_data={}, storage_meta=None)
        skeleton = pickle.dumps(bare, protocol=pickle.HIGHEST_PROTOCOL)
    sig = signature(flat)
    shard = ShardPlan(
        plan_id=capture.plan_id,
        rank=rank,
        world_size=world_size,
        tensors=tuple(tensors),
        values=tuple(values),
        templates=tuple(templates),
        metadata=skeleton,
        job=dict(job),
        signature=digest(sig),
    )
    return SnapshotPlan(shard, sig, tensor_index, value_index), flat


ADOPT_JOB_KEYS = ("namespace", "world_size", "gemini_ckpt", "torch")
"""What a restored plan's job must share with the live one to be taken over: the same run and
world, and the same versions of the code that laid it out and verified its templates."""


def adoptable(shard: Optional[ShardPlan], sig: tuple, *, rank: int, world_size: int, job: dict) -> bool:
    """Whether this rank can take over ``shard`` (a restored version's plan of this rank) for the
    live state of :func:`signature` ``sig``: made for this rank and world by the same code, for a
    state of the same signature. Every rank must be able to, or every rank plans again
    (planning is a collective)."""
    return (
        shard is not None
        and shard.signature != ""
        and shard.rank == rank
        and shard.world_size == world_size
        and all(shard.job.get(k) == job.get(k) for k in ADOPT_JOB_KEYS)
        and shard.signature == digest(sig)
    )


def adopt(shard: ShardPlan, sig: tuple, *, run_id: str, job: dict) -> SnapshotPlan:
    """The restored plan ``shard`` as this run's plan (see :func:`adoptable`): the same items,
    offsets, templates and metadata skeleton, under a plan id derived from the restored one and
    ``run_id`` (the same on every rank; a new id, so the host stores never mix it up with the
    restored version's, whose job and checked items may differ)."""
    tensor_index = [
        MetadataIndex(t.fqn, None if t.chunk is None else torch.Size(t.chunk), t.index) for t in shard.tensors
    ]
    value_index = [MetadataIndex(v.fqn, None, v.index) for v in shard.values]
    plan_id = hashlib.sha256(f"{shard.plan_id}/{run_id}".encode()).hexdigest()[:32]
    return SnapshotPlan(
        dataclasses.replace(shard, plan_id=plan_id, job=dict(job), checked=()), sig, tensor_index, value_index
    )
