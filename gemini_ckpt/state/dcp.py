"""The DCP adapter: how a live training state meets DCP's types. One module that the snapshot
(``save/``), the tiers' views (``stores/``) and restore (``restore/``) all import:

- :func:`flatten`: a state dict flattened exactly as DCP's save planner flattens it;
- :class:`RawLocation`: where an item of a memory version lives (DCP's ``storage_data``);
- :func:`dtype_name` / :func:`torch_dtype`: a dtype as the format writes it, and back;
- :func:`local_tensor` and :func:`live_storages`: the storages a live state's tensors use;
- :func:`chunk_of`, :func:`local_save_plan`, :func:`local_load_plan`: DCP's local plans,
  DTensor chunks computed without index tensors (below).

Where a DTensor's local shard sits in the global tensor, without building index tensors.

DCP's planners ask DTensor for its chunk (``__create_chunk_list__``, ``__create_write_items__``),
and torch computes the chunk's offsets by materializing ``torch.arange`` over every local row
of every sharded dimension: an int64 index as long as the shard, allocated and filled for every
tensor at every plan, a large share of a restore's time (measured in docs/recovery.md). For
the placements FSDP2
and most tensor-parallel layouts use, :class:`~torch.distributed.tensor.Shard` and
:class:`~torch.distributed.tensor.Replicate`, the shard is one contiguous range per
dimension, and its offset is a sum. :func:`chunk_of` computes that; anything else
(``_StridedShard``, ``Partial``, a rank outside the mesh) goes to torch's own computation.

:func:`local_save_plan` and :func:`local_load_plan` are DCP's default local plans
(``create_default_local_save_plan``, ``create_default_local_load_plan``) with the chunk taken
from :func:`chunk_of`; ``tests/unit/format/test_chunks.py`` holds them equal to DCP's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

if TYPE_CHECKING:
    from .train_state import TrainState

__all__ = [
    "RawLocation",
    "chunk_of",
    "dtype_name",
    "flatten",
    "live_storages",
    "local_load_plan",
    "local_save_plan",
    "local_tensor",
    "shard_range",
    "torch_dtype",
]


@dataclass(frozen=True)
class RawLocation:
    """``storage_data`` of an item in a memory version: item ``item`` of rank ``rank``'s shard
    (tensor items first, then value items, each in plan order)."""

    rank: int
    item: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def flatten(state_dict: dict) -> dict[str, Any]:
    """The state dict flattened exactly as DCP's save planner flattens it."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
    return planner.state_dict


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def live_storages(state: "TrainState") -> set[int]:
    """Storage addresses of every parameter, buffer and optimizer-state tensor of ``state``."""
    found = set()
    tensors = list(state.module.parameters()) + list(state.module.buffers())
    for opt in state.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                tensors.extend(v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    for t in tensors:
        found.add(local_tensor(t).untyped_storage().data_ptr())
    return found


def shard_range(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: tuple
) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(local shape, global offset)`` of the shard at ``coordinate``, as torch's
    ``compute_local_shape_and_global_offset`` gives it, or None when a placement is not a plain
    ``Shard`` or ``Replicate`` (torch's computation then decides)."""
    shape = list(global_shape)
    start: dict[int, int] = {}
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim
        if not 0 <= dim < len(shape):
            return None  # a negative dim (DTensor normalizes them): torch's own keys it apart
        size, offset = Shard.local_shard_size_and_offset(shape[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        # torch: an empty shard's offset is the dimension's global size; a non-empty one's is
        # its offset within the range the previous mesh dimensions left (contiguous).
        start[dim] = global_shape[dim] if size == 0 else start.get(dim, 0) + int(offset)
        shape[dim] = int(size)
    offsets = [0] * len(shape)
    for dim, at in start.items():
        offsets[dim] = at
    return tuple(shape), tuple(offsets)


def chunk_of(tensor: DTensor) -> Optional[ChunkStorageMetadata]:
    """This rank's chunk of ``tensor`` (plain placements only, else None)."""
    if type(tensor._local_tensor) is not torch.Tensor and hasattr(tensor._local_tensor, "__create_chunk_list__"):
        return None  # a local tensor with its own chunks (torch delegates to it)
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    found = shard_range(
        tuple(tensor.shape), tuple(tensor.device_mesh.shape), list(coordinate), tuple(tensor.placements)
    )
    if found is None:
        return None
    sizes, offsets = found
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def local_save_plan(state_dict: dict[str, Any]) -> SavePlan:
    """DCP's ``create_default_local_save_plan`` (any rank), DTensor chunks from :func:`chunk_of`."""
    requests: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is None:
                continue
            chunk = chunk_of(obj)
            if chunk is None:
                requests += _create_write_items(fqn, obj)
                continue
            requests.append(
                WriteItem(
                    index=MetadataIndex(fqn, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, properties=TensorProperties.create_from_tensor(obj.to_local()), size=obj.size()
                    ),
                )
            )
        else:
            requests += _create_write_items(fqn, obj)
    return SavePlan(requests)


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool = True) -> LoadPlan:
    """DCP's ``create_default_local_load_plan``, DTensor chunks from :func:`chunk_of`."""
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is None:
                continue
            chunk = chunk_of(obj) if isinstance(md, TensorStorageMetadata) else None
            if chunk is not None:
                requests += create_read_items_for_chunk_list(fqn, md, [chunk])
                continue
        requests += _create_read_items(fqn, md, obj)
    return LoadPlan(requests)
