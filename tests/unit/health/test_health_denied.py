"""What an unhealthy version is denied: it is never the restore choice, never
persisted over good ones, never counted by retention, and ``on_unhealthy='raise'`` stops the
job; ``restore(step=...)`` still loads one on purpose. Single process, ``store="local"``; the
host stores' side is tests/integration/hoststore/test_ray_health.py and the commit protocol's is
tests/unit/commit/test_commit_protocol.py.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from gemini_ckpt import Checkpointer, HealthCheck, TrainState, UnhealthyVersionError, VersionNotFoundError
from gemini_ckpt.chaos import damage_copy
from gemini_ckpt.toy import build_training
from gemini_ckpt.health import Finite
from gemini_ckpt.restore import UnhealthyRestoreWarning
from gemini_ckpt.retention import KeepNewest
from gemini_ckpt.state.digest import digest
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.format.finite import NAN_BITS
from health_support import job_config, toy_lm, save_committed, train_step


# --- what an unhealthy version is denied --------------------------------------------------------------
def _poisoned_run(config, steps, bad, *, seed=0):
    """Train ``steps`` with a NaN put into one weight right after the optimizer step of ``bad``
    (so every later step is poisoned too). Returns the handles, the digest of each step's state,
    the training objects and the (open) Checkpointer."""
    t, ckpt = toy_lm(config, seed=seed)
    batches = t.batches()
    handles, digests = {}, {}
    for step in steps:
        train_step(t, batches)
        if step == bad:
            with torch.no_grad():
                t.model.blocks.layers[0].linear1.weight[3, 7] = math.nan
        handles[step] = ckpt.save(step)
        digests[step] = digest([t.model.state_dict(), t.optimizer.state_dict()])
    ckpt.wait()
    return handles, digests, t, ckpt


def test_the_issue_case_restores_the_last_healthy_version_and_disk_keeps_healthy_ones(tmp_path):
    # persist_every=2, keep_durable=2, keep_in_memory=3; NaN in one weight at step 6;
    # saves go on to step 9. Before: step 9 restored with NaN, durable [7, 9] both poisoned.
    uri = str(tmp_path / "d")
    config = job_config(persist_every=2, keep_durable=2, keep_in_memory=3, durable_uri=uri)
    handles, digests, _, ckpt = _poisoned_run(config, range(10), bad=6)
    ckpt.wait_persisted()
    assert [handles[s].health.result().status for s in range(10)] == ["healthy"] * 6 + ["unhealthy"] * 4
    assert (
        handles[6]
        .health.result()
        .reason.startswith(
            "rank 0: model.blocks.layers.0.linear1.weight failed the finite check (1 NaN of 2,048 values"
        )
    )
    assert [handles[s].persisted.result() is None for s in (7, 9)] == [True, True]  # due, but unhealthy
    assert ckpt.store.committed_steps() == [3, 4, 5, 6]  # 3 healthy + the first unhealthy, for inspection
    assert ckpt.stats.unhealthy == 4 and ckpt.stats.last_unhealthy_step == 9
    ckpt.close()
    assert DurableTier(uri).complete_steps() == [3, 5]  # close() persisted nothing newer: no healthy one is

    t2, fresh = toy_lm(config, seed=7)
    result = fresh.restore()
    assert (result.step, result.source, result.health.status) == (5, "memory", "healthy")
    assert result.skipped_steps == (6,)
    assert result.skipped_reasons[6].startswith(
        "unhealthy: rank 0: model.blocks.layers.0.linear1.weight failed the finite check (1 NaN of 2,048 values"
    )
    assert all(torch.isfinite(p).all() for p in t2.model.parameters())
    assert digest([t2.model.state_dict(), t2.optimizer.state_dict()]) == digests[5]
    fresh.close()

    # A job whose memory is gone (a new process) restores the same version from disk.
    t3 = build_training(seed=3, dataset_size=32)
    durable_only = Checkpointer(
        TrainState(model=t3.model, optimizer=t3.optimizer, scheduler=t3.scheduler), job_config(durable_uri=uri)
    )
    result = durable_only.restore()
    assert (result.step, result.source, result.skipped_steps) == (5, "durable", ())
    assert digest([t3.model.state_dict(), t3.optimizer.state_dict()]) == digests[5]
    durable_only.close()


def test_memory_keeps_the_newest_healthy_versions_and_only_the_first_unhealthy_one():
    check = HealthCheck(metrics=(Finite(metric="loss"),))
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), job_config(keep_in_memory=2, health_check=check))
    held = []
    for step, loss in enumerate([1.0, 1.0, math.nan, math.nan, math.nan, 1.0, 1.0, math.nan, 1.0]):
        save_committed(ckpt, step, metrics={"loss": loss})
        held.append(ckpt.store.committed_steps())
    assert held == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2],
        [0, 1, 2],  # bad ones never push 0 and 1 out
        [1, 2, 5],  # 2, where the state went bad, is newer than the oldest healthy one kept
        [5, 6],  # ... and now older
        [5, 6, 7],
        [6, 7, 8],
    ]
    ckpt.close()


def test_retention_rule_counts_healthy_versions_only():
    keep = KeepNewest(3)
    assert keep.doomed([3, 4, 5, 6, 7, 8, 9], unhealthy=[6, 7, 8, 9]) == [7, 8, 9]
    assert keep.doomed([0, 1, 2], unhealthy=[0, 1, 2]) == [1, 2]  # nothing healthy yet: the first bad one stays
    assert keep.doomed([2, 3, 4, 5, 6], unhealthy=[2]) == [2, 3]  # older than every healthy one kept
    assert keep.doomed([1, 2, 3, 4, 5], protected=[1], unhealthy=[4, 5]) == [5]
    # A new run of bad versions after a healthy one: its first is kept, the older run's goes.
    assert KeepNewest(2).doomed([1, 2, 4, 5], unhealthy=[2, 5]) == [2]


def test_an_unhealthy_version_is_never_persisted_even_when_asked_and_close_persists_the_newest_healthy(tmp_path):
    uri = str(tmp_path / "d")
    check = HealthCheck(metrics=(Finite(metric="loss"),))
    ckpt = Checkpointer(
        TrainState(model=nn.Linear(4, 4)),
        job_config(durable_uri=uri, persist_every=100, keep_durable=2, health_check=check),
    )
    for step in range(3):
        save_committed(ckpt, step, metrics={"loss": 1.0})
    handle = save_committed(ckpt, 3, persist=True, metrics={"loss": math.nan})
    assert handle.persisted.result(timeout=60) is None
    save_committed(ckpt, 4, metrics={"loss": math.nan})
    ckpt.close()  # persist_on_close: the newest healthy version, not the newest
    assert DurableTier(uri).complete_steps() == [2]


def test_on_unhealthy_raise_stops_the_job_at_the_next_save():
    check = HealthCheck(metrics=(Finite(metric="loss"),), on_unhealthy="raise")
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), job_config(health_check=check))
    save_committed(ckpt, 0, metrics={"loss": 1.0})
    save_committed(ckpt, 1, metrics={"loss": math.nan})
    with pytest.raises(
        UnhealthyVersionError,
        match=r"rank 0: step 1 is unhealthy: rank 0: loss failed the metric "
        r"check \(loss is nan\); the newest healthy version is step 0",
    ) as caught:
        ckpt.save(2, metrics={"loss": 1.0})
    err = pickle.loads(pickle.dumps(caught.value))  # survives a Ray actor boundary, with its fields
    assert (err.step, err.health.item, str(err)) == (1, "loss", str(caught.value))
    assert ckpt.store.committed_steps() == [0, 1]  # step 2 was not saved
    ckpt.abort()


def test_restore_step_loads_a_named_unhealthy_version_with_a_warning():
    config = job_config(keep_in_memory=2)
    handles, digests, _, ckpt = _poisoned_run(config, range(5), bad=3)
    ckpt.close()
    t, again = toy_lm(config, seed=5)
    with pytest.warns(
        UnhealthyRestoreWarning,
        match=r"restored step 3, whose state is UNHEALTHY \(rank 0: "
        r"model.blocks.layers.0.linear1.weight failed the finite check",
    ):
        result = again.restore(step=3)
    assert (result.step, result.health.status, result.skipped_steps) == (3, "unhealthy", ())
    assert math.isnan(t.model.blocks.layers[0].linear1.weight[3, 7].item())
    assert digest([t.model.state_dict(), t.optimizer.state_dict()]) == digests[3]
    with pytest.raises(ValueError, match="step 3 was restored; the next save must be a later step"):
        again.save(3)
    again.close()

    t, named = toy_lm(config, seed=5)
    assert named.restore(step=2).step == 2  # a healthy one, by name
    with pytest.raises(
        VersionNotFoundError,
        match=r"restore\(step=9\): no tier holds a committed version of step 9 "
        r"\(they hold \[1, 2, 3\]\)",
    ):
        named.restore(step=9)
    named.close()


def test_restore_refuses_to_start_over_when_every_version_is_unhealthy():
    config = job_config(keep_in_memory=2)
    _, _, _, ckpt = _poisoned_run(config, range(3), bad=0)
    assert ckpt.store.committed_steps() == [0]
    ckpt.close()
    _, fresh = toy_lm(config, seed=1)
    with pytest.raises(
        UnhealthyVersionError,
        match=r"no healthy version to restore: step\(s\) \[0\] are unhealthy: "
        r"step 0 \(memory\): unhealthy: rank 0: model.blocks",
    ):
        fresh.restore()
    with pytest.warns(UnhealthyRestoreWarning):
        assert fresh.restore(step=0).step == 0
    fresh.close()


def test_memory_poisoned_after_commit_is_caught_by_the_checksum_and_never_loaded(tmp_path):
    # The health check judges the state when it is saved; a NaN written into a kept copy later
    # (silent corruption in memory) changes its bytes, so the copy fails its checksum and the
    # item comes from the version's other copy (here: the durable one).
    uri = str(tmp_path / "d")
    config = job_config(durable_uri=uri, persist_every=3)
    t, ckpt = toy_lm(config)
    batches = t.batches()
    for step in range(3):
        train_step(t, batches)
        save_committed(ckpt, step)
    expected = digest([t.model.state_dict(), t.optimizer.state_dict()])
    ckpt.wait_persisted()
    item = next(i for i in ckpt.store.open(2).plans[0].tensors if i.fqn == "model.head.weight")
    damage_copy(ckpt.store, 2, 0, item.at, data=NAN_BITS[item.dtype])
    ckpt.close()
    t2, fresh = toy_lm(config, seed=2)
    result = fresh.restore()
    assert (result.step, result.health.status, result.sources) == (2, "healthy", {0: "durable"})
    assert item.nbytes <= result.bytes_read["durable"] < 2 * item.nbytes  # that item only, with its framing
    assert digest([t2.model.state_dict(), t2.optimizer.state_dict()]) == expected
    fresh.close()
