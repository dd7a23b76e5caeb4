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
"""

from ._config import CheckpointConfig
from ._errors import (
    BackgroundError,
    CheckpointError,
    CheckpointTimeoutError,
    ChecksumError,
    ConfigError,
    FencedError,
    MemoryBudgetError,
    StructureMismatchError,
    VersionNotFoundError,
)
from ._handle import RestoreResult, SaveHandle
from ._status import cluster_status
from ._state import TrainState

__version__ = "0.1.0"

from ._checkpointer import Checkpointer, CheckpointStats  # noqa: E402  (needs __version__)

__all__ = [
    "BackgroundError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointStats",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ChecksumError",
    "ConfigError",
    "FencedError",
    "MemoryBudgetError",
    "RestoreResult",
    "SaveHandle",
    "StructureMismatchError",
    "TrainState",
    "cluster_status",
    "VersionNotFoundError",
]
