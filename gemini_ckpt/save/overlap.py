"""Overlapped staging (``CheckpointConfig(staging="overlap")``): the copy of the parameters and
the optimizer state runs while the next step's forward and backward do (CheckFreq's pipelined
snapshot), and the next ``optimizer.step()`` waits for it.

What may change between ``save()`` and the next ``optimizer.step()``: buffers (a forward
updates running statistics), gradients (the backward), the values (scheduler, RNG, data
loader). Those are copied by ``save()`` itself, as always. Parameters and optimizer state change
only in ``optimizer.step()``: they are copied on the copying thread, and a pre-step hook on
every optimizer of the state waits for that copy.

Nothing is trusted to that rule: every source tensor's version counter (``Tensor._version``,
bumped by every in-place operation) is read when ``save()`` takes the sources and again after
its copy. A tensor changed in place in between fails that version with an error naming it; the
previous version stays, and the error is raised on the training thread. A tensor without a
version counter (an inference tensor) is copied by ``save()``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..state.train_state import TrainState


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def version_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s in-place version counter, or None when it has none (inference tensors)."""
    try:
        return int(_local(t)._version)
    except RuntimeError:
        return None


def optimizer_owned(state: TrainState) -> set[int]:
    """Storage addresses of the tensors only ``optimizer.step()`` changes: the parameters
    (trainable or frozen) and every optimizer-state tensor."""
    tensors = list(state.module.parameters())
    for opt in state.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                tensors.extend(v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return {_local(t).untyped_storage().data_ptr() for t in tensors}


def split(state: TrainState, tensors: list[torch.Tensor], volatile: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """``(now, behind)``: the tensor items ``save()`` copies itself, and those the copying
    thread copies while the next step runs (see the module docstring)."""
    owned = optimizer_owned(state)
    now, behind = [], []
    for i, t in enumerate(tensors):
        local = _local(t.detach())
        if i not in volatile and local.untyped_storage().data_ptr() in owned and version_of(t) is not None:
            behind.append(i)
        else:
            now.append(i)
    return now, behind
