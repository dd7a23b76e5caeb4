"""Toy-LM jobs that save to, and restore from, the local memory tier and a durable directory:
what the tests that damage such a directory share (durable_hostile_support.py, trust_support.py)
and health_support.py. A family of tests (a :class:`ToyJobs`) has one namespace (a signed version
is bound to it), and each of its jobs starts with empty memory, as a restarted job does.

Also the deadline guard :func:`within` (fails a test instead of hanging it), the parameters of a
model (:func:`params_of`) and a copy of a ``versions`` fixture's directory (:func:`copy_versions`).
"""

from __future__ import annotations

import shutil
import threading
import uuid
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.stores.memory import drop_local_store
from gemini_ckpt.toy import build_training, lm_loss


def within(seconds, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread; fails the test (instead of hanging it) past ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=f"hostile-{getattr(fn, '__name__', 'op')}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds:.0f}s (it hangs)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def params_of(model) -> dict:
    """A copy of ``model``'s parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def copy_versions(versions, tmp_path) -> Path:
    """A copy, under ``tmp_path``, of the durable directory of a ``versions`` fixture (to damage)."""
    dst = tmp_path / f"d{uuid.uuid4().hex[:8]}"
    shutil.copytree(versions[0], dst)
    return dst


class ToyJobs:
    """The jobs of one family of tests, in a namespace of their own (``prefix`` and a random
    tail). ``dataloader``: whether their state includes the data loader; ``deadline_s``: a
    :meth:`assert_restored` past it fails the test; ``restore_config``: what every
    :meth:`restore` adds to its config (a call's own settings win)."""

    def __init__(
        self, prefix: str, *, dataloader: bool = False, deadline_s: Optional[float] = None, **restore_config
    ) -> None:
        self.namespace = prefix + uuid.uuid4().hex
        self.dataloader, self.deadline_s, self.restore_config = dataloader, deadline_s, restore_config

    def fresh_namespace(self) -> str:
        """The namespace, its memory dropped: the next job starts as a restarted one does."""
        drop_local_store(self.namespace)
        return self.namespace

    def checkpointer(self, state: TrainState, root, **config) -> Checkpointer:
        """A job of this family (memory dropped, as at a restart) over ``state``, its durable tier at ``root``."""
        return Checkpointer(
            state, CheckpointConfig(store="local", namespace=self.fresh_namespace(), durable_uri=str(root), **config)
        )

    def state(self, seed: int):
        """A toy LM built from ``seed``: (its training setup, the ``extra`` dict, its TrainState)."""
        t = build_training(seed=seed, dataset_size=32)
        extra: dict = {}
        loader = {"dataloader": t.loader} if self.dataloader else {}
        return t, extra, TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, extra=extra, **loader)

    def make_versions(self, root: Path, **config):
        """A job trains and saves steps 0 and 1, each persisted to ``root``: (root, {step: its parameters})."""
        t, extra, state = self.state(0)
        ckpt = self.checkpointer(state, root, persist_every=1, keep_durable=5, **config)
        batches, params = t.batches(), {}
        for step in range(2):
            lm_loss(t.model, next(batches)).backward()
            t.optimizer.step()
            t.scheduler.step()
            t.optimizer.zero_grad()
            extra["tokens"] = step + 1
            ckpt.save(step)
            params[step] = params_of(t.model)
        ckpt.close()
        return root, params

    def restore(self, root, **config):
        """A new job (empty memory) restores from ``root``: (result, extra, params)."""
        t, extra, state = self.state(9)
        ckpt = self.checkpointer(state, root, **{**self.restore_config, **config})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = ckpt.restore()
        finally:
            ckpt.close()
        return result, extra, params_of(t.model)

    def assert_restored(self, root, versions, step, skipped=None, **config):
        """A new job restores ``step`` of ``versions`` from ``root``, having skipped exactly the
        steps ``skipped`` (unchecked when None); the restore's result."""
        if self.deadline_s is None:
            result, extra, params = self.restore(root, **config)
        else:
            result, extra, params = within(self.deadline_s, self.restore, root, **config)
        assert result is not None and result.step == step, result
        if skipped is not None:
            assert tuple(result.skipped_steps) == tuple(skipped), result.skipped_steps
        assert extra == {"tokens": step + 1}
        for name, value in versions[1][step].items():
            assert torch.equal(params[name], value), name
        return result
