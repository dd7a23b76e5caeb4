"""A hostile ``init_from`` directory: it is never read outside, a FIFO in it is refused
instead of waited for, a model-only checkpoint loads the model, a damaged one raises our error.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from gemini_ckpt import CheckpointConfig, CheckpointError, Checkpointer
from gemini_ckpt.toy import build_training, lm_loss
from durable_hostile_support import DATA, DEADLINE_S, JOBS, METADATA
from toy_jobs import params_of, within

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from durable_hostile_support import fifos as fifos


# === 5. init_from ==================================================================================
def _stock_checkpoint(path: Path, *, seed: int, with_optim: bool, fill=None):
    t = build_training(seed=seed, dataset_size=32)
    if fill is not None:
        with torch.no_grad():
            for p in t.model.parameters():
                p.fill_(fill)
    if with_optim:
        lm_loss(t.model, next(t.batches())).backward()
        t.optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(t.model, t.optimizer)
    dcp.save({"model": msd, "optim": osd} if with_optim else {"model": msd}, checkpoint_id=str(path))
    return params_of(t.model)


def _init(path, **config):
    t, _, state = JOBS.state(11)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(store="local", namespace=JOBS.fresh_namespace(), init_from=str(path), timeout_s=30, **config),
    )
    try:
        return ckpt.restore(), t
    finally:
        ckpt.close()


def test_init_from_never_reads_outside_its_directory(tmp_path):
    stock, secret = tmp_path / "stock", tmp_path / "secret"
    _stock_checkpoint(stock, seed=1, with_optim=False)
    _stock_checkpoint(secret, seed=2, with_optim=False, fill=7.0)
    md = pickle.loads((stock / METADATA).read_bytes())  # the test's own file
    md.storage_data = {
        i: _StorageInfo(f"../secret/{s.relative_path}", s.offset, s.length) for i, s in md.storage_data.items()
    }
    (stock / METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside") as info:
        within(DEADLINE_S, _init, stock)
    assert "../secret/" in str(info.value)


@pytest.mark.parametrize("name", [DATA, METADATA])
def test_init_from_refuses_a_fifo_instead_of_hanging(tmp_path, fifos, name):
    stock = tmp_path / "stock"
    _stock_checkpoint(stock, seed=1, with_optim=False)
    (stock / name).unlink()
    os.mkfifo(stock / name)
    fifos.append(stock / name)
    with pytest.raises(CheckpointError, match="regular file"):
        within(DEADLINE_S, _init, stock)


def test_init_from_a_model_only_checkpoint_loads_the_model_and_leaves_the_optimizer(tmp_path, caplog):
    stock = tmp_path / "stock"
    saved = _stock_checkpoint(stock, seed=1, with_optim=False)
    with caplog.at_level(logging.INFO, logger="gemini_ckpt"):
        result, t = within(DEADLINE_S, _init, stock)
    assert result is not None and result.source == "init"
    for name, value in saved.items():
        assert torch.equal(params_of(t.model)[name], value), name
    assert t.optimizer.state_dict()["state"] == {}
    assert "holds no optimizer state" in caplog.text


def test_init_from_a_damaged_checkpoint_raises_our_error_not_a_base_exception(tmp_path):
    stock = tmp_path / "stock"
    _stock_checkpoint(stock, seed=1, with_optim=True)
    data = stock / DATA
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    try:
        within(DEADLINE_S, _init, stock)
    except CheckpointError as exc:
        assert "init_from" in str(exc)
    except BaseException as exc:  # noqa: BLE001 - exactly what must not escape
        pytest.fail(f"init_from raised {type(exc).__module__}.{type(exc).__name__}, not a CheckpointError")
    else:
        pytest.fail("a damaged init_from checkpoint loaded")
