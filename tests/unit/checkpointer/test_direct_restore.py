"""The direct restore (:mod:`gemini_ckpt.restore.direct`): at the world size a version was saved
at, every item goes straight into its live tensor, optimizers get their state without a
throw-away step, and what does not fit the direct path goes through DCP's planner."""

from __future__ import annotations

import dataclasses
import uuid

import torch
from torch import nn

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.save.plan import adoptable, signature
from gemini_ckpt.state.dcp import flatten


def _config() -> CheckpointConfig:
    return CheckpointConfig(store="local", namespace=f"direct-{uuid.uuid4().hex}", keep_in_memory=2)


def _step(t, batches) -> None:
    lm_loss(t.model, next(batches)).backward()
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)


def test_the_usual_restart_loads_every_item_directly_into_the_live_tensors_and_continues_exactly():
    config = _config()
    a = build_training(seed=0, dataset_size=32)
    batches = a.batches()
    state = TrainState(model=a.model, optimizer=a.optimizer, scheduler=a.scheduler)
    ckpt = Checkpointer(state, config)
    for step in range(3):
        _step(a, batches)
        ckpt.save(step)
    ckpt.close()
    live_before = {n: p.data_ptr() for n, p in a.model.named_parameters()}

    b = build_training(seed=7, dataset_size=32)  # other values; its optimizer has no state yet
    assert not b.optimizer.state
    restored = Checkpointer(TrainState(model=b.model, optimizer=b.optimizer, scheduler=b.scheduler), config).restore()
    assert restored.step == 2 and restored.path == "direct"
    assert [name for name, _ in restored.timeline] == [
        "called",
        "connected",
        "surveyed",
        "fetched",
        "targeted",
        "planned",
        "opened",
        "loaded",
        "done",
    ]
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, per_param in sa["state"].items():
        assert set(per_param) == set(sb["state"][k])
        for name, value in per_param.items():
            assert torch.equal(value, sb["state"][k][name]) and value.dtype == sb["state"][k][name].dtype
    # The same objects are trained on (loaded in place), and training continues identically.
    assert {n: p.data_ptr() for n, p in a.model.named_parameters()} == live_before
    torch.manual_seed(0)
    _step(a, iter([next(build_training(seed=3, dataset_size=32).batches())]))
    torch.manual_seed(0)
    _step(b, iter([next(build_training(seed=3, dataset_size=32).batches())]))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name


def test_the_first_save_after_a_restore_takes_over_the_restored_plan_and_its_versions_restore_exactly():
    config = _config()
    a = build_training(seed=0, dataset_size=32)
    batches = a.batches()
    with Checkpointer(TrainState(model=a.model, optimizer=a.optimizer, scheduler=a.scheduler), config) as ckpt:
        for step in range(2):
            _step(a, batches)
            ckpt.save(step)
    assert ckpt.stats.plans == 1

    b = build_training(seed=7, dataset_size=32)
    second = Checkpointer(TrainState(model=b.model, optimizer=b.optimizer, scheduler=b.scheduler), config)
    assert second.restore().step == 1
    _step(b, b.batches())
    second.save(2).committed.result(timeout=60)
    second.close()
    assert second.stats.plans == 0  # no planning: the restored version's plan, taken over
    plans = {v.plans[0].plan_id for v in (second.store.open(s) for s in (1, 2))}
    assert len(plans) == 2  # under a plan id of its own

    c = build_training(seed=9, dataset_size=32)
    third = Checkpointer(TrainState(model=c.model, optimizer=c.optimizer, scheduler=c.scheduler), config)
    assert third.restore().step == 2
    for (name, pb), (_, pc) in zip(b.model.named_parameters(), c.model.named_parameters()):
        assert torch.equal(pb, pc), name
    third.close()

    # Taken over only for the state, rank, world and code it was made for.
    shard = third.store.open(2).plans[0]
    flat = flatten(
        TrainState(model=c.model, optimizer=c.optimizer, scheduler=c.scheduler).tensor_state()
        | TrainState(model=c.model, optimizer=c.optimizer, scheduler=c.scheduler).opaque_state(0)
    )
    job = dict(shard.job)
    assert adoptable(shard, signature(flat), rank=0, world_size=1, job=job)
    other = dict(flat)
    key = next(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dtype == torch.float32)
    other[key] = flat[key].double()
    assert not adoptable(shard, signature(other), rank=0, world_size=1, job=job)  # another signature
    assert not adoptable(shard, signature(flat), rank=0, world_size=1, job={**job, "torch": "0.0"})  # other code
    assert not adoptable(shard, signature(flat), rank=1, world_size=2, job=job)
    assert not adoptable(dataclasses.replace(shard, signature=""), signature(flat), rank=0, world_size=1, job=job)


def test_an_optimizer_whose_state_is_not_shaped_like_its_parameters_gets_it_the_usual_way():
    class Flat(torch.optim.Optimizer):
        """State of another shape than the parameter's: a flattened running sum."""

        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    st.setdefault("flat", torch.zeros(p.numel()))
                    st["flat"] += p.grad.reshape(-1)
                    p -= group["lr"] * st["flat"].reshape(p.shape)

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(4, 3)
        return model, Flat(model.parameters())

    config = _config()
    model, opt = build(0)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with Checkpointer(TrainState(model=model, optimizer=opt), config) as first:
        first.save(0).committed.result(timeout=60)
    model2, opt2 = build(1)
    state2 = TrainState(model=model2, optimizer=opt2)
    assert not state2._prime_optimizers(
        {"optim.state.weight.flat": _md(torch.Size([12]))}
    )  # not the parameter's shape: not primed
    assert not opt2.state
    restored = Checkpointer(state2, config).restore()
    assert restored.step == 0
    assert torch.equal(opt2.state[model2.weight]["flat"], opt.state[model.weight]["flat"])
    assert torch.equal(model2.weight, model.weight)


def test_a_conjugate_live_tensor_is_loaded_through_dcp():
    class M(nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.register_buffer("c", torch.randn(3, dtype=torch.complex64, generator=g).conj())

    config = _config()
    saved = M(0)
    with Checkpointer(TrainState(model=saved), config) as first:
        first.save(0).committed.result(timeout=60)
    loaded = M(1)
    restored = Checkpointer(TrainState(model=loaded), config).restore()
    assert restored.path == "dcp" and torch.equal(loaded.c, saved.c)


def _md(size):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0] * len(size)), size)]
    )
