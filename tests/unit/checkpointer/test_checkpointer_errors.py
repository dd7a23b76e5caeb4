"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from gemini_ckpt import (
    BackgroundError,
    CheckpointConfig,
    Checkpointer,
    ChecksumError,
    ConfigError,
    StructureMismatchError,
    TrainState,
)
from gemini_ckpt.chaos import damage_copy
from gemini_ckpt.stores.memory import LocalTier
from helpers import local_tier
from gemini_ckpt.toy import TinyLM, build_training, lm_loss


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(replicas=0), "replicas"),
        (dict(keep_in_memory=0), "keep_in_memory"),
        (dict(persist_every=-1), "persist_every"),
        (dict(max_inflight=0), "max_inflight"),
        (dict(inflight_policy="drop"), "inflight_policy"),
        (dict(store="disk"), "store"),
        (dict(placement="star"), "placement"),
        (dict(replicas=1.5), "replicas"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(replicaz=2), "replicaz"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        CheckpointConfig(**kwargs)
    assert isinstance(info.value, ConfigError)


def test_unknown_field_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'keep_in_memory'"):
        CheckpointConfig(keep_in_memroy=2)


def _setup(seed=0):
    t = build_training(seed=seed, dataset_size=32)
    lm_loss(t.model, next(t.batches())).backward()
    t.optimizer.step()
    return t, TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)


def test_corrupted_newest_version_is_refused_and_restore_falls_back():
    ns = f"corrupt-{uuid.uuid4().hex}"
    t, state = _setup()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=ns, keep_in_memory=2))
    ckpt.save(1)
    ckpt.wait()
    at_step_1 = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1.0)
    ckpt.save(2)
    ckpt.wait()
    biggest = max(ckpt.store.open(2).plans[0].tensors, key=lambda t: t.nbytes)
    damage_copy(ckpt.store, 2, 0, biggest.at + biggest.nbytes // 2)
    with pytest.warns(UserWarning, match=r"step 2 \(memory\) could not be restored"):
        result = ckpt.restore()
    assert result.step == 1 and result.skipped_steps == (2,)
    for n, p in t.model.named_parameters():
        assert torch.equal(p, at_step_1[n]), n
    ckpt.close()


def test_corrupted_only_version_raises_a_clear_checksum_error():
    ns = f"corrupt1-{uuid.uuid4().hex}"
    _, state = _setup()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=ns))
    ckpt.save(1)
    ckpt.wait()
    last = ckpt.store.open(1).plans[0].tensors[-1]
    damage_copy(ckpt.store, 1, 0, last.at)
    with pytest.warns(UserWarning), pytest.raises(ChecksumError, match="no committed version"):
        ckpt.restore()
    ckpt.close()


def test_structure_mismatch_names_the_keys():
    ns = f"mismatch-{uuid.uuid4().hex}"
    _, state = _setup()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=ns))
    ckpt.save(1)
    ckpt.close()
    other = TinyLM(dim=48)  # different widths: same names, other shapes
    deeper = TinyLM(layers=3)  # an extra block: keys the checkpoint lacks
    for model, expect in ((other, "different shapes"), (deeper, "blocks.layers.2")):
        c = Checkpointer(
            TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters())),
            CheckpointConfig(store="local", namespace=ns),
        )
        with pytest.raises(StructureMismatchError, match=expect):
            c.restore()
        c.close()


class FailingTier(LocalTier):
    """A memory tier whose Nth hand-off fails, like a store that runs out of memory or dies."""

    def __init__(self, fail_on: set[int]) -> None:
        base = local_tier()
        super().__init__(base.store, base.epoch, base.keep)
        self.fail_on = fail_on
        self.puts = 0

    def _commit(self, step, plan, segment, blobs, persist):
        self.puts += 1
        if self.puts in self.fail_on:
            self.give_back(segment)
            raise OSError(f"injected write failure on put #{self.puts}")
        return super()._commit(step, plan, segment, blobs, persist)


def test_failed_background_write_keeps_previous_version_and_raises_on_training_thread():
    _, state = _setup()
    store = FailingTier(fail_on={2})
    ckpt = Checkpointer(state, CheckpointConfig(store="local"), store=store)
    ckpt.save(1).committed.result(timeout=60)
    bad = ckpt.save(2)
    with pytest.raises(BackgroundError, match="version 2 was not committed"):
        bad.committed.result(timeout=60)
    with pytest.raises(BackgroundError, match="injected write failure"):
        ckpt.save(3)  # the failure surfaces on the training thread, once
    assert store.committed_steps() == [1]
    ckpt.save(3).committed.result(timeout=60)  # and training checkpoints go on
    assert store.committed_steps() == [1, 3]
    assert ckpt.stats.failed == 1
    ckpt.close()


class GatedTier(LocalTier):
    def __init__(self) -> None:
        base = local_tier()
        super().__init__(base.store, base.epoch, base.keep)
        self.gate = threading.Event()

    def _commit(self, step, plan, segment, blobs, persist):
        self.gate.wait(timeout=60)
        return super()._commit(step, plan, segment, blobs, persist)


def test_skip_policy_drops_saves_while_busy_and_counts_them():
    _, state = _setup()
    store = GatedTier()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", inflight_policy="skip"), store=store)
    first = ckpt.save(1)
    second = ckpt.save(2)
    assert second.skipped and second.committed.cancelled()
    assert ckpt.stats.skipped == 1
    store.gate.set()
    assert first.committed.result(timeout=60) == 1
    ckpt.close()
    assert store.committed_steps() == [1]


def test_wait_policy_blocks_until_the_previous_version_is_done():
    _, state = _setup()
    store = GatedTier()
    ckpt = Checkpointer(state, CheckpointConfig(store="local"), store=store)
    ckpt.save(1)
    threading.Timer(0.3, store.gate.set).start()
    ckpt.save(2)  # blocks until version 1 is through
    assert store.committed_steps() == [1]
    ckpt.close()
    assert store.committed_steps() == [1, 2]


def test_bad_step_and_bad_state_are_rejected():
    _, state = _setup()
    ckpt = Checkpointer(state, CheckpointConfig(store="local"))
    with pytest.raises(ValueError, match="step"):
        ckpt.save(-1)
    ckpt.close()
    with pytest.raises(TypeError, match="TrainState"):
        Checkpointer({"model": 1})
    with pytest.raises(TypeError, match="dataloader"):
        TrainState(model=TinyLM(), dataloader=object())


def test_the_process_local_tier_keeps_the_memory_tier_contract():
    from tier_contract import check_tier_contract

    check_tier_contract(local_tier(keep=2), keep=2)


def test_the_footprint_is_computed_when_the_state_is_planned():
    _, state = _setup()
    config = CheckpointConfig(
        store="local", namespace=f"footprint-{uuid.uuid4().hex}", keep_in_memory=3, max_inflight=2
    )
    with Checkpointer(state, config) as ckpt:
        assert ckpt.stats.footprint == {}  # nothing planned yet
        ckpt.save(0)
        ckpt.wait()
        assert ckpt.stats.footprint == {"this process": 5 * ckpt.stats.staging_bytes} and ckpt.stats.staging_bytes > 0
