"""Shared by the ``test_trust_*`` files: verify before interpret, and any damaged version falls
back (issue 13).

The module's namespace, the pickle that runs code when loaded with arbitrary globals
(:class:`_Evil`), the jobs that save and restore, and the fixture ``versions`` (a test file
takes it with ``from trust_support import versions as versions``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.stores.memory import drop_local_store
from gemini_ckpt.toy import build_training, lm_loss

NAMESPACE = "trust-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """This module's jobs share one namespace (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


MARKER, METADATA, EXTRA_KEY = ".gemini_complete", ".metadata", "rank_local.0.extra"
NEWEST, OLDER = "step_000000001", "step_000000000"


class _Evil:
    """A pickle that, when loaded with arbitrary globals, creates ``path``."""

    def __init__(self, path, how="system"):
        self.path, self.how = str(path), how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.path}",))
        return (eval, (f"open({self.path!r}, 'w').close()",))


def _evil_pickle(path, how="system") -> bytes:
    return pickle.dumps(_Evil(path, how))


def _state(seed):
    t = build_training(seed=seed, dataset_size=32)
    extra = {}
    return (
        t,
        extra,
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=t.loader, extra=extra),
    )


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A durable directory with two good versions (steps 0 and 1) and the model at each."""
    root = tmp_path_factory.mktemp("versions") / "d"
    t, extra, state = _state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local", namespace=_job_namespace(), persist_every=1, durable_uri=str(root), keep_durable=5
        ),
    )
    batches, params = t.batches(), {}
    for step in range(2):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()
        extra["tokens"] = step + 1
        ckpt.save(step)
        params[step] = _params(t.model)
    ckpt.close()
    return root, params


def _copy(versions, tmp_path) -> Path:
    dst = tmp_path / f"d{uuid.uuid4().hex[:8]}"
    shutil.copytree(versions[0], dst)
    return dst


def _restore(root, **config):
    """A new job (empty memory) restores from ``root``: (result, extra, params)."""
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=_job_namespace(), durable_uri=str(root), **config)
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = ckpt.restore()
    finally:
        ckpt.close()
    return result, extra, _params(t.model)


def _assert_restored(root, versions, step, skipped=(), **config):
    result, extra, params = _restore(root, **config)
    assert result is not None and result.step == step, result
    assert tuple(result.skipped_steps) == tuple(skipped), result.skipped_steps
    assert extra == {"tokens": step + 1}
    for name, value in versions[1][step].items():
        assert torch.equal(params[name], value), name


# --- forging: what a writer of the storage directory can do without the key -------------------
def _torch_saved(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
