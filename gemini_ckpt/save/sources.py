"""Which live tensors and values fill each item of the plan, found cheaply every version.

Building the state dict (``get_state_dict`` for FSDP/DDP-aware keys) costs more than the whole
per-version budget, even for a small model (docs/dataplane.md). So the sources
of the plan's items are resolved once, from a full state dict, and reused while a cheap
**fingerprint** of the live objects is unchanged: the storage address and shape of every
parameter, buffer and optimizer-state tensor, and the layout of every optimizer's
``param_groups``. An optimizer that creates state lazily, a ``param.data = ...``, a reloaded
optimizer: each changes the fingerprint, and the state dict is built again (and the plan
made again if its :func:`~gemini_ckpt.save.plan.signature` changed).

The fast path is used only where it is provably the same as building the state dict: every
tensor the state dict returned shares storage with a fingerprinted tensor (no state-dict hook
made a fresh tensor), and every non-tensor item is either an optimizer ``param_groups`` value
(read from the live group each version) or one of TrainState's opaque blobs (captured each
version). Anything else builds the state dict every version: slower, never wrong. The cached
sources keep their tensors alive, so a freed storage can never come back at the same address.
"""

from __future__ import annotations

import logging
import pickle
import re
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.utils import find_state_dict_object

from ..state.dcp import flatten, live_storages, local_tensor
from ..state.train_state import GRADS, TrainState
from ..trust.items import is_opaque_key
from .plan import SnapshotPlan

log = logging.getLogger("gemini_ckpt")

_PARAM_GROUP = re.compile(r"optim\.param_groups\.(\d+)\.(.+)")


def fingerprint(state: TrainState, modules: Optional[list] = None) -> tuple:
    """Storage address and shape of every parameter, buffer and optimizer-state tensor, and
    the shape of every optimizer's param_groups and module tree: cheap enough for every version.
    ``modules``: the module tree as last seen (``module.modules()``), to skip walking it."""
    out: list = []
    for m in modules if modules is not None else state.module.modules():
        out.append(len(m._modules))  # a submodule added or removed changes the tree
        for t in m._parameters.values():
            if t is not None:
                local = local_tensor(t)
                out.append((local.data_ptr(), local.shape))
        for t in m._buffers.values():
            if t is not None:
                local = local_tensor(t)
                out.append((local.data_ptr(), local.shape))
    for opt in state.optimizers:
        out.append(len(opt.param_groups))
        for group in opt.param_groups:
            out.append((tuple(group), tuple(map(id, group["params"]))))
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        local = local_tensor(v)
                        out.append((k, local.data_ptr(), local.shape))
                    else:
                        out.append(k)
    return tuple(out)


class Sources:
    """The live tensors and value blobs of one plan's items (see the module docstring)."""

    def __init__(self, state: TrainState, rank: int) -> None:
        self.state, self.rank = state, rank
        self.plan: Optional[SnapshotPlan] = None
        self._tensors: list[torch.Tensor] = []
        self._grads: list[tuple[int, str, Any]] = []  # (item, parameter name, index) refreshed every version
        self._values: list[Callable[[dict], bytes]] = []
        self._fingerprint: Optional[tuple] = None
        self._modules: list = []
        self.fast = False
        self.rebuilt = 0  # full state dicts built (first version included)
        self.generation = 0  # bumped whenever the cached sources change (stagers cache by it)
        self.volatile: tuple[int, ...] = ()  # tensor items read afresh every version (grads)

    def live_state(self) -> dict:
        return {**self.state.tensor_state(), **self.state.opaque_state(self.rank)}

    def capture(self) -> Optional[tuple[list[torch.Tensor], list[bytes]]]:
        """This version's ``(tensors, blobs)`` for the plan's items, or None when the state no
        longer fits the plan (build it again: :meth:`bind` after planning)."""
        if self.plan is None:
            return None
        if self.fast and fingerprint(self.state, self._modules) == self._fingerprint:
            opaque = self.state.opaque_state(self.rank)
            tensors = self._with_grads(self._tensors)
            if tensors is None:
                return self._slow()
            return tensors, [get(opaque) for get in self._values]
        return self._slow()

    def _slow(self) -> Optional[tuple[list[torch.Tensor], list[bytes]]]:
        flat = flatten(self.live_state())
        self.rebuilt += 1
        from .plan import signature

        if signature(flat) != self.plan.signature:
            return None
        self._resolve(flat)
        return self._capture_from(flat)

    def bind(self, plan: SnapshotPlan, flat: dict[str, Any]) -> tuple[list[torch.Tensor], list[bytes]]:
        """Use ``plan`` from now on; ``flat`` is the state it was made from (this version's)."""
        self.plan = plan
        self.rebuilt += 1
        self._resolve(flat)
        return self._capture_from(flat)

    def _capture_from(self, flat: dict[str, Any]) -> tuple[list[torch.Tensor], list[bytes]]:
        tensors = [find_state_dict_object(flat, index) for index in self.plan.tensor_index]
        blobs = [
            _blob(find_state_dict_object(flat, index), item.kind)
            for index, item in zip(self.plan.value_index, self.plan.shard.values)
        ]
        return tensors, blobs

    def _resolve(self, flat: dict[str, Any]) -> None:
        """Cache each item's source and decide whether the fast path is exact."""
        plan = self.plan
        self._tensors = [find_state_dict_object(flat, index) for index in plan.tensor_index]
        self._grads = [
            (i, index.fqn[len(GRADS) + 1 :], index)
            for i, index in enumerate(plan.tensor_index)
            if index.fqn.startswith(GRADS + ".")
        ]
        self.volatile = tuple(i for i, _, _ in self._grads)
        self.generation += 1
        self._modules = list(self.state.module.modules())
        self._fingerprint = fingerprint(self.state, self._modules)
        why = self._why_not_fast(flat)
        if why and self.fast is not False:
            log.info("rank %d: building the state dict every version (%s)", self.rank, why)
        self.fast = why is None

    def _why_not_fast(self, flat: dict[str, Any]) -> Optional[str]:
        storages = live_storages(self.state)
        grads = {i for i, _, _ in self._grads}
        for i, t in enumerate(self._tensors):
            if i not in grads and local_tensor(t).untyped_storage().data_ptr() not in storages:
                return f"{self.plan.tensor_index[i].fqn} is not a parameter, buffer or optimizer state"
        getters = []
        for index, item in zip(self.plan.value_index, self.plan.shard.values):
            getter = self._value_getter(index.fqn, item.kind, flat)
            if getter is None:
                return f"{index.fqn} is a value gemini_ckpt cannot read without the state dict"
            if getter is not _OPAQUE and getter({}) != _blob(flat[index.fqn], item.kind):
                return f"{index.fqn} does not read back as the state dict has it"
            getters.append(getter)
        self._values = [
            (lambda opaque, fqn=index.fqn: _opaque_blob(opaque, fqn)) if g is _OPAQUE else g
            for g, index in zip(getters, self.plan.value_index)
        ]
        return None

    def _value_getter(self, fqn: str, kind: str, flat: dict[str, Any]):
        if is_opaque_key(fqn):
            return _OPAQUE
        m = _PARAM_GROUP.fullmatch(fqn)
        if m is None or kind != "pickle":
            return None
        groups = [g for opt in self.state.optimizers for g in opt.param_groups]
        g, key = int(m.group(1)), m.group(2)
        if g >= len(groups) or key not in groups[g]:
            return None
        if key == "params":  # parameter names: fixed while the fingerprint (which covers the groups) is
            fixed = _blob(flat[fqn], "pickle")
            return lambda opaque: fixed
        state = self.state  # not self: a getter kept in self._values must not make a cycle
        # (it would keep the user's model, optimizer and loader alive after close, until a full
        # garbage collection, and a loader's worker processes are then shut down from whichever
        # thread collects: 5 s per worker where they are slow to join)
        return lambda opaque, g=g, key=key: _blob(
            [gr for opt in state.optimizers for gr in opt.param_groups][g][key], "pickle"
        )

    def _with_grads(self, tensors: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        if not self._grads:
            return tensors
        params = dict(self.state._named_parameters())
        out = list(tensors)
        for i, name, index in self._grads:
            p = params.get(name)
            grad = p.grad if p is not None else None
            if grad is None:
                return None
            try:
                local = find_state_dict_object({index.fqn: grad}, index)
            except ValueError:
                return None
            if local.shape != tensors[i].shape or local.dtype != tensors[i].dtype:
                return None
            out[i] = local
        return out


_OPAQUE = object()


def _opaque_blob(opaque: dict, fqn: str) -> bytes:
    node: Any = opaque
    for part in fqn.split("."):
        node = node[part]
    return node


def _blob(value: Any, kind: str) -> bytes:
    if kind == "bytes":
        if not isinstance(value, bytes):
            raise TypeError(f"expected bytes, got {type(value).__name__}")
        return value
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
