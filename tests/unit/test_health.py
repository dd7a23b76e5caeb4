"""Validated versions (issue 21): a state poisoned by NaN/Inf is never the restore choice, never
persisted over good ones, never counted by retention; ``restore(step=...)`` still loads one on
purpose. Single process, ``store="local"``; the host stores' side is tests/integration/test_ray_health.py
and the commit protocol's is tests/unit/test_commit_protocol.py."""

from __future__ import annotations

import json
import math
import pickle
import struct
import uuid

import crc32c
import numpy as np
import pytest
import torch
from torch import nn

from gemini_ckpt import (
    CheckpointConfig,
    Checkpointer,
    ConfigError,
    HealthCheck,
    TrainState,
    UnhealthyVersionError,
    VersionNotFoundError,
)
from gemini_ckpt.__main__ import main as cli
from gemini_ckpt.chaos import damage_copy
from gemini_ckpt.checksum import checksum
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.health import Finite, NoSpike
from gemini_ckpt.restore import UnhealthyRestoreWarning
from gemini_ckpt.retention import KeepNewest
from gemini_ckpt.state.digest import digest
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.format.finite import CHUNK, NAN_BITS, checksum_items
from gemini_ckpt.format.manifest import ItemChecksum, VersionManifest
from gemini_ckpt.stores.memory import drop_local_store
from gemini_ckpt.errors import ShardFormatError
from gemini_ckpt.signing import canonical
from gemini_ckpt.format.shards import RECORD_MAGIC, ShardRecord
from gemini_ckpt.trust.manifest import canonical_bytes

NAMESPACE = "health-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """One namespace for this module's jobs (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


FINITE = "failed the finite check"


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


# --- the tensor check ------------------------------------------------------------------------------
def _bits_16(dtype: torch.dtype, kind: str) -> torch.Tensor:
    top = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}[dtype]
    value = {"nan": top | 1, "+inf": top, "-inf": 0x8000 | top}[kind]
    return torch.from_numpy(np.array([value], np.uint16).view(np.int16)).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nan", "+inf", "-inf"])
def test_a_parameter_that_is_not_finite_makes_the_version_unhealthy_in_every_float_format(dtype, kind):
    model = nn.Linear(8, 4).to(dtype)
    ckpt = Checkpointer(TrainState(model=model), _config())
    assert _saved(ckpt, 0).health.result().status == "healthy"
    with torch.no_grad():
        if dtype in (torch.float16, torch.bfloat16):  # the exact bits, so no conversion can hide them
            model.weight.view(-1)[13] = _bits_16(dtype, kind)[0]
        else:
            model.weight.view(-1)[13] = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}[kind]
    health = _saved(ckpt, 1).health.result()
    label = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}[kind]
    assert (health.status, health.check, health.item, health.rank) == ("unhealthy", "finite", "model.weight", 0)
    assert health.detail == f"1 {label} of 32 values, the first at flat index 13"
    assert health.reason == f"rank 0: model.weight {FINITE} (1 {label} of 32 values, the first at flat index 13)"
    ckpt.close()


def test_the_check_reads_every_value_of_items_many_chunks_long():
    # The check runs chunk by chunk, fused with the checksum or beside it: a NaN in the very last
    # value of an item several chunks long, or in a later item, is found both ways, and the
    # checksums are those of the whole items.
    from concurrent.futures import ThreadPoolExecutor

    n = CHUNK + 5  # fp32 values: 4 chunks and a bit; two such items are enough to be checked beside
    region = np.zeros(2 * 4 * n + 64, np.uint8)
    first = region[: 4 * n].view(np.float32)
    second = region[4 * n + 60 : 4 * n + 60 + 4 * n].view(np.float32)
    first[:] = 1.0
    second[:] = 2.0
    items = [(0, 4 * n, "float32"), (4 * n + 60, 4 * n, "float32"), (0, 4 * n, "int32")]
    with ThreadPoolExecutor(1) as pool:
        for bad, where in ((0, n - 1), (1, 0), (1, n - 1)):
            (first if bad == 0 else second)[where] = math.nan
            for beside in (None, pool):
                crcs, found = checksum_items(region, items, [0, 1], beside=beside)
                assert crcs == tuple(crc32c.crc32c(region[at : at + size]) for at, size, _ in items)
                assert (found.item, found.nan, found.first) == (bad, 1, where)
            (first if bad == 0 else second)[where] = 1.0 if bad == 0 else 2.0
        # item 2 (not a float format, not asked for) is never read as floats
        assert checksum_items(region, items, [0, 1], beside=pool)[1] is None
        # large finite values overflow the one-pass sum (the dot product): checked again exactly
        first[:] = 3e38
        for beside in (None, pool):
            assert checksum_items(region, items, [0, 1], beside=beside)[1] is None


def test_buffers_are_not_checked_by_default_and_are_when_asked():
    # The toy LM's causal mask is a buffer full of -inf: healthy by default.
    t, ckpt = _lm(_config())
    assert _saved(ckpt, 0).health.result().status == "healthy"
    ckpt.close()
    t, ckpt = _lm(_config(health_check=HealthCheck(buffers=True)))
    health = _saved(ckpt, 0).health.result()
    assert (health.status, health.item) == ("unhealthy", "model.mask")
    assert health.detail.startswith("120 -Inf of 256 values")
    ckpt.close()


def test_optimizer_state_is_checked_and_each_check_can_be_turned_off():
    t, ckpt = _lm(_config())
    batches = t.batches()
    _step(t, batches)
    param = t.model.head.weight
    t.optimizer.state[param]["exp_avg_sq"].view(-1)[5] = math.inf
    health = _saved(ckpt, 0).health.result()
    assert (health.status, health.check, health.item) == ("unhealthy", "finite", "optim.state.head.weight.exp_avg_sq")
    ckpt.close()

    t, ckpt = _lm(_config(health_check=HealthCheck(optimizer_state=False)))
    _step(t, t.batches())
    t.optimizer.state[t.model.head.weight]["exp_avg"].view(-1)[0] = math.nan
    assert _saved(ckpt, 0).health.result().status == "healthy"
    with torch.no_grad():
        t.model.head.bias[0] = math.nan
    assert _saved(ckpt, 1).health.result().item == "model.head.bias"
    ckpt.close()


def test_a_non_finite_optimizer_hyperparameter_makes_the_version_unhealthy_and_it_is_not_restored():
    """A NaN learning rate (float or tensor) or an infinite weight decay lives in param_groups,
    not in the state tensors; one more step makes every parameter non-finite (issue 40, 4)."""
    t, ckpt = _lm(_config())
    batches = t.batches()
    _step(t, batches)
    assert _saved(ckpt, 0).health.result().status == "healthy"
    group = t.optimizer.param_groups[0]
    lr, wd = group["lr"], group["weight_decay"]
    for step, (key, bad, detail) in enumerate(
        [
            ("lr", math.nan, "lr is nan"),
            ("weight_decay", math.inf, "weight_decay is inf"),
            ("lr", torch.tensor(math.nan), "lr is nan"),
        ],
        start=1,
    ):
        group[key] = bad
        health = _saved(ckpt, step).health.result()
        assert (health.status, health.check, health.item, health.detail) == (
            "unhealthy",
            "finite",
            f"optim.param_groups.0.{key}",
            detail,
        )
        group["lr"], group["weight_decay"] = lr, wd
    group["betas"] = (0.9, math.nan)
    assert _saved(ckpt, 4).health.result().item == "optim.param_groups.0.betas"
    group["betas"] = (0.9, 0.999)
    assert ckpt.restore().step == 0  # the newest healthy version, not 1-4
    assert group["lr"] == lr and math.isfinite(group["betas"][1])
    ckpt.close()

    t, ckpt = _lm(_config(health_check=HealthCheck(optimizer_state=False)))
    t.optimizer.param_groups[0]["lr"] = math.nan
    assert _saved(ckpt, 0).health.result().status == "healthy"  # the switch covers it
    ckpt.close()


def test_health_check_none_checks_nothing_and_says_so():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    ckpt = Checkpointer(TrainState(model=model), _config(health_check=None))
    handle = _saved(ckpt, 0, metrics={"loss": math.nan})
    assert handle.health.result().status == "unchecked"
    assert ckpt.restore().step == 0  # unchecked versions count as healthy
    ckpt.close()


# --- checks on the trainer: metrics and a validator ------------------------------------------------
def test_a_metric_that_is_not_finite_makes_the_version_unhealthy():
    ckpt = Checkpointer(
        TrainState(model=nn.Linear(4, 4)), _config(health_check=HealthCheck(metrics=(Finite(metric="loss"),)))
    )
    assert _saved(ckpt, 0, metrics={"loss": 2.5}).health.result().status == "healthy"
    assert _saved(ckpt, 1).health.result().status == "healthy"  # a save that reports no loss is not judged
    health = _saved(ckpt, 2, metrics={"loss": math.inf, "lr": 0.1}).health.result()
    assert (health.status, health.check, health.item, health.detail) == ("unhealthy", "metric", "loss", "loss is inf")
    with pytest.raises(ValueError, match="metric 'loss' is 'abc', not a number"):
        ckpt.save(3, metrics={"loss": "abc"})
    ckpt.close()


def test_a_loss_spike_beyond_k_times_its_running_median_makes_the_version_unhealthy():
    spike = NoSpike(metric="loss", factor=3.0, window=4, min_history=3)
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), _config(health_check=HealthCheck(metrics=(spike,))))
    losses = [9.0, 1.0, 1.2, 1.0, 4.0, 12.0, 1.1, 3.5]
    statuses = [_saved(ckpt, s, metrics={"loss": v}).health.result() for s, v in enumerate(losses)]
    # step 1 has no history of 3 yet; at step 4 the last 4 healthy losses are 9, 1, 1.2, 1 (median 1.1):
    # 4.0 > 3.3; the spike is not history, so at step 5 the median is still 1.1; at step 7 it is 1.05.
    assert [h.status for h in statuses] == ["healthy"] * 4 + ["unhealthy", "unhealthy", "healthy", "unhealthy"]
    assert statuses[4].detail == "loss is 4, over 3 x its running median 1.1 (last 4 healthy saves)"
    assert statuses[7].detail == "loss is 3.5, over 3 x its running median 1.05 (last 4 healthy saves)"
    ckpt.close()


def test_a_user_validator_judges_the_live_state_on_the_training_thread():
    seen = []

    def validator(step, state, metrics):
        seen.append((step, type(state).__name__, dict(metrics)))
        return None if metrics.get("acc", 1.0) > 0.5 else f"accuracy {metrics['acc']} is no better than chance"

    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), _config(health_check=HealthCheck(validator=validator)))
    assert _saved(ckpt, 0, metrics={"acc": 0.9}).health.result().status == "healthy"
    health = _saved(ckpt, 1, metrics={"acc": 0.4}).health.result()
    assert (health.status, health.check, health.detail) == (
        "unhealthy",
        "validator",
        "accuracy 0.4 is no better than chance",
    )
    assert health.reason == "rank 0: the state failed the validator check (accuracy 0.4 is no better than chance)"
    assert seen == [(0, "TrainState", {"acc": 0.9}), (1, "TrainState", {"acc": 0.4})]
    ckpt.close()

    ckpt = Checkpointer(
        TrainState(model=nn.Linear(4, 4)),
        _config(health_check=HealthCheck(validator=lambda step, state, metrics: False)),
    )
    with pytest.raises(TypeError, match="must return None .healthy. or a reason string, got False"):
        ckpt.save(0)
    ckpt.close()


def test_health_settings_are_checked_when_made():
    with pytest.raises(ConfigError, match="CheckpointConfig.health_check must be a gemini_ckpt.HealthCheck"):
        CheckpointConfig(health_check=True)
    with pytest.raises(ConfigError, match="HealthCheck.on_unhealthy='stop' is not valid; use one of 'warn', 'raise'"):
        HealthCheck(on_unhealthy="stop")
    with pytest.raises(ConfigError, match="HealthCheck.metrics: 'loss' is not a metric check"):
        HealthCheck(metrics=("loss",))
    with pytest.raises(ConfigError, match="NoSpike.factor must be a finite number > 1"):
        NoSpike(factor=0.5)
    with pytest.raises(ConfigError, match="HealthCheck.buffers must be True or False"):
        HealthCheck(buffers="yes")
    assert HealthCheck(metrics=[Finite()]).metrics == (Finite(),)
    assert CheckpointConfig().health_check == HealthCheck()  # on by default


# --- what an unhealthy version is denied --------------------------------------------------------------
def _poisoned_run(config, steps, bad, *, seed=0):
    """Train ``steps`` with a NaN put into one weight right after the optimizer step of ``bad``
    (so every later step is poisoned too). Returns the handles, the digest of each step's state,
    the training objects and the (open) Checkpointer."""
    t, ckpt = _lm(config, seed=seed)
    batches = t.batches()
    handles, digests = {}, {}
    for step in steps:
        _step(t, batches)
        if step == bad:
            with torch.no_grad():
                t.model.blocks.layers[0].linear1.weight[3, 7] = math.nan
        handles[step] = ckpt.save(step)
        digests[step] = digest([t.model.state_dict(), t.optimizer.state_dict()])
    ckpt.wait()
    return handles, digests, t, ckpt


def test_the_issue_case_restores_the_last_healthy_version_and_disk_keeps_healthy_ones(tmp_path):
    # Issue 21: persist_every=2, keep_durable=2, keep_in_memory=3; NaN in one weight at step 6;
    # saves go on to step 9. Before: step 9 restored with NaN, durable [7, 9] both poisoned.
    uri = str(tmp_path / "d")
    config = _config(persist_every=2, keep_durable=2, keep_in_memory=3, durable_uri=uri)
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

    t2, fresh = _lm(config, seed=7)
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
        TrainState(model=t3.model, optimizer=t3.optimizer, scheduler=t3.scheduler), _config(durable_uri=uri)
    )
    result = durable_only.restore()
    assert (result.step, result.source, result.skipped_steps) == (5, "durable", ())
    assert digest([t3.model.state_dict(), t3.optimizer.state_dict()]) == digests[5]
    durable_only.close()


def test_memory_keeps_the_newest_healthy_versions_and_only_the_first_unhealthy_one():
    check = HealthCheck(metrics=(Finite(metric="loss"),))
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), _config(keep_in_memory=2, health_check=check))
    held = []
    for step, loss in enumerate([1.0, 1.0, math.nan, math.nan, math.nan, 1.0, 1.0, math.nan, 1.0]):
        _saved(ckpt, step, metrics={"loss": loss})
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
        _config(durable_uri=uri, persist_every=100, keep_durable=2, health_check=check),
    )
    for step in range(3):
        _saved(ckpt, step, metrics={"loss": 1.0})
    handle = _saved(ckpt, 3, persist=True, metrics={"loss": math.nan})
    assert handle.persisted.result(timeout=60) is None
    _saved(ckpt, 4, metrics={"loss": math.nan})
    ckpt.close()  # persist_on_close: the newest healthy version, not the newest
    assert DurableTier(uri).complete_steps() == [2]


def test_on_unhealthy_raise_stops_the_job_at_the_next_save():
    check = HealthCheck(metrics=(Finite(metric="loss"),), on_unhealthy="raise")
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), _config(health_check=check))
    _saved(ckpt, 0, metrics={"loss": 1.0})
    _saved(ckpt, 1, metrics={"loss": math.nan})
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
    config = _config(keep_in_memory=2)
    handles, digests, _, ckpt = _poisoned_run(config, range(5), bad=3)
    ckpt.close()
    t, again = _lm(config, seed=5)
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

    t, named = _lm(config, seed=5)
    assert named.restore(step=2).step == 2  # a healthy one, by name
    with pytest.raises(
        VersionNotFoundError,
        match=r"restore\(step=9\): no tier holds a committed version of step 9 "
        r"\(they hold \[1, 2, 3\]\)",
    ):
        named.restore(step=9)
    named.close()


def test_restore_refuses_to_start_over_when_every_version_is_unhealthy():
    config = _config(keep_in_memory=2)
    _, _, _, ckpt = _poisoned_run(config, range(3), bad=0)
    assert ckpt.store.committed_steps() == [0]
    ckpt.close()
    _, fresh = _lm(config, seed=1)
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
    config = _config(durable_uri=uri, persist_every=3)
    t, ckpt = _lm(config)
    batches = t.batches()
    for step in range(3):
        _step(t, batches)
        _saved(ckpt, step)
    expected = digest([t.model.state_dict(), t.optimizer.state_dict()])
    ckpt.wait_persisted()
    item = next(i for i in ckpt.store.open(2).plans[0].tensors if i.fqn == "model.head.weight")
    damage_copy(ckpt.store, 2, 0, item.at, data=NAN_BITS[item.dtype])
    ckpt.close()
    t2, fresh = _lm(config, seed=2)
    result = fresh.restore()
    assert (result.step, result.health.status, result.sources) == (2, "healthy", {0: "durable"})
    assert item.nbytes <= result.bytes_read["durable"] < 2 * item.nbytes  # that item only, with its framing
    assert digest([t2.model.state_dict(), t2.optimizer.state_dict()]) == expected
    fresh.close()


# --- the verdict is signed with the rest ----------------------------------------------------------------
def _reframe_record(encoded: bytes, change) -> bytes:
    """A forger's record: ``change`` applied to its JSON, every CRC recomputed, the signature kept."""
    start = len(RECORD_MAGIC) + 8
    (n,) = struct.unpack("<Q", encoded[len(RECORD_MAGIC) : start])
    head = json.loads(encoded[start : start + n])
    change(head["record"])
    head["crc"] = crc32c.crc32c(canonical(head["record"]))
    text = canonical(head)
    return RECORD_MAGIC + struct.pack("<Q", len(text)) + text + encoded[start + n :]


def test_a_records_forged_verdict_is_refused_with_a_signing_key():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[1, 1] = math.nan
    ckpt = Checkpointer(TrainState(model=model), _config(signing_key="job-secret"))
    _saved(ckpt, 0)
    record = ckpt.store.open(0).records[0]
    assert record.health.unhealthy
    encoded = record.encode(b"job-secret")
    assert ShardRecord.decode(encoded, b"job-secret").health == record.health

    def heal(body):
        body["health"] = {"status": "healthy", "check": "", "item": "", "detail": "", "rank": None}

    forged = _reframe_record(encoded, heal)
    assert ShardRecord.decode(forged).health.status == "healthy"  # without a key only the CRC is checked
    with pytest.raises(ShardFormatError, match="signature that does not match this signing key"):
        ShardRecord.decode(forged, b"job-secret")
    ckpt.close()


def _reseal_marker(vdir, change) -> None:
    """A forger's marker: ``change`` applied, the manifest CRC recomputed, the signature kept."""
    marker_path = vdir / ".gemini_complete"
    marker = json.loads(marker_path.read_text())
    change(marker)
    m = VersionManifest(
        step=marker["step"],
        world_size=marker["world_size"],
        metadata=(vdir / ".metadata").read_bytes(),
        checksums=tuple(ItemChecksum(*c) for c in marker["checksums"]),
        file_sizes=marker["file_sizes"],
        job=marker["job"],
        metadata_crc=marker["metadata_crc"],
        health=marker.get("health"),
    )
    marker["manifest_crc"] = checksum(canonical_bytes(m))
    marker_path.write_text(json.dumps(marker))


def test_the_durable_verdict_is_signed_shown_by_ls_and_verify_and_a_forged_one_is_refused(
    tmp_path, capsys, monkeypatch
):
    uri = str(tmp_path / "d")
    config = _config(durable_uri=uri, persist_every=1, keep_durable=3, signing_key="job-secret")
    t, ckpt = _lm(config)
    batches = t.batches()
    for step in range(2):
        _step(t, batches)
        _saved(ckpt, step)
    ckpt.close()
    marker = json.loads((tmp_path / "d" / "step_000000001" / ".gemini_complete").read_text())
    assert marker["health"] == {"status": "healthy", "check": "", "item": "", "detail": "", "rank": None}

    monkeypatch.setenv("GEMINI_CKPT_SIGNING_KEY", "job-secret")
    assert cli(["ls", "--json", uri]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [(r["step"], r["health"]["status"]) for r in rows] == [(0, "healthy"), (1, "healthy")]
    assert cli(["verify", uri, "--step", "1"]) == 0
    assert capsys.readouterr().out.startswith("step 1: ok, healthy (")

    # A writer of the storage directory marks step 1 unhealthy (it could as well mark a bad one healthy).
    def condemn(m):
        m["health"] = {
            "status": "unhealthy",
            "check": "finite",
            "item": "model.head.weight",
            "detail": "forged",
            "rank": 0,
        }

    _reseal_marker(tmp_path / "d" / "step_000000001", condemn)
    assert cli(["verify", uri, "--step", "1"]) == 1
    assert "signature that does not match this signing key" in capsys.readouterr().out
    t2 = build_training(seed=4, dataset_size=32)
    fresh = Checkpointer(
        TrainState(model=t2.model, optimizer=t2.optimizer, scheduler=t2.scheduler),
        _config(durable_uri=uri, signing_key="job-secret"),
    )
    with pytest.warns(UserWarning, match=r"step 1 \(durable\) could not be restored.*does not match this signing key"):
        result = fresh.restore()
    assert (result.step, result.skipped_steps) == (0, (1,))
    fresh.close()

    monkeypatch.delenv("GEMINI_CKPT_SIGNING_KEY")  # without the key, the forged verdict is what ls shows
    assert cli(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "UNHEALTHY" in out and "unhealthy: rank 0: model.head.weight failed the finite check (forged)" in out


# --- issue 40, finding 3: a missing verdict is never a healthy one -----------------------------------
def test_a_store_that_gives_no_verdict_never_makes_a_version_healthy_for_the_trainer_or_for_restore(tmp_path):
    """A store of another gemini_ckpt version (the one the audit ran) takes the shard but neither
    checks it nor passes the trainer's verdict on: its records carry no verdict, its outcome
    says nothing. On main 17f5790 a NaN step saved through it was ``healthy`` on the trainer and
    the restore choice. Now the trainer counts each such version unhealthy (check ``verdict``),
    and restore, which reads the signed plan asking for the finite check beside a record without
    a verdict, never picks one (``restore(step=...)`` still loads it, with a warning). A store
    that does check (the same tier, verdicts kept) makes the same versions healthy and NaN-free."""
    import dataclasses

    from dir_tier import DirTier

    class UncheckingStore(DirTier):
        def record(self, step, plan, segment, blobs, verdict):  # checks nothing, passes no verdict on
            return super().record(step, dataclasses.replace(plan, checked=()), segment, blobs, None)

    def run(store_cls, root):
        model = nn.Linear(8, 4)
        ckpt = Checkpointer(
            TrainState(model=model), CheckpointConfig(store="local"), store=store_cls(str(root), rank=0, world_size=1)
        )
        verdicts = [_saved(ckpt, 0).health.result()]
        with torch.no_grad():
            model.weight.view(-1)[5] = math.nan
        verdicts.append(_saved(ckpt, 1).health.result())
        ckpt.close()
        fresh = nn.Linear(8, 4)
        again = Checkpointer(
            TrainState(model=fresh), CheckpointConfig(store="local"), store=store_cls(str(root), rank=0, world_size=1)
        )
        return verdicts, again, fresh

    verdicts, again, fresh = run(DirTier, tmp_path / "checking")
    assert [v.status for v in verdicts] == ["healthy", "unhealthy"] and verdicts[1].check == "finite"
    assert again.restore().step == 0 and torch.isfinite(fresh.weight).all()
    again.close()

    verdicts, again, fresh = run(UncheckingStore, tmp_path / "unchecking")
    assert [(v.status, v.check) for v in verdicts] == [("unhealthy", "verdict")] * 2
    assert "did not say that every shard carries a verdict" in verdicts[1].reason
    with pytest.raises(
        UnhealthyVersionError,
        match="its record carries no verdict, though its plan asks for the finite check of 2 items",
    ):
        again.restore()
    assert torch.isfinite(fresh.weight).all()
    with pytest.warns(UnhealthyRestoreWarning):
        assert again.restore(step=1).step == 1  # on purpose, by name
    assert not torch.isfinite(fresh.weight).all()
    again.close()
