"""A version's life around the edges: steps only go forward, one Checkpointer per namespace,
never deleting what we did not write, a persist thread that survives, and the small inputs
that used to fail obscurely."""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from gemini_ckpt.chaos import faulty_filesystem
from helpers import corrupt_durable_item, corrupt_item
from gemini_ckpt import (
    BackgroundError,
    CheckpointConfig,
    CheckpointError,
    Checkpointer,
    ConfigError,
    TrainState,
)
from gemini_ckpt import faults as _faults
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.durable.layout import IN_PROGRESS_FILE
from gemini_ckpt.toy import build_training, lm_loss


def _config(**kw) -> CheckpointConfig:
    kw.setdefault("namespace", uuid.uuid4().hex)
    kw.setdefault("timeout_s", 30)
    return CheckpointConfig(store="local", **kw)


def _train(ckpt, t, steps, batches=None):
    batches = batches or t.batches()
    for step in steps:
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        ckpt.save(step)
    ckpt.wait()


def _checkpointer(config, seed=0, **kw):
    t = build_training(seed=seed, dataset_size=32)
    return Checkpointer(TrainState(model=t.model, optimizer=t.optimizer), config, **kw), t


# --- steps only go forward ----------------------------------------------------------------------
def test_a_step_at_or_before_one_already_saved_is_refused():
    ckpt, t = _checkpointer(_config(keep_in_memory=1))
    _train(ckpt, t, [5])
    with pytest.raises(ValueError, match=r"save\(3\): this run already saved step 5; steps only go forward"):
        ckpt.save(3)
    with pytest.raises(ValueError, match="already saved step 5"):
        ckpt.save(5)
    assert ckpt.store.committed_steps() == [5]
    ckpt.close()


def test_a_run_that_did_not_restore_may_not_write_over_an_earlier_runs_newer_versions(tmp_path):
    uri = str(tmp_path / "d")
    first, t = _checkpointer(_config(persist_every=4, durable_uri=uri, persist_on_close=False))
    _train(first, t, range(8))
    first.close()
    assert first.durable.complete_steps() == [3, 7]

    # A new run (another namespace, the same durable directory) starting at step 0.
    fresh, t2 = _checkpointer(_config(persist_every=4, durable_uri=uri))
    with pytest.raises(
        CheckpointError, match=r"already hold\(s\) step\(s\) \[3, 7\].*restore\(\) first.*overwrite=True"
    ):
        fresh.save(0)
    fresh.close()
    assert DurableTier(uri).complete_steps() == [3, 7]  # nothing was touched

    forced, t3 = _checkpointer(_config(persist_every=4, durable_uri=uri, overwrite=True, persist_on_close=False))
    _train(forced, t3, range(4))
    forced.close()
    assert forced.durable.complete_steps() == [3]
    assert forced.durable.latest() == 3
    again, t4 = _checkpointer(_config(durable_uri=uri))
    result = again.restore()
    assert result.step == 3 and result.source == "durable"  # the new run's step 3, not the old 7
    for k, v in t3.model.state_dict().items():
        assert torch.equal(v, t4.model.state_dict()[k]), k
    again.close()


def test_versions_newer_than_the_restored_one_are_discarded_before_the_next_save(tmp_path):
    uri = str(tmp_path / "d")
    config = _config(keep_in_memory=8, persist_every=4, durable_uri=uri, persist_on_close=False)
    first, t = _checkpointer(config)
    _train(first, t, range(8))
    first.close()
    # Steps 6 and 7 cannot be read any more (memory), nor can durable step 7.
    store = first.store
    for step in (6, 7):
        fqn = corrupt_item(store, step)
    corrupt_durable_item(uri, 7, fqn)

    second, t2 = _checkpointer(config)
    with pytest.warns(UserWarning, match="could not be restored and was skipped"):
        result = second.restore()
    assert result.step == 5 and result.skipped_steps == (7, 6)
    with pytest.raises(ValueError, match="step 5 was restored; the next save must be a later step"):
        second.save(5)
    _train(second, t2, [6])
    assert second.store.committed_steps() == [0, 1, 2, 3, 4, 5, 6]  # the abandoned 7 is gone
    assert second.durable.complete_steps() == [3]
    assert second.durable.latest() == 3
    second.close()


# --- a namespace belongs to one Checkpointer at a time ------------------------------------------
def test_a_newer_checkpointer_on_the_same_namespace_fences_the_older_one():
    config = _config()
    older, t = _checkpointer(config)
    _train(older, t, [0])
    newer, t2 = _checkpointer(config, seed=1)
    assert newer.restore().step == 0  # the newer one takes the namespace over
    older.save(1)
    with pytest.raises(
        BackgroundError,
        match=r"FencedError: a newer Checkpointer opened namespace .* their own "
        r"CheckpointConfig.namespace",
    ):
        older.wait()
    _train(newer, t2, [1])
    assert newer.store.committed_steps() == [0, 1]
    newer.close()
    older.abort()


def test_store_ray_outside_ray_train_needs_a_namespace():
    from gemini_ckpt.hoststore.client import connect as connect_ray_store
    from gemini_ckpt.settings import store_settings

    with pytest.raises(ConfigError, match=r"CheckpointConfig.namespace is required with store='ray'.*namespace='lm-7'"):
        connect_ray_store(store_settings(CheckpointConfig(store="ray")), rank=0, world_size=1)


# --- never delete what we did not write ---------------------------------------------------------
def test_a_stock_dcp_checkpoint_in_the_durable_tier_is_never_deleted(tmp_path, caplog):
    uri = tmp_path / "d"
    model = nn.Linear(4, 4)
    stock = uri / "step_000000002"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(stock))
    before = sorted(os.listdir(stock))

    ckpt, t = _checkpointer(_config(persist_every=1, durable_uri=str(uri), persist_on_close=False))
    assert ckpt.restore() is None  # not ours: never restored...
    assert sorted(os.listdir(stock)) == before  # ...and never deleted at start
    assert "no gemini_ckpt marker" in caplog.text
    _train(ckpt, t, [0, 1])
    ckpt.save(2).persisted.exception(timeout=30)
    assert "step_000000002 exists but was not written by gemini_ckpt" in ckpt.stats.last_persist_error
    assert sorted(os.listdir(stock)) == before
    ckpt.abort()


def test_a_failed_persist_removes_its_own_partial_directory_at_once(tmp_path):
    uri = tmp_path / "d"
    ckpt, t = _checkpointer(_config(persist_every=1, durable_uri=str(uri), persist_on_close=False))

    def fail_before_metadata(phase, **ctx):
        if phase == "persist_commit" and ctx["step"] == 1:
            assert (uri / "step_000000001" / IN_PROGRESS_FILE).exists()
            raise OSError("injected: crash between data files and metadata")

    _faults.set_hook(fail_before_metadata)
    try:
        _train(ckpt, t, [0, 1, 2])
        ckpt.wait_persisted()
    finally:
        _faults.set_hook(None)
    assert ckpt.stats.persist_failed == 1
    assert sorted(os.listdir(uri)) == ["latest", "step_000000000", "step_000000002"]
    assert not (uri / "step_000000002" / IN_PROGRESS_FILE).exists()  # removed once complete
    with pytest.warns(UserWarning, match=r"1 persist\(s\) to .* failed in this run"):
        ckpt.close()


# --- the persist thread survives ---------------------------------------------------------------
def test_the_persist_thread_survives_a_failing_retention(tmp_path):
    fs, handler = faulty_filesystem()
    root = str(tmp_path / "d")
    durable = DurableTier(filesystem=fs, root=root, keep=1)
    ckpt, t = _checkpointer(_config(persist_every=1, persist_on_close=False, keep_durable=1), durable=durable)
    _train(ckpt, t, [0])
    ckpt.wait_persisted()
    handler.failing_deletes.set()  # retention (durable and in memory) now fails
    _train(ckpt, t, [1, 2])
    ckpt.wait_persisted()
    handler.failing_deletes.clear()
    _train(ckpt, t, [3])
    t0 = time.monotonic()
    ckpt.close()
    assert time.monotonic() - t0 < 10
    assert ckpt.stats.persisted == 4 and ckpt.stats.persist_failed == 0
    assert durable.complete_steps() == [3]


# --- small inputs that used to fail obscurely ---------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_timeout_must_be_finite(value):
    with pytest.raises(ConfigError, match="timeout_s must be a positive, finite number"):
        CheckpointConfig(timeout_s=value)


def test_an_interrupt_while_saving_frees_the_in_flight_slot():
    class Interrupting:
        armed = False

        def state_dict(self):
            if self.armed:
                raise KeyboardInterrupt
            return {}

        def load_state_dict(self, sd):
            pass

    loader = Interrupting()
    t = build_training(seed=0, dataset_size=32)
    ckpt = Checkpointer(TrainState(model=t.model, optimizer=t.optimizer, dataloader=loader), _config(timeout_s=5))
    ckpt.save(0)
    loader.armed = True
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(1)
    loader.armed = False
    ckpt.save(2)  # would wait timeout_s for a slot that never comes back
    ckpt.close()
    assert ckpt.store.committed_steps() == [0, 2]


def test_a_conjugate_view_round_trips():
    class M(nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.register_buffer("c", torch.randn(3, dtype=torch.complex64, generator=g).conj())

    config = _config()
    saved = M(0)
    ckpt = Checkpointer(TrainState(model=saved), config)
    ckpt.save(0)
    ckpt.close()
    loaded = M(1)
    Checkpointer(TrainState(model=loaded), config).restore()
    assert torch.equal(loaded.c, saved.c)


def test_an_expanded_buffer_is_refused_at_save_naming_it():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", torch.arange(3.0).expand(4, 3))

    ckpt = Checkpointer(TrainState(model=M()), _config())
    with pytest.raises(ValueError, match=r"tensor 'model.pos' .* expand\(\)ed view .*\.clone\(\)"):
        ckpt.save(0)
    ckpt.close()


def test_an_empty_model_is_a_clear_error():
    ckpt = Checkpointer(TrainState(model=nn.Module()), _config())
    with pytest.raises(ValueError, match=r"has no parameters or persistent buffers yet"):
        ckpt.save(0)
    ckpt.close()


# --- a stock DCP checkpoint as the starting point -----------------------------------------------
def _stock_checkpoint(path, seed=3):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t = build_training(seed=seed, dataset_size=32)
    batches = t.batches()
    for _ in range(2):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(t.model, [t.optimizer])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    return t


def test_init_from_a_stock_dcp_checkpoint_starts_the_job_there(tmp_path):
    stock = tmp_path / "torchtitan-step-1000"
    source = _stock_checkpoint(stock)
    before = {f: (stock / f).read_bytes() for f in os.listdir(stock)}
    config = _config(init_from=str(stock), durable_uri=str(tmp_path / "d"), persist_every=2)
    ckpt, t = _checkpointer(config, seed=0)
    result = ckpt.restore()
    assert (result.step, result.source) == (-1, "init")
    for k, v in source.model.state_dict().items():
        assert torch.equal(t.model.state_dict()[k], v), k
    for i, st in source.optimizer.state_dict()["state"].items():
        assert torch.equal(t.optimizer.state_dict()["state"][i]["exp_avg"], st["exp_avg"]), i
    _train(ckpt, t, range(result.step + 1, 2))
    ckpt.close()
    assert {f: (stock / f).read_bytes() for f in os.listdir(stock)} == before  # never touched
    # Once the job has versions of its own, they win over init_from.
    again, _ = _checkpointer(config, seed=0)
    assert again.restore().step == 1
    again.close()


def test_init_from_never_runs_code_from_the_stock_checkpoint(tmp_path):
    import pickle

    stock = tmp_path / "stock"
    _stock_checkpoint(stock)
    canary = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    (stock / ".metadata").write_bytes(pickle.dumps(Payload()))
    ckpt, _ = _checkpointer(_config(init_from=str(stock)))
    with pytest.raises(CheckpointError, match="metadata"):
        ckpt.restore()
    assert not canary.exists()
    ckpt.close()


def test_a_discard_that_fails_is_retried_and_never_drops_what_the_run_wrote_since(tmp_path):
    fs, handler = faulty_filesystem()
    root = str(tmp_path / "d")
    config = _config(keep_in_memory=8, persist_every=4, persist_on_close=False)
    first, t = _checkpointer(config, durable=DurableTier(filesystem=fs, root=root))
    _train(first, t, range(8))
    first.close()
    corrupt_durable_item(root, 7, corrupt_item(first.store, 7))
    corrupt_item(first.store, 6)
    durable = DurableTier(filesystem=fs, root=root)

    # The same job, persisting no more (so the durable listing below is only about the discard).
    second, t2 = _checkpointer(replace(config, persist_every=0), durable=durable)
    with pytest.warns(UserWarning, match="skipped"):
        assert second.restore().step == 5
    handler.unreachable.set()  # the discard of the abandoned 6 and 7 fails...
    _train(second, t2, [6])  # ...and the save goes on (no rank is left waiting)
    handler.unreachable.clear()
    assert durable.complete_steps() == [3, 7]  # not yet
    _train(second, t2, [7])  # retried now: the old 7 goes, the new 6 stays
    assert durable.complete_steps() == [3]
    assert second.store.committed_steps()[-2:] == [6, 7]
    second.close()
    again, t3 = _checkpointer(config, durable=DurableTier(filesystem=fs, root=root))
    assert again.restore().step == 7  # the new run's 7
    for k, v in t2.model.state_dict().items():
        assert torch.equal(t3.model.state_dict()[k], v), k
    again.close()
