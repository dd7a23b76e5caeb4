"""Lightning + ``GeminiCallback``: a ``fit()`` that crashes at step k, rebuilt from scratch with
other seeds and ``fit()`` again, continues bit-identically to an uninterrupted ``fit()``; and
what cannot be exact is refused. CPU, one process, ``store="local"``."""

from __future__ import annotations

import datetime
import gc
import math
import uuid

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from gemini_ckpt import CheckpointConfig, ConfigError  # noqa: E402
from gemini_ckpt.integrations.lightning import GeminiCallback  # noqa: E402

N, BATCH = 24, 4  # 6 batches an epoch


class _Data(torch.utils.data.Dataset):
    """Fixed data, whatever the run's seed."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class _Stream(torch.utils.data.IterableDataset):
    """The same samples, unsized: Lightning's fetcher takes a batch ahead."""

    def __init__(self) -> None:
        self.data = _Data()

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


class _Net(pl.LightningModule):
    def __init__(self, *, one_cycle: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        self.one_cycle = one_cycle

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.one_cycle:  # asks for the loaders before fit starts (Lightning#20550)
            sched = torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=0.05, total_steps=self.trainer.estimated_stepping_batches
            )
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: dict[tuple[int, int], float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[(trainer.current_epoch, trainer.fit_loop.epoch_loop.total_batch_idx)] = outputs["loss"].item()


class _Crash(pl.Callback):
    """Raises at the first batch after step ``at`` is saved and committed."""

    def __init__(self, gemini: GeminiCallback, at: int) -> None:
        self.gemini, self.at = gemini, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.at:
            self.gemini.checkpointer.wait()
            raise RuntimeError("crash")


def _loader(kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "iterable":
        return StatefulDataLoader(_Stream(), batch_size=BATCH)
    if kind == "wrapped":  # what Lightning makes of StatefulDataLoader(shuffle=True) under DDP
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

        sampler = DistributedSamplerWrapper(
            torch.utils.data.RandomSampler(_Data(), generator=gen), num_replicas=1, rank=0, shuffle=False
        )
        return StatefulDataLoader(_Data(), batch_size=BATCH, sampler=sampler)
    if kind == "plain":
        return torch.utils.data.DataLoader(_Data(), batch_size=BATCH, shuffle=True, generator=gen)
    if kind == "workers":
        return StatefulDataLoader(_Data(), batch_size=BATCH, shuffle=True, num_workers=2, generator=gen)
    return StatefulDataLoader(_Data(), batch_size=BATCH, shuffle=True)  # draws from the global RNG


def _fit(
    ns: str,
    seed: int,
    *,
    crash_at=None,
    loader="stateful",
    epochs=3,
    accumulate=1,
    val=None,
    one_cycle=False,
    ckpt_path=None,
    extra_callbacks=(),
):
    torch.manual_seed(seed)
    model = _Net(one_cycle=one_cycle)
    gemini = GeminiCallback(CheckpointConfig(store="local", namespace=ns, keep_in_memory=2))
    record = _Record()
    callbacks = [gemini, record, *extra_callbacks] + ([_Crash(gemini, crash_at)] if crash_at is not None else [])
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        accumulate_grad_batches=accumulate,
        val_check_interval=val,
        limit_val_batches=2 if val is not None else 0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
    )
    val_loader = torch.utils.data.DataLoader(_Data(8), batch_size=BATCH) if val is not None else None
    try:
        trainer.fit(model, train_dataloaders=_loader(loader, seed), val_dataloaders=val_loader, ckpt_path=ckpt_path)
    finally:
        if loader == "workers":
            # Lightning's teardown drops a StatefulDataLoader's iterator without stopping its
            # workers (it only stops torch's own class): stop them before the next run forks
            # (which would copy their pipes, and each would then take seconds to join).
            gc.collect()
    return trainer, model, gemini, record


def _crash(ns: str, seed: int, at: int, **opts) -> None:
    """A run that raises after step ``at`` is committed."""
    try:
        _fit(ns, seed, crash_at=at, **opts)
    except RuntimeError as exc:
        assert str(exc) == "crash"
    else:
        pytest.fail("the run did not crash")


def _ns() -> str:
    return f"lightning-{uuid.uuid4().hex[:10]}"


CASES = {  # name: (crash after step, fit options)
    "mid-epoch": (8, {}),
    "epoch-boundary": (6, {}),
    "accumulate": (4, {"accumulate": 2}),
    "validation-on-save-step": (3, {"val": 3}),
    "workers": (8, {"loader": "workers", "epochs": 2}),
    "iterable-prefetch": (8, {"loader": "iterable"}),
    "estimated-stepping-batches": (8, {"one_cycle": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_after_a_crash_is_bit_identical(case):
    k, opts = CASES[case]
    ref_trainer, ref_model, _, ref = _fit(_ns(), 0, **opts)

    ns = _ns()
    _crash(ns, 0, k, **opts)
    trainer, model, gemini, got = _fit(ns, 777, **opts)  # everything rebuilt, other seeds

    assert gemini.restored is not None and gemini.restored.step == k
    assert gemini.restored.source == "memory"
    resumed = sorted(got.losses)
    assert resumed and resumed[0][1] == k * opts.get("accumulate", 1)  # the batch after step k's
    assert {key: ref.losses[key] for key in resumed} == got.losses
    assert len(ref.losses) == len(resumed) + k * opts.get("accumulate", 1)
    assert trainer.global_step == ref_trainer.global_step
    assert trainer.current_epoch == ref_trainer.current_epoch
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == ref_trainer.fit_loop.epoch_loop._batches_that_stepped
    for (na, pa), (nb, pb) in zip(ref_model.named_parameters(), model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = ref_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]  # the learning rate included
    for idx, entry in sa["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, sb["state"][idx][name]), (idx, name)
    sched = (ref_trainer.lr_scheduler_configs[0].scheduler, trainer.lr_scheduler_configs[0].scheduler)
    assert sched[0].state_dict() == sched[1].state_dict()
    assert ref_trainer.fit_loop.state_dict()["epoch_progress"] == trainer.fit_loop.state_dict()["epoch_progress"]


# --- what cannot be exact is refused ------------------------------------------------------------------
def test_a_plain_dataloader_resumed_mid_epoch_is_refused():
    ns = _ns()
    _crash(ns, 0, 3, loader="plain", epochs=1)
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        _fit(ns, 1, loader="plain", epochs=1)


def test_a_wrapped_sampler_resumed_mid_epoch_is_refused():
    ns = _ns()
    _crash(ns, 0, 3, loader="wrapped", epochs=1)
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        _fit(ns, 1, loader="wrapped", epochs=1)


def test_a_plain_dataloader_resumed_at_an_epoch_end_is_exact():
    ref = _fit(_ns(), 0, loader="plain", epochs=2)[3]
    ns = _ns()
    _crash(ns, 0, 6, loader="plain", epochs=2)
    got = _fit(ns, 1, loader="plain", epochs=2)[3]
    assert got.losses and {key: ref.losses[key] for key in got.losses} == got.losses


def test_ckpt_path_together_with_a_gemini_version_is_refused(tmp_path):
    ns = _ns()
    trainer = _fit(ns, 0, epochs=1)[0]
    path = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(ConfigError, match="without ckpt_path"):
        _fit(ns, 0, epochs=2, ckpt_path=path)


def test_ray_train_report_callback_is_refused():
    lightning_utils = pytest.importorskip("ray.train.lightning")
    reporter = lightning_utils.RayTrainReportCallback.__new__(lightning_utils.RayTrainReportCallback)
    with pytest.raises(ConfigError, match="remove RayTrainReportCallback"):
        _fit(_ns(), 0, epochs=1, extra_callbacks=[reporter])


def test_a_time_based_validation_interval_is_refused():
    with pytest.raises(ConfigError, match="val_check_interval"):
        _fit(_ns(), 0, epochs=1, val=datetime.timedelta(minutes=5))


def test_every_n_steps_saves_only_those_steps():
    ns = _ns()
    gemini = _fit(ns, 0, epochs=1, accumulate=2)[2]  # 3 optimizer steps
    assert gemini.checkpointer.closed
    gemini2 = GeminiCallback(CheckpointConfig(store="local", namespace=_ns(), keep_in_memory=5), every_n_steps=2)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[gemini2],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(_Net(), train_dataloaders=_loader("stateful", 0))
    assert gemini2.checkpointer.store.committed_steps() == [2, 4, 6]
    assert math.isfinite(gemini2.last_handle.step)
