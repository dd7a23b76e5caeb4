"""Shared by the ``test_health_*`` files (validated versions): the module's namespace
(a signed version is bound to it), the config every test starts from, the toy LM and its
Checkpointer, one training step, and a save waited on until it is committed.
"""

from __future__ import annotations

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss
from toy_jobs import ToyJobs

JOBS = ToyJobs("health-")  # this module's jobs (their namespace; each starts with empty memory)


def job_config(**kw) -> CheckpointConfig:
    """A local-store config in this module's namespace (its memory dropped), ``kw`` on top."""
    kw.setdefault("namespace", JOBS.fresh_namespace())
    kw.setdefault("timeout_s", 60)
    return CheckpointConfig(store="local", **kw)


def toy_lm(config: CheckpointConfig, seed: int = 0):
    """The toy LM's training setup from ``seed`` and a Checkpointer of it with ``config``."""
    t = build_training(seed=seed, dataset_size=32)
    state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
    return t, Checkpointer(state, config)


def train_step(t, batches) -> None:
    """One optimizer step of ``t`` on the next of ``batches``."""
    lm_loss(t.model, next(batches)).backward()
    t.optimizer.step()
    t.optimizer.zero_grad()


def save_committed(ckpt, step, **kw):
    """Save ``step`` and wait until it is committed; its handle."""
    handle = ckpt.save(step, **kw)
    handle.committed.result(timeout=60)
    return handle
