"""staging="overlap": parameters and optimizer state copied while the next step runs, the next
optimizer.step() waits for the copy, a tensor changed in place before its copy fails the version."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from gemini_ckpt import BackgroundError, CheckpointConfig, Checkpointer, TrainState, faults
from gemini_ckpt.errors import ConfigError


class _Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(64, 256)
        self.norm = torch.nn.BatchNorm1d(256)  # running statistics: buffers a forward updates
        self.b = torch.nn.Linear(256, 8)
        self.frozen = torch.nn.Parameter(torch.randn(1 << 20), requires_grad=False)  # 4 MB, never stepped

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def _job(seed: int = 0):
    net = _Net(seed)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    return net, opt, TrainState(model=net, optimizer=opt)


def _step(net, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(net, opt) -> dict:
    return {
        **{k: v.clone() for k, v in net.state_dict().items()},
        **{
            f"opt.{i}.{k}": v.clone()
            for i, s in opt.state_dict()["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        },
    }


def _config(ns: str, staging: str = "overlap") -> CheckpointConfig:
    return CheckpointConfig(store="local", namespace=ns, keep_in_memory=3, staging=staging)


def test_each_version_holds_the_state_at_its_save_while_the_next_steps_change_it():
    ns = f"overlap-{uuid.uuid4().hex}"
    net, opt, state = _job()
    ckpt = Checkpointer(state, _config(ns))
    expected = {}
    for i in range(6):
        _step(net, opt, i)  # the step's optimizer.step() waits for the previous version's copy
        expected[i] = _snapshot(net, opt)
        handle = ckpt.save(i)
        assert handle.staged.result(timeout=30).behind_s > 0  # the parameters were copied behind save()
    ckpt.wait()
    assert ckpt.stats.committed == 6
    ckpt.close()
    for step in (4, 5):  # keep_in_memory=3: 3, 4, 5 kept
        net2, opt2, state2 = _job(seed=99)
        restored = Checkpointer(state2, _config(ns)).restore(step=step)
        assert restored.step == step
        got = _snapshot(net2, opt2)
        assert got.keys() == expected[step].keys()
        for k, v in expected[step].items():
            assert torch.equal(got[k], v), (step, k)


def test_the_next_optimizer_step_waits_for_the_copy_and_save_stalls_only_for_the_rest():
    ns = f"overlap-{uuid.uuid4().hex}"
    net, opt, state = _job()
    ckpt = Checkpointer(state, _config(ns))
    _step(net, opt, 0)
    ckpt.save(0).staged.result(timeout=30)  # the first save plans: not the case measured
    _step(net, opt, 1)
    faults.set_hook(lambda phase, **ctx: time.sleep(0.5) if phase == "copy_behind" else None)
    try:
        t0 = time.perf_counter()
        handle = ckpt.save(1)
        returned = time.perf_counter() - t0
        assert not handle.staged.done()  # save() returned before the copying thread's part
        _step(net, opt, 2)  # its optimizer.step() returns only once version 1 is fully copied
        assert handle.staged.done() and handle.staged.exception() is None
    finally:
        faults.set_hook(None)
    info = handle.staged.result()
    assert returned < 0.5 and info.stall_s <= returned
    assert [name for name, _ in info.phases] == ["check", "segment", "copy"]
    assert info.behind_s >= 0.5 and ckpt.stats.overlap_wait_s > 0.3
    ckpt.close()


def test_a_parameter_changed_in_place_before_the_next_step_fails_that_version_and_keeps_the_previous():
    ns = f"overlap-{uuid.uuid4().hex}"
    net, opt, state = _job()
    ckpt = Checkpointer(state, _config(ns))
    _step(net, opt, 0)
    good = _snapshot(net, opt)
    ckpt.save(0)
    ckpt.wait()
    _step(net, opt, 1)
    mutated = threading.Event()
    faults.set_hook(lambda phase, **ctx: mutated.wait(30) if phase == "copy_behind" else None)
    try:
        handle = ckpt.save(1)
        with torch.no_grad():
            net.frozen.mul_(2.0)  # not optimizer.step(), before the copy: the version is refused
        mutated.set()
        with pytest.raises(BackgroundError, match=r"version 1 is torn: model.frozen changed in place"):
            ckpt.wait()
    finally:
        faults.set_hook(None)
    with pytest.raises(Exception, match="torn"):
        handle.committed.result(timeout=30)
    with pytest.raises(Exception, match="torn"):
        handle.staged.result(timeout=30)
    ckpt.abort()
    net2, opt2, state2 = _job(seed=99)
    restored = Checkpointer(state2, _config(ns)).restore()
    assert restored.step == 0
    for k, v in good.items():
        assert torch.equal(_snapshot(net2, opt2)[k], v), k


def test_buffers_and_gradients_are_copied_by_save_itself():
    """A forward after save() updates BatchNorm's running statistics (buffers): those were copied
    before save() returned, so the version holds the values at the save, and nothing is torn."""
    ns = f"overlap-{uuid.uuid4().hex}"
    net, opt, state = _job()
    ckpt = Checkpointer(state, _config(ns))
    _step(net, opt, 0)
    at_save = net.norm.running_mean.clone()
    ckpt.save(0)
    net(torch.randn(32, 64))  # a forward: running_mean changes in place, before any optimizer step
    assert not torch.equal(net.norm.running_mean, at_save)
    ckpt.wait()
    ckpt.close()
    net2, opt2, state2 = _job(seed=99)
    assert Checkpointer(state2, _config(ns)).restore().step == 0
    assert torch.equal(net2.norm.running_mean, at_save)


def test_staging_names_its_choices():
    with pytest.raises(ConfigError, match="staging='later' is not valid; use one of 'copy', 'overlap'"):
        CheckpointConfig(staging="later")
