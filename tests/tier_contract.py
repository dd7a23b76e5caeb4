"""What every tier must do, as two functions: :func:`check_read_contract` for anything restore
reads from (the process-local memory tier, the host stores, the durable tier), and
:func:`check_tier_contract` for a memory tier (the call order of :mod:`gemini_ckpt.stores.base`,
from one rank of a world of one), which includes the read contract."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from gemini_ckpt import VersionNotFoundError
from gemini_ckpt.save.plan import make_plan
from gemini_ckpt.save.stager import Stager


def _state(fill: float) -> dict:
    return {
        "model": {"w": torch.full((64, 33), fill), "b": torch.arange(7, dtype=torch.int64) + int(fill)},
        "rank_local": {"0": {"extra": pickle.dumps({"fill": fill})}},
    }


def save_filled(tier, step: int, fill: float, plan=None):
    """Hand ``step`` to ``tier``: a small state whose tensors are all ``fill``; wait for its commit."""
    state = _state(fill)
    if plan is None:
        plan, _ = make_plan(state, rank=0, world_size=1, group=None, job={"test": True})
    seg = tier.segment(plan.shard)
    Stager().stage(plan.shard, seg, [state["model"]["w"], state["model"]["b"]])
    outcome = tier.hand_off(step, plan.shard, seg, [state["rank_local"]["0"]["extra"]]).result(timeout=120)
    assert outcome.committed, outcome
    return plan


def check_read_contract(tier, step: int, expected: dict) -> None:
    """``tier`` holds version ``step`` whose items ``expected`` maps (MetadataIndex -> tensor)."""
    steps = tier.committed_steps()
    assert step in steps and steps == sorted(steps)
    view = tier.open(step)
    try:
        assert view.step == step and view.world_size >= 1
        for index, value in expected.items():
            got = view.read(index)
            assert torch.equal(got, value), index
        with pytest.raises(LookupError):
            view.read(MetadataIndex("no.such.item", torch.Size([0])))
    finally:
        view.close()
    with pytest.raises(VersionNotFoundError):
        tier.open(max(steps) + 10_000)


def check_tier_contract(tier, *, keep: int) -> None:
    plan = save_filled(tier, 10, 1.0)
    # 1. committed_steps lists what was handed off; open() gives a verified, item-by-item view.
    check_read_contract(
        tier,
        10,
        {
            MetadataIndex("model.w", torch.Size([0, 0]), 0): torch.full((64, 33), 1.0),
            MetadataIndex("model.b", torch.Size([0]), 1): torch.arange(7) + 1,
        },
    )
    view = tier.open(10)
    try:
        assert view.plans[0] == plan.shard and view.world_size == 1
        assert pickle.loads(view.read(MetadataIndex("rank_local.0.extra"))) == {"fill": 1.0}  # via the allow-list
    finally:
        view.close()
    # 2. retention keeps the newest ``keep``; segments are reused once versions are released.
    for i in range(1, keep + 3):
        save_filled(tier, 10 + i, 1.0 + i, plan)
    steps = [s for s in tier.committed_steps() if s >= 10]
    assert steps == list(range(10 + 3, 10 + keep + 3)), steps
    allocated = tier.allocations
    save_filled(tier, 10 + keep + 3, 9.0, plan)
    assert tier.allocations == allocated and tier.allocations <= keep + 1
    # 3. a segment that is not handed off goes back, and the next save gets it again.
    seg = tier.segment(plan.shard)
    tier.give_back(seg)
    assert tier.segment(plan.shard).id == seg.id
    # 4. discard() never removes what this tier wrote; a missing step is VersionNotFoundError.
    newest = max(tier.committed_steps())
    tier.discard(newest)
    assert newest in tier.committed_steps()
    with pytest.raises(VersionNotFoundError):
        tier.open(10_000)
