"""``TrainState``: the complete training state of one rank, under stable keys.

Layout of the state dict (DCP flattens nested dicts with ``.``)::

    model.<fqn>                     tensors   (get_state_dict: FSDP2/DDP aware, reshardable)
    optim.state.<fqn>.<name>        tensors   (same)
    optim.param_groups              value
    grads.<fqn>                     tensors   (only with grads=True, params with a .grad)
    scheduler, scaler               pickled bytes, replicated across ranks
    rank_local.<rank>.rng           pickled bytes: Python, NumPy, torch CPU and CUDA RNGs
    rank_local.<rank>.dataloader    pickled bytes: the loader's state_dict()
    rank_local.<rank>.extra         pickled bytes: the user's ``extra`` values

Scheduler, scaler and rank-local values are kept as single opaque blobs because their inner
structure may change between a fresh object and one mid-iteration (a data loader's worker
snapshots), while model and optimizer tensors must stay individually addressable so DCP can
reshard them at a new world size.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .loader import fix_resume, loader_generator_state

MODEL, OPTIM, GRADS, SCHEDULER, SCALER, RANK_LOCAL = "model", "optim", "grads", "scheduler", "scaler", "rank_local"
RNG, DATALOADER, EXTRA = "rng", "dataloader", "extra"


class TrainState(Stateful):
    """Everything needed to continue training bit-identically, captured at a step boundary.

    Example::

        state = TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                           scaler=None, extra={"tokens_seen": 0})

    ``model`` may be one module or a mapping name -> module; ``optimizer`` and ``scheduler``
    one object or a sequence. ``dataloader`` is anything with ``state_dict``/``load_state_dict``
    (e.g. torchdata's ``StatefulDataLoader``). ``extra`` is a dict of picklable values, updated
    in place on restore. ``grads=True`` also captures accumulated ``.grad`` tensors so a save in
    the middle of gradient accumulation resumes exactly.
    """

    def __init__(
        self,
        *,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        dataloader: Any = None,
        scaler: Any = None,
        extra: Optional[dict] = None,
        grads: bool = False,
    ) -> None:
        if isinstance(model, Mapping):
            self._module: nn.Module = nn.ModuleDict(dict(model))
        elif isinstance(model, nn.Module):
            self._module = model
        else:
            raise TypeError(f"TrainState(model=...) needs an nn.Module or a dict of them, got {type(model).__name__}")
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = _as_list(optimizer)
        self.schedulers: list[Any] = _as_list(scheduler)
        self.dataloader = dataloader
        self.scaler = scaler
        self.extra = extra if extra is not None else {}
        if not isinstance(self.extra, dict):
            raise TypeError("TrainState(extra=...) must be a dict (it is updated in place on restore)")
        self.grads = grads
        for name, obj in (("dataloader", dataloader), ("scaler", scaler)):
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"TrainState({name}=...) needs state_dict() and load_state_dict(); got {type(obj).__name__}"
                )

    def attach(
        self,
        *,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
    ) -> "TrainState":
        """Add what did not exist when this state was built (a framework that creates its
        optimizer, scheduler and scaler inside its own ``train()``), before the first ``save``
        or ``restore`` that needs them; ``peek()`` needs none of them. Replaces what was given before.

        Example::

            state = TrainState(model=model)
            ckpt = Checkpointer(state, config)
            peeked = ckpt.peek()
            ...                                   # the framework builds its optimizer
            state.attach(optimizer=opt, scheduler=sched)
            ckpt.restore(step=peeked.step)
        """
        for name, obj in (("dataloader", dataloader), ("scaler", scaler)):
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"TrainState.attach({name}=...) needs state_dict() and load_state_dict(); got {type(obj).__name__}"
                )
        if optimizer is not None:
            self.optimizers = _as_list(optimizer)
        if scheduler is not None:
            self.schedulers = _as_list(scheduler)
        if scaler is not None:
            self.scaler = scaler
        if dataloader is not None:
            self.dataloader = dataloader
        return self

    @property
    def module(self) -> nn.Module:
        """The model as one module (a ``ModuleDict`` when several were given)."""
        return self._module

    # --- capture -----------------------------------------------------------------------------
    def tensor_state(self) -> dict[str, Any]:
        """Model, optimizer (and grads) state: live tensors, not copies."""
        if next(iter(self._module.state_dict(keep_vars=True)), None) is None:
            raise ValueError(
                f"TrainState(model=...): the model ({type(self._module).__name__}) has no parameters or persistent "
                f"buffers yet, so there is nothing to checkpoint; build (or run once, for lazy modules) the model "
                f"before save()/restore()"
            )
        model_sd, optim_sd = get_state_dict(self._module, self.optimizers)
        out: dict[str, Any] = {MODEL: model_sd}
        if self.optimizers:
            out[OPTIM] = optim_sd
        if self.grads:
            out[GRADS] = {fqn: p.grad for fqn, p in self._named_parameters() if p.grad is not None}
        return out

    def opaque_state(self, rank: int) -> dict[str, Any]:
        """Everything else, pickled now: a pickle is a snapshot that aliases nothing live."""
        out: dict[str, Any] = {}
        if self.schedulers:
            out[SCHEDULER] = _dumps([s.state_dict() for s in self.schedulers])
        if self.scaler is not None:
            out[SCALER] = _dumps(self.scaler.state_dict())
        local = {RNG: _dumps(capture_rng()), EXTRA: _dumps(self.extra)}
        if self.dataloader is not None:
            local[DATALOADER] = _dumps(
                {"state": self.dataloader.state_dict(), "generator": loader_generator_state(self.dataloader)}
            )
        out[RANK_LOCAL] = {str(rank): local}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The Stateful view (rank from torch.distributed), usable with stock ``dcp.save``."""
        return {**self.tensor_state(), **self.opaque_state(_current_rank())}

    # --- restore -----------------------------------------------------------------------------
    def load_target(
        self, *, rank: int, saved_keys: set[str], source_rank: int, saved: Optional[Mapping[str, Any]] = None
    ) -> dict[str, Any]:
        """A state dict for DCP to load into: live model/optimizer tensors, placeholders for
        the opaque blobs. ``source_rank`` is the saved rank whose rank-local state this rank
        takes (itself at the same world size). ``saved``: the version's
        ``state_dict_metadata``, from which an optimizer without state yet gets it directly
        (:meth:`_prime_optimizers`) instead of by ``get_state_dict``'s throw-away step."""
        if saved is not None:
            self._prime_optimizers(saved)
        model_sd, optim_sd = get_state_dict(self._module, self.optimizers)
        target: dict[str, Any] = {MODEL: model_sd}
        if self.optimizers:
            target[OPTIM] = optim_sd
        if self.grads:
            params = dict(self._named_parameters())
            prefix = GRADS + "."
            target[GRADS] = {
                k[len(prefix) :]: torch.zeros_like(params[k[len(prefix) :]])
                for k in saved_keys
                if k.startswith(prefix) and k[len(prefix) :] in params
            }
        if self.schedulers:
            target[SCHEDULER] = b""
        if self.scaler is not None:
            target[SCALER] = b""
        local = {RNG: b"", EXTRA: b""}
        if self.dataloader is not None:
            local[DATALOADER] = b""
        target[RANK_LOCAL] = {str(source_rank): local}
        return target

    def apply(
        self, loaded: dict[str, Any], *, source_rank: int, restore_rng: bool = True, tensors_in_place: bool = False
    ) -> None:
        """Apply a loaded state dict in the order that is correct: model and optimizer (the
        scheduler already exists, so its initial lr does not clobber the loaded one), then
        scheduler, scaler, grads, extra, data loader, and the RNG streams last so nothing
        after them draws a random number.

        ``tensors_in_place``: every model and optimizer tensor of ``loaded`` is the live one,
        already holding the loaded bytes (the direct restore); then only the optimizers'
        hyperparameters are set, instead of ``set_state_dict`` copying every tensor onto itself."""
        if not (tensors_in_place and self._set_param_groups(loaded.get(OPTIM, {}).get("param_groups"))):
            set_state_dict(
                self._module,
                self.optimizers,
                model_state_dict=loaded[MODEL],
                optim_state_dict=loaded.get(OPTIM, {}),
            )
        if self.schedulers:
            for sched, sd in zip(self.schedulers, _loads(loaded[SCHEDULER]), strict=True):
                sched.load_state_dict(sd)
        if self.scaler is not None:
            self.scaler.load_state_dict(_loads(loaded[SCALER]))
        if self.grads:
            grads = loaded.get(GRADS, {})
            for fqn, p in self._named_parameters():
                p.grad = grads[fqn] if fqn in grads else None
        local = loaded[RANK_LOCAL][str(source_rank)]
        self.extra.clear()
        self.extra.update(_loads(local[EXTRA]))
        if self.dataloader is not None:
            saved = _loads(local[DATALOADER])
            self.dataloader.load_state_dict(saved["state"])
            fix_resume(self.dataloader, saved["generator"])
        if restore_rng:
            restore_rng_state(_loads(local[RNG]))

    def _prime_optimizers(self, saved: Mapping[str, Any]) -> bool:
        """Create the state of optimizers that have none yet (a fresh process) as the saved
        version has it, empty, to be loaded into: for each parameter, a tensor shaped like the
        parameter (sharded like it) or a scalar, of the saved dtype, per saved state name.
        ``get_state_dict`` would make it by running one optimizer step with a zero learning
        rate, which costs more than the whole restore (a first step through DTensor's sharding
        propagation; docs/recovery.md). Returns False, touching nothing, when the saved state is
        not of that form (then ``get_state_dict`` does it)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not self.optimizers or any(opt.state for opt in self.optimizers):
            return False
        prefix = OPTIM + ".state."
        names: dict[str, list[str]] = {}
        for key, md in saved.items():
            if key.startswith(prefix):
                if not isinstance(md, TensorStorageMetadata):
                    return False
                fqn, _, name = key[len(prefix) :].rpartition(".")
                names.setdefault(fqn, []).append(name)
        fqn_of = {id(p): name for name, p in self._named_parameters()}
        plan: list[tuple[torch.optim.Optimizer, Any, dict, torch.device]] = []
        seen: set[str] = set()
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    fqn = fqn_of.get(id(p))
                    if fqn is None:
                        return False
                    entries = {}
                    for name in names.get(fqn, ()):
                        md = saved[prefix + fqn + "." + name]
                        if tuple(md.size) == tuple(p.shape):
                            entries[name] = ("like", md.properties.dtype)
                        elif tuple(md.size) == ():
                            entries[name] = ("scalar", md.properties.dtype)
                        else:
                            return False
                    seen.add(fqn)
                    if entries:
                        # fused/capturable optimizers keep their step counters on the parameter's device
                        on_device = bool(group.get("fused") or group.get("capturable"))
                        plan.append((opt, p, entries, p.device if on_device else torch.device("cpu")))
        if set(names) - seen:
            return False
        with torch.no_grad():
            for opt, p, entries, device in plan:
                opt.state[p] = {
                    name: torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    if kind == "like"
                    else torch.zeros((), dtype=dtype, device=device)
                    for name, (kind, dtype) in entries.items()
                }
        return True

    def _set_param_groups(self, saved: Any) -> bool:
        """Set the live param groups' hyperparameters from ``saved`` (``get_state_dict``'s
        layout: one list over every optimizer, parameters by name), as ``load_state_dict``
        would; False (nothing changed) unless the groups match one to one in parameters and keys."""
        if not self.optimizers:
            return saved is None
        live = [g for opt in self.optimizers for g in opt.param_groups]
        if not isinstance(saved, list) or len(saved) != len(live):
            return False
        fqn = {id(p): name for name, p in self._named_parameters()}
        for now, was in zip(live, saved):
            names = [fqn.get(id(p)) for p in now["params"]]
            if not isinstance(was, dict) or was.get("params") != names or set(was) != set(now):
                return False
        for now, was in zip(live, saved):
            for key, value in was.items():
                if key != "params":
                    now[key] = value
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The Stateful view: apply a state dict produced by ``state_dict()`` on this rank."""
        self.apply(state_dict, source_rank=_current_rank())

    def _named_parameters(self):
        module = self._module
        # DDP prefixes names with "module."; get_state_dict strips it, and so must we.
        inner = getattr(module, "module", None)
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) and inner is not None:
            module = inner
        return module.named_parameters()


def capture_rng() -> dict[str, Any]:
    """Every RNG stream of this process. Torch generator states are kept as bytes: a pickled
    tensor records its memory address, so the same state would pickle differently each time."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": _state_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_state_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


class RandomState:
    """The random number generators' states of this process (:func:`capture_rng`), to apply later."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def apply(self) -> None:
        restore_rng_state(self.state)


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(_state_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_state_tensor(s) for s in state["cuda"]])


def derive_rng_state(rank: int, step: int) -> dict[str, Any]:
    """Deterministic fresh RNG streams for a rank that did not exist when the version was saved."""
    seed = (step * 1_000_003 + rank * 7_919 + 0x6E6D) % (2**31)
    py = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return {
        "python": py.getstate(),
        "numpy": np.random.RandomState(seed).get_state(),
        "torch": _state_bytes(gen.get_state()),
    }


def _state_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def _state_tensor(v: Any) -> torch.Tensor:
    """A generator state as torch wants it (versions saved before 0.2 hold tensors)."""
    return v if isinstance(v, torch.Tensor) else torch.frombuffer(bytearray(v), dtype=torch.uint8)


def _as_list(obj: Any) -> list:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def extra_from(blob: bytes) -> Any:
    """The ``extra`` values of a verified ``rank_local.<rank>.extra`` item (see :mod:`gemini_ckpt.restore.peek`)."""
    return _loads(blob)


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


def _current_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
