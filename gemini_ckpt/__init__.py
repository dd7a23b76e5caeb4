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
(``gemini_ckpt.dataplane``, standard library only), start in about a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_EXPORTS = {
    "BackgroundError": ".errors",
    "CheckpointConfig": ".config",
    "CheckpointError": ".errors",
    "CheckpointEvent": ".events",
    "CheckpointListener": ".events",
    "CheckpointStats": ".results",
    "CheckpointTimeoutError": ".errors",
    "Checkpointer": ".checkpointer",
    "ChecksumError": ".errors",
    "ConfigError": ".errors",
    "DamagedFileError": ".errors",
    "FencedError": ".errors",
    "HealthCheck": ".health",
    "MemoryBudgetError": ".errors",
    "RecoveryGaveUpError": ".errors",
    "ReplicationError": ".errors",
    "RestoreResult": ".results",
    "SaveHandle": ".results",
    "StructureMismatchError": ".errors",
    "TrainState": ".state",
    "UnhealthyVersionError": ".errors",
    "VersionNotFoundError": ".errors",
    "cluster_status": ".cli.status",
    "interleave": ".integrations.interleave",
    "register_durable_backend": ".durable.backends",
}
_MODULES = {"ray_train": ".integrations.ray_train"}  # ``from gemini_ckpt import ray_train as gray``

__all__ = [  # a literal, so that tools see what the lazy names are
    "BackgroundError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointEvent",
    "CheckpointListener",
    "CheckpointStats",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ChecksumError",
    "ConfigError",
    "DamagedFileError",
    "FencedError",
    "HealthCheck",
    "MemoryBudgetError",
    "RecoveryGaveUpError",
    "ReplicationError",
    "RestoreResult",
    "SaveHandle",
    "StructureMismatchError",
    "TrainState",
    "UnhealthyVersionError",
    "VersionNotFoundError",
    "cluster_status",
    "interleave",
    "ray_train",
    "register_durable_backend",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gemini_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .checkpointer import Checkpointer
    from .events import CheckpointEvent, CheckpointListener
    from .durable.backends import register_durable_backend
    from .cli.status import cluster_status
    from .config import CheckpointConfig
    from .errors import (
        BackgroundError,
        CheckpointError,
        CheckpointTimeoutError,
        ChecksumError,
        ConfigError,
        DamagedFileError,
        FencedError,
        MemoryBudgetError,
        ReplicationError,
        StructureMismatchError,
        UnhealthyVersionError,
        VersionNotFoundError,
    )
    from .health import HealthCheck
    from .integrations import ray_train
    from .integrations.interleave import interleave
    from .results import CheckpointStats, RestoreResult, SaveHandle
    from .state import TrainState
