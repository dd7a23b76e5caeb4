"""Hooks that mark a model's gradient and parameter collectives, so that the host stores'
replication yields to them (docs/interleave.md).

One call after the model is wrapped and the Checkpointer built::

    model = DDP(model)                      # or fully_shard(...) (FSDP2)
    ckpt = Checkpointer(TrainState(model=model, optimizer=opt), config)
    gemini_ckpt.interleave(model, ckpt)

- **DDP**: a comm hook (``register_comm_hook``) running DDP's own all-reduce of each bucket,
  marked from the hook's call until the all-reduce's future completes. DDP takes one comm hook:
  a model that already has one (PowerSGD, compression) is refused; mark inside that hook with
  ``ckpt.comm_marker()`` instead.
- **FSDP2** (``fully_shard``): every FSDP module's all-gather (forward, and backward when
  resharded) and reduce-scatter (backward) run through ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` with the stock ``all_gather_single`` / ``reduce_scatter_single``,
  each marked from its issue until its work completes. Not covered: the all-reduce of HSDP's
  replicate dimension (``set_all_reduce_hook`` replaces it rather than wrapping it).
- Anything else (a loss all-reduce, a pipeline send, a metrics gather):
  ``with ckpt.communicating(): ...``.

Marks cost no message: a few stores into a shared page; until the Checkpointer has started, and
with ``interleave=False`` or ``"network"`` (no gate reads the marks), the hooks only run the
collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ..checkpointer import Checkpointer


def interleave(model: torch.nn.Module, checkpointer: Checkpointer) -> torch.nn.Module:
    """Mark ``model``'s collectives for ``checkpointer``'s host stores (see the module
    docstring); returns ``model``. A DDP model or one with FSDP2 (``fully_shard``) modules;
    anything else is a TypeError (mark with ``checkpointer.communicating()``)."""
    if not isinstance(checkpointer, Checkpointer):
        raise TypeError(
            f"interleave(model, checkpointer) needs a gemini_ckpt.Checkpointer, got {type(checkpointer).__name__}"
        )
    if isinstance(model, DistributedDataParallel):
        try:
            model.register_comm_hook(_DdpState(checkpointer, model.process_group), _marked_allreduce)
        except RuntimeError as exc:
            raise ValueError(
                f"interleave: this DDP model already has a comm hook ({exc}); mark inside it with "
                f"checkpointer.comm_marker() (enter() when it issues, exit() when it completes)"
            ) from None
        return model
    fsdp = _fsdp_modules(model)
    if fsdp:
        for module in fsdp:
            module.set_custom_all_gather(_MarkedAllGather(checkpointer))
            module.set_custom_reduce_scatter(_MarkedReduceScatter(checkpointer))
        return model
    raise TypeError(
        f"interleave: {type(model).__name__} is neither DistributedDataParallel nor FSDP2 "
        f"(fully_shard); mark its communication with `with checkpointer.communicating():`"
    )


# --- DDP ------------------------------------------------------------------------------------------
class _DdpState:
    def __init__(self, checkpointer: Checkpointer, group) -> None:
        self.checkpointer, self.group = checkpointer, group


def _marked_allreduce(state, bucket):  # unannotated: DDP checks a hook's annotations as objects
    marker = state.checkpointer.comm_marker()
    if marker is None:
        return allreduce_hook(state.group, bucket)
    marker.enter()
    try:
        fut = allreduce_hook(state.group, bucket)
    except BaseException:
        marker.exit()
        raise
    return fut.then(_exit_then(marker))


def _exit_then(marker):
    def done(fut):
        try:
            return fut.value()
        finally:
            marker.exit()

    return done


# --- FSDP2 ----------------------------------------------------------------------------------------
def _fsdp_modules(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if found and not hasattr(FSDPModule, "set_custom_all_gather"):
        raise TypeError(
            "interleave: this torch's FSDP2 has no set_custom_all_gather (torch >= 2.8 has); mark "
            "the model's communication with `with checkpointer.communicating():`"
        )
    return found


class _Marked:
    """FSDP2's comm interface (``allocate`` and ``__call__``) as its defaults do it, marked."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _run(self, issue) -> Any:
        marker = self.checkpointer.comm_marker()
        if marker is None:
            return issue()
        marker.enter()
        try:
            work = issue()
        except BaseException:
            marker.exit()
            raise
        if work is None:  # synchronous: done already
            marker.exit()
        else:
            work.get_future().then(_exit_then(marker))
        return work


class _MarkedAllGather(_Marked):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return self._run(lambda: dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op))


class _MarkedReduceScatter(_Marked):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return self._run(
            lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
        )
