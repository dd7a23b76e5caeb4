"""Shared by the ``test_health_*`` files (validated versions, issue 21): the module's namespace
(a signed version is bound to it), the config every test starts from, the toy LM and its
Checkpointer, one training step, and a save waited on until it is committed.
"""

from __future__ import annotations

import uuid

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.stores.memory import drop_local_store

NAMESPACE = "health-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """One namespace for this module's jobs (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


def _config(**kw) -> CheckpointConfig:
    kw.setdefault("namespace", _job_namespace())
    kw.setdefault("timeout_s", 60)
    return CheckpointConfig(store="local", **kw)


def _lm(config: CheckpointConfig, seed: int = 0):
    t = build_training(seed=seed, dataset_size=32)
    state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
    return t, Checkpointer(state, config)


def _step(t, batches) -> None:
    lm_loss(t.model, next(batches)).backward()
    t.optimizer.step()
    t.optimizer.zero_grad()


def _saved(ckpt, step, **kw):
    """Save ``step`` and wait until it is committed; its handle."""
    handle = ckpt.save(step, **kw)
    handle.committed.result(timeout=60)
    return handle
