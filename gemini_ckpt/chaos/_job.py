"""The training function the harness drives, and what it compares.

A job is any class with two methods (see :class:`TrainJob`); the harness builds one in every
rank process after it has set up ``torch.distributed`` (gloo), wraps the returned
:class:`~gemini_ckpt.TrainState` in a ``Checkpointer`` and calls ``step`` once per step.

What is compared between a faulty run and the uninterrupted reference:

- the loss each rank returns for each step (exactly, as floats);
- a *global* digest of model and optimizer state: SHA-256 over every tensor in full (a
  DTensor is gathered with ``full_tensor()``) in key order, so it does not depend on the
  world size or the sharding, and equal digests mean bit-identical state;
- each rank's ``extra`` values (rank-local state).
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..state.digest import digest  # noqa: F401  (part of this module's interface)

if TYPE_CHECKING:  # keep importing the facade cheap: torch is imported inside the rank processes
    from .. import TrainState


@runtime_checkable
class TrainJob(Protocol):
    """A deterministic training function the harness can crash and resume.

    ``build(rank, world_size, seed)`` is called in each rank process once ``torch.distributed``
    is initialized (gloo, ``world_size`` ranks); it builds the model (shard it with
    ``fully_shard`` over ``init_device_mesh("cpu", (world_size,))``, or wrap it in DDP),
    optimizer, scheduler, data loader, and returns the :class:`~gemini_ckpt.TrainState` holding
    them. ``step(step)`` runs one optimizer step and returns this rank's loss as a float.

    Determinism is the contract: the batch of a step must be a function of ``(seed, step,
    rank)`` or come from state the ``TrainState`` captures (a ``StatefulDataLoader``, the RNG
    streams), so that a run resumed from step ``s`` repeats the uninterrupted run's losses
    bit for bit. The instance is pickled into every rank process (Ray's cloudpickle), so keep
    the constructor cheap and the class importable, or define it in your ``__main__`` script.

    Example::

        class MyJob:
            def build(self, rank, world_size, seed):
                torch.manual_seed(seed)
                self.rank, self.seed = rank, seed
                self.model = DistributedDataParallel(nn.Linear(8, 8))
                self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
                return TrainState(model=self.model, optimizer=self.opt)

            def step(self, step):
                g = torch.Generator().manual_seed(self.seed * 1000 + step * 10 + self.rank)
                loss = self.model(torch.randn(4, 8, generator=g)).pow(2).mean()
                loss.backward(); self.opt.step(); self.opt.zero_grad()
                return loss.item()
    """

    def build(self, rank: int, world_size: int, seed: int) -> "TrainState": ...

    def step(self, step: int) -> float: ...


class TinyJob:
    """The default job: a small MLP sharded with FSDP2 over every rank, AdamW, and a rank-local
    counter in ``extra``. Each rank's batch is drawn from ``(seed, step, rank)``."""

    def __init__(self, width: int = 64) -> None:
        self.width = width

    def build(self, rank: int, world_size: int, seed: int) -> "TrainState":
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from .. import TrainState
        from ..toy import fully_shard_layers, mlp

        self.rank, self.seed = rank, seed
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(seed)
        model = fully_shard_layers(mlp(self.width), mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.extra = {"seen": 0}
        return TrainState(model=model, optimizer=self.opt, extra=self.extra)

    def step(self, step: int) -> float:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + self.rank)
        x = torch.randn(8, 32, generator=g)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.extra["seen"] += x.shape[0]
        return float(loss.item())


# --- full state: capture, digest, load ---------------------------------------------------------------
def full_tensor_state(state: "TrainState") -> dict[str, Any]:
    """Model and optimizer state with every DTensor gathered in full, on the CPU, in key
    order. Collective: every rank must call it at the same point."""
    import torch
    from torch.distributed.tensor import DTensor

    def walk(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return obj.full_tensor().detach().cpu().clone()
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu().clone()
        if isinstance(obj, dict):
            return {k: walk(obj[k]) for k in sorted(obj, key=str)}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(state.tensor_state())


def load_full_state(
    state: "TrainState", full: dict[str, Any], opaque: dict[str, Any], *, rank: int, source_rank: int, step: int
) -> None:
    """Load a state captured with :func:`full_tensor_state` (plus ``TrainState.opaque_state``
    of saved rank ``source_rank``) into a job of any world size, without gemini_ckpt's restore
    path: the independent reference a resized job is compared with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ..state.loader import fix_resume
    from ..state.train_state import (
        DATALOADER,
        EXTRA,
        RANK_LOCAL,
        RNG,
        SCALER,
        SCHEDULER,
        derive_rng_state,
        restore_rng_state,
    )

    set_state_dict(
        state.module,
        state.optimizers,
        model_state_dict=full["model"],
        optim_state_dict=full.get("optim", {}),
        options=StateDictOptions(full_state_dict=True),
    )
    if state.schedulers:
        for sched, sd in zip(state.schedulers, pickle.loads(opaque[SCHEDULER]), strict=True):
            sched.load_state_dict(sd)
    if state.scaler is not None:
        state.scaler.load_state_dict(pickle.loads(opaque[SCALER]))
    local = opaque[RANK_LOCAL][str(source_rank)]
    state.extra.clear()
    state.extra.update(pickle.loads(local[EXTRA]))
    if state.dataloader is not None:
        saved = pickle.loads(local[DATALOADER])
        state.dataloader.load_state_dict(saved["state"])
        fix_resume(state.dataloader, saved["generator"])
    # The documented world-size rule: a rank that did not exist gets streams derived from (step, rank).
    restore_rng_state(pickle.loads(local[RNG]) if source_rank == rank else derive_rng_state(rank, step))
