"""The DTensor chunks our planners compute without index tensors equal torch's own."""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from gemini_ckpt.state.dcp import local_load_plan, local_save_plan, shard_range

SHAPES = [(10,), (7, 5), (3, 4, 6), (0, 4), (2,), (1, 9)]
MESHES = [(1,), (4,), (2, 3), (3, 2, 2)]


def _placements(ndim: int, mesh_ndim: int):
    choices = [Replicate()] + [Shard(d) for d in range(ndim)] + [Shard(-1)]
    return itertools.product(choices, repeat=mesh_ndim)


def test_shard_range_equals_torch_for_every_rank_of_every_layout():
    compared = 0
    for shape, mesh in itertools.product(SHAPES, MESHES):
        for placements in _placements(len(shape), len(mesh)):
            for coord in itertools.product(*(range(n) for n in mesh)):
                want = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
                got = shard_range(shape, mesh, list(coord), placements)
                if any(p.is_shard() and p.dim < 0 for p in placements):
                    assert got is None
                    continue
                assert got == (tuple(want[0]), tuple(want[1])), (shape, mesh, placements, coord)
                compared += 1
    assert compared > 2000


def test_other_placements_are_left_to_torch():
    assert shard_range((8,), (2,), [0], (Partial(),)) is None
    assert shard_range((8,), (2, 2), [0, 1], (Shard(0), _StridedShard(0, split_factor=2))) is None


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _state(mesh):
    return {
        "w": DTensor.from_local(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)]),
        "r": DTensor.from_local(torch.ones(5, dtype=torch.bfloat16), mesh, [Replicate()]),
        "plain": torch.zeros(2, 2),
        "step": 7,
    }


def test_local_plans_equal_dcps(mesh, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = _state(mesh)
    assert local_save_plan(state) == create_default_local_save_plan(state, True)
    dcp.save(state, checkpoint_id=str(tmp_path))
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert local_load_plan(state, metadata) == create_default_local_load_plan(state, metadata)
    with pytest.raises(RuntimeError, match="Missing key"):
        local_load_plan({**state, "extra": torch.zeros(1)}, metadata)
    assert local_load_plan(
        {**state, "extra": torch.zeros(1)}, metadata, strict=False
    ) == create_default_local_load_plan(state, metadata)
    with pytest.raises(ValueError, match="Size mismatch"):
        local_load_plan({**state, "plain": torch.zeros(3)}, metadata)
    loader = DefaultLoadPlanner()
    loader.set_up_planner(state, metadata=metadata, is_coordinator=True)
    assert loader.create_local_plan() == local_load_plan(loader.state_dict, metadata)
