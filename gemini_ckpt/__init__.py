"""gemini_ckpt: in-memory, peer-replicated checkpointing for distributed PyTorch on Ray.

Example::

    from gemini_ckpt import Checkpointer, CheckpointConfig, TrainState

    state = TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    ckpt = Checkpointer(state, CheckpointConfig(store="local", keep_in_memory=2))
    result = ckpt.restore()
    for step in range(result.step + 1 if result else 0, total_steps):
        ...
        ckpt.save(step)
    ckpt.close()

The public names are loaded on first use (PEP 562): importing the package itself imports
neither torch nor Ray, so the host-store actors, which import only the data-plane transport
(``gemini_ckpt.ray.transport``, standard library only), start in about a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "BackgroundError": "._errors",
    "CheckpointConfig": "._config",
    "CheckpointError": "._errors",
    "CheckpointStats": "._checkpointer",
    "CheckpointTimeoutError": "._errors",
    "Checkpointer": "._checkpointer",
    "ChecksumError": "._errors",
    "ConfigError": "._errors",
    "FencedError": "._errors",
    "MemoryBudgetError": "._errors",
    "RestoreResult": "._handle",
    "SaveHandle": "._handle",
    "StructureMismatchError": "._errors",
    "TrainState": "._state",
    "VersionNotFoundError": "._errors",
    "cluster_status": "._status",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gemini_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ._checkpointer import Checkpointer, CheckpointStats
    from ._config import CheckpointConfig
    from ._errors import (BackgroundError, CheckpointError, CheckpointTimeoutError, ChecksumError,
                          ConfigError, FencedError, MemoryBudgetError, StructureMismatchError,
                          VersionNotFoundError)
    from ._handle import RestoreResult, SaveHandle
    from ._state import TrainState
    from ._status import cluster_status
