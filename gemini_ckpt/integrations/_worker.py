"""The Checkpointer a framework integration builds: inside a Ray Train worker the one that reports
durable versions to Ray Train, elsewhere a plain one (never importing Ray for a job without it)."""

from __future__ import annotations

import sys

from ..checkpointer import Checkpointer
from ..config import CheckpointConfig
from ..state.train_state import TrainState


def checkpointer_here(state: TrainState, config: CheckpointConfig) -> Checkpointer:
    if "ray.train" in sys.modules:
        try:
            import ray.train

            ray.train.get_context()
        except (RuntimeError, ImportError):
            pass
        else:
            from .ray_train import checkpointer

            return checkpointer(state, config)
    return Checkpointer(state, config)
