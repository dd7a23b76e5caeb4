"""The training state a version holds: :class:`TrainState` (model, optimizer, scheduler,
scaler, data loader, RNG streams, ``extra``), with the data-loader resume fix (:mod:`.loader`)
and a fingerprint of a state for bit-identity checks (:mod:`.digest`)."""

from .train_state import TrainState

__all__ = ["TrainState"]
