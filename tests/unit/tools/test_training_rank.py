"""The training-rank base the tests, the chaos harness and the benchmarks share
(:mod:`gemini_ckpt.testing.ranks`), run in this process as a world of one."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed as dist

from gemini_ckpt import CheckpointConfig, TrainState
from gemini_ckpt.testing.ranks import Rendezvous, TrainingRank


@pytest.fixture
def rendezvous():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    threads = torch.get_num_threads()
    rendezvous = Rendezvous(world_size=1, timeout_s=30)
    try:
        yield rendezvous
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        rendezvous.close()
        torch.set_num_threads(threads)


def test_a_rank_joins_through_the_drivers_store_and_leaves_the_group_at_teardown(rendezvous):
    rank = TrainingRank()
    assert torch.get_num_threads() == 1
    rank.join(0, 1, rendezvous.address, 30)
    assert (rank.rank, rank.world_size, dist.get_world_size()) == (0, 1, 1)
    rank.barrier()
    assert rank.teardown() is True
    assert not dist.is_initialized()


def test_replacing_the_checkpointer_closes_the_one_before_and_teardown_aborts_the_last(rendezvous):
    rank = TrainingRank()
    rank.join(0, 1, rendezvous.address, 30)
    state = TrainState(model=torch.nn.Linear(4, 4))
    config = CheckpointConfig(store="local", namespace=f"rank-{uuid.uuid4().hex}")
    first = rank.replace_checkpointer(state, config)
    first.save(1)
    second = rank.replace_checkpointer(state, config)
    assert first.closed and rank.ckpt is second and not second.closed
    assert rank.teardown() is True
    assert second.closed and rank.ckpt is None and not dist.is_initialized()
