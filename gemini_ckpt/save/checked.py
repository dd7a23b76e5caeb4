"""Which tensor items of a plan the health check reads (:attr:`ShardPlan.checked`).

Decided here, on the trainer, when a plan is made: only the live objects tell a parameter
from a buffer (both are ``model.<name>`` items). The host store then checks the items the
signed plan names, without guessing from keys. See :mod:`gemini_ckpt.health`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from ..health import HealthCheck
from ..state.train_state import GRADS, MODEL, OPTIM, TrainState
from ..format.finite import CHECKED_DTYPES
from .plan import SnapshotPlan


def _storage(value: Any) -> Optional[int]:
    if isinstance(value, DTensor):
        value = value._local_tensor
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def checked_items(
    plan: SnapshotPlan, flat: dict[str, Any], state: TrainState, check: Optional[HealthCheck]
) -> tuple[int, ...]:
    """Indices of the plan's tensor items ``check`` covers (floating-point dtypes only).

    ``flat``: the flattened state dict the plan was made from. A ``model.`` item is a
    parameter when its key names one of the model's parameters or it shares a parameter's
    storage (a wrapper that renames keys), else a buffer."""
    if check is None:
        return ()
    names = {f"{MODEL}.{name}" for name, _ in state._named_parameters()}
    storages = {_storage(p) for p in state.module.parameters()}
    out = []
    for i, (index, item) in enumerate(zip(plan.tensor_index, plan.shard.tensors)):
        if item.dtype not in CHECKED_DTYPES or not item.nbytes:
            continue
        fqn = item.fqn
        if fqn.startswith(MODEL + "."):
            is_param = fqn in names or _storage(flat.get(index.fqn)) in storages
            wanted = check.parameters if is_param else check.buffers
        elif fqn.startswith(OPTIM + ".state."):
            wanted = check.optimizer_state
        elif fqn.startswith(GRADS + "."):
            wanted = check.gradients
        else:
            wanted = False
        if wanted:
            out.append(i)
    return tuple(out)
