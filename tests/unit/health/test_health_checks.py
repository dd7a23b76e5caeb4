"""What makes a version unhealthy: the finite check of every tensor (parameters in
every float format, items many chunks long, buffers when asked, optimizer state and
hyperparameters), ``health_check=None``, and the checks on the trainer: metrics, loss spikes, a
user validator; health settings are checked when made. Single process, ``store="local"``.
"""

from __future__ import annotations

import math

import crc32c
import numpy as np
import pytest
import torch
from torch import nn

from gemini_ckpt import CheckpointConfig, Checkpointer, ConfigError, HealthCheck, TrainState
from gemini_ckpt.health import Finite, NoSpike
from gemini_ckpt.format.finite import CHUNK, checksum_items
from health_support import job_config, toy_lm, save_committed, train_step

FINITE = "failed the finite check"


# --- the tensor check ------------------------------------------------------------------------------
def _bits_16(dtype: torch.dtype, kind: str) -> torch.Tensor:
    top = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}[dtype]
    value = {"nan": top | 1, "+inf": top, "-inf": 0x8000 | top}[kind]
    return torch.from_numpy(np.array([value], np.uint16).view(np.int16)).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nan", "+inf", "-inf"])
def test_a_parameter_that_is_not_finite_makes_the_version_unhealthy_in_every_float_format(dtype, kind):
    model = nn.Linear(8, 4).to(dtype)
    ckpt = Checkpointer(TrainState(model=model), job_config())
    assert save_committed(ckpt, 0).health.result().status == "healthy"
    with torch.no_grad():
        if dtype in (torch.float16, torch.bfloat16):  # the exact bits, so no conversion can hide them
            model.weight.view(-1)[13] = _bits_16(dtype, kind)[0]
        else:
            model.weight.view(-1)[13] = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}[kind]
    health = save_committed(ckpt, 1).health.result()
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
    t, ckpt = toy_lm(job_config())
    assert save_committed(ckpt, 0).health.result().status == "healthy"
    ckpt.close()
    t, ckpt = toy_lm(job_config(health_check=HealthCheck(buffers=True)))
    health = save_committed(ckpt, 0).health.result()
    assert (health.status, health.item) == ("unhealthy", "model.mask")
    assert health.detail.startswith("120 -Inf of 256 values")
    ckpt.close()


def test_optimizer_state_is_checked_and_each_check_can_be_turned_off():
    t, ckpt = toy_lm(job_config())
    batches = t.batches()
    train_step(t, batches)
    param = t.model.head.weight
    t.optimizer.state[param]["exp_avg_sq"].view(-1)[5] = math.inf
    health = save_committed(ckpt, 0).health.result()
    assert (health.status, health.check, health.item) == ("unhealthy", "finite", "optim.state.head.weight.exp_avg_sq")
    ckpt.close()

    t, ckpt = toy_lm(job_config(health_check=HealthCheck(optimizer_state=False)))
    train_step(t, t.batches())
    t.optimizer.state[t.model.head.weight]["exp_avg"].view(-1)[0] = math.nan
    assert save_committed(ckpt, 0).health.result().status == "healthy"
    with torch.no_grad():
        t.model.head.bias[0] = math.nan
    assert save_committed(ckpt, 1).health.result().item == "model.head.bias"
    ckpt.close()


def test_a_non_finite_optimizer_hyperparameter_makes_the_version_unhealthy_and_it_is_not_restored():
    """A NaN learning rate (float or tensor) or an infinite weight decay lives in param_groups,
    not in the state tensors; one more step makes every parameter non-finite."""
    t, ckpt = toy_lm(job_config())
    batches = t.batches()
    train_step(t, batches)
    assert save_committed(ckpt, 0).health.result().status == "healthy"
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
        health = save_committed(ckpt, step).health.result()
        assert (health.status, health.check, health.item, health.detail) == (
            "unhealthy",
            "finite",
            f"optim.param_groups.0.{key}",
            detail,
        )
        group["lr"], group["weight_decay"] = lr, wd
    group["betas"] = (0.9, math.nan)
    assert save_committed(ckpt, 4).health.result().item == "optim.param_groups.0.betas"
    group["betas"] = (0.9, 0.999)
    assert ckpt.restore().step == 0  # the newest healthy version, not 1-4
    assert group["lr"] == lr and math.isfinite(group["betas"][1])
    ckpt.close()

    t, ckpt = toy_lm(job_config(health_check=HealthCheck(optimizer_state=False)))
    t.optimizer.param_groups[0]["lr"] = math.nan
    assert save_committed(ckpt, 0).health.result().status == "healthy"  # the switch covers it
    ckpt.close()


def test_health_check_none_checks_nothing_and_says_so():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    ckpt = Checkpointer(TrainState(model=model), job_config(health_check=None))
    handle = save_committed(ckpt, 0, metrics={"loss": math.nan})
    assert handle.health.result().status == "unchecked"
    assert ckpt.restore().step == 0  # unchecked versions count as healthy
    ckpt.close()


# --- checks on the trainer: metrics and a validator ------------------------------------------------
def test_a_metric_that_is_not_finite_makes_the_version_unhealthy():
    ckpt = Checkpointer(
        TrainState(model=nn.Linear(4, 4)), job_config(health_check=HealthCheck(metrics=(Finite(metric="loss"),)))
    )
    assert save_committed(ckpt, 0, metrics={"loss": 2.5}).health.result().status == "healthy"
    assert save_committed(ckpt, 1).health.result().status == "healthy"  # a save that reports no loss is not judged
    health = save_committed(ckpt, 2, metrics={"loss": math.inf, "lr": 0.1}).health.result()
    assert (health.status, health.check, health.item, health.detail) == ("unhealthy", "metric", "loss", "loss is inf")
    with pytest.raises(ValueError, match="metric 'loss' is 'abc', not a number"):
        ckpt.save(3, metrics={"loss": "abc"})
    ckpt.close()


def test_a_loss_spike_beyond_k_times_its_running_median_makes_the_version_unhealthy():
    spike = NoSpike(metric="loss", factor=3.0, window=4, min_history=3)
    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), job_config(health_check=HealthCheck(metrics=(spike,))))
    losses = [9.0, 1.0, 1.2, 1.0, 4.0, 12.0, 1.1, 3.5]
    statuses = [save_committed(ckpt, s, metrics={"loss": v}).health.result() for s, v in enumerate(losses)]
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

    ckpt = Checkpointer(TrainState(model=nn.Linear(4, 4)), job_config(health_check=HealthCheck(validator=validator)))
    assert save_committed(ckpt, 0, metrics={"acc": 0.9}).health.result().status == "healthy"
    health = save_committed(ckpt, 1, metrics={"acc": 0.4}).health.result()
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
        job_config(health_check=HealthCheck(validator=lambda step, state, metrics: False)),
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
