"""PyTorch Lightning integration: one callback checkpoints every step in memory, and ``fit()`` resumes by itself.

Example::

    from gemini_ckpt import CheckpointConfig
    from gemini_ckpt.integrations.lightning import GeminiCallback

    trainer = Trainer(max_steps=1000, callbacks=[GeminiCallback(CheckpointConfig(replicas=2, persist_every=100))])
    trainer.fit(model, datamodule=dm)      # no ckpt_path: resumes from the newest version, if there is one

**What a version holds** (its step is ``trainer.global_step``): the LightningModule and the
optimizers (as a :class:`~gemini_ckpt.TrainState`), the LR schedulers, the precision plugin's
state (the gradient scaler), ``trainer.fit_loop.state_dict()`` (progress counters and the train
loaders' ``state_dict()``, e.g. torchdata's ``StatefulDataLoader``), every callback's
``state_dict()`` by ``state_key``, the datamodule's ``state_dict()`` and this process's random
number generators (Python, NumPy, torch CPU and CUDA).

**When it saves**: in ``on_train_batch_end`` after a batch that stepped the optimizers (never
in the middle of gradient accumulation) when ``global_step % every_n_steps == 0``; when
validation runs right after that batch, in ``on_validation_end`` instead (as ``ModelCheckpoint``
does), so the version includes what validation did.

**Where it restores**: model, optimizers, schedulers, precision, loops, callbacks and datamodule
in ``on_fit_start`` (the strategy has wrapped the model and created the optimizers); the data
position when the train loader is built (before its first ``iter()``); the random number
generators in ``on_train_start`` after a save in the middle of an epoch, or right before the
next epoch's iterator is created after a save at an epoch's last batch, which is where an
uninterrupted run has them.

**Guarantee.** After a restart (a new process, the model and trainer rebuilt, any seeds), the
resumed ``fit()`` continues bit-identically: every later loss, the final parameters, optimizer
states, learning rates, ``global_step`` and epoch counters equal an uninterrupted run's, when

- the train loader is resumable: a ``StatefulDataLoader`` (a plain ``DataLoader`` is refused
  when the version is in the middle of an epoch: Lightning would restart the epoch), or any
  loader when the version is at an epoch's end;
- under DDP, its shuffle is a ``DistributedSampler`` (seeded by seed and epoch): give the loader
  one and pass ``Trainer(use_distributed_sampler=False)``. A ``StatefulDataLoader(shuffle=True)``
  otherwise gets Lightning's ``DistributedSamplerWrapper`` around torchdata's own sampler, whose
  shuffle is seeded from the global RNG when the loader is built and is in no state dict
  (refused when the version is in the middle of an epoch);
- an iterable (unsized) loader: Lightning fetches one batch ahead, so the loader's own state is
  one batch ahead of training; the version keeps that prefetched batch and the resumed run
  trains on it first (``ModelCheckpoint`` skips it);
- nothing draws random numbers at a point only one of the two runs passes: ``on_fit_start`` /
  ``on_train_start`` hooks, ``train_dataloader()``, the main process's data loading of an
  iterable dataset (``num_workers=0``), a shuffled validation loader's construction;
- kernels are deterministic, and under DDP ``find_unused_parameters=True`` on gloo;
- ``val_check_interval`` is a number of batches or a fraction of an epoch, not a time (refused).

Not identical in any case: metrics logged with ``on_epoch=True`` after a resume in the middle of
an epoch (Lightning keeps no accumulated metric in any checkpoint), and the
``on_train_epoch_end`` hooks of the epoch a version ended (Lightning's restart skips them).
``LightningModule.on_save_checkpoint``/``on_load_checkpoint`` are not called (they expect
Lightning's whole checkpoint dict); keep such state in a callback's ``state_dict``.

**Refused, with the fix in the message**: ``fit(ckpt_path=...)`` while the namespace holds a
version; Ray's ``RayTrainReportCallback`` next to this callback (gemini's checkpointer reports
persisted versions to Ray Train itself); a time-based ``val_check_interval``.

Under Ray Train (inside a ``TorchTrainer`` worker) the checkpointer is
:func:`gemini_ckpt.integrations.ray_train.checkpointer` (namespace and durable location from the
run, persisted versions reported to Ray Train); elsewhere a plain :class:`~gemini_ckpt.Checkpointer`.

The Lightning internals this relies on are in one adapter, :mod:`._lightning_loops` (Lightning
2.6; other versions warn once).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

try:  # the namespace Ray Train's Lightning utilities pick (ray/train/lightning/_lightning_utils.py)
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl

from ..checkpointer import Checkpointer
from ..config import CheckpointConfig
from ..errors import CheckpointError, ConfigError
from ..results import RestoreResult, SaveHandle
from ..state.loader import fix_resume
from ..state.train_state import TrainState
from ._lightning_loops import Loops, generator_states, generators, set_epoch, stateful, wraps_a_sampler
from ._worker import checkpointer_here

__all__ = ["GeminiCallback"]

log = logging.getLogger("gemini_ckpt")

_KEY = "lightning"


class GeminiCallback(pl.Callback):
    """Checkpoint a Lightning ``fit()`` every ``every_n_steps`` optimizer steps into memory
    (and to durable storage as ``config`` says); a later ``fit()`` without ``ckpt_path``
    resumes from the newest version (see the module docstring for what is exact, and when).

    Example::

        ckpt = GeminiCallback(CheckpointConfig(store="local", keep_in_memory=2))
        trainer = Trainer(max_epochs=3, callbacks=[ckpt])
        trainer.fit(model, train_dataloaders=StatefulDataLoader(ds, batch_size=8, shuffle=True))
        ckpt.restored                  # the RestoreResult of this fit(), None on a fresh start

    One instance per ``Trainer``; each ``fit()`` opens its own checkpointer and closes it when
    ``fit()`` ends (aborts it when ``fit()`` raises).
    """

    def __init__(self, config: CheckpointConfig, *, every_n_steps: int = 1) -> None:
        if not isinstance(config, CheckpointConfig):
            raise TypeError(
                f"GeminiCallback(config=...) must be a gemini_ckpt.CheckpointConfig, got {type(config).__name__}"
            )
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ConfigError(f"GeminiCallback(every_n_steps={every_n_steps!r}): a positive int (optimizer steps)")
        self.config = config
        self.every_n_steps = every_n_steps
        self._ckpt: Optional[Checkpointer] = None
        self._extra: dict = {}
        self._restored: Optional[RestoreResult] = None
        self._resume: Optional[_Resume] = None
        self._step_before = 0
        self._deferred: Optional[int] = None
        self._last_saved = -1
        self._last_loss: Optional[float] = None
        self.last_handle: Optional[SaveHandle] = None

    # --- what users read ------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Optional[Checkpointer]:
        """This ``fit()``'s checkpointer (None before ``on_fit_start``)."""
        return self._ckpt

    @property
    def restored(self) -> Optional[RestoreResult]:
        """What this ``fit()`` resumed from; None on a fresh start."""
        return self._restored

    # --- fit start: refuse what cannot be exact, then restore -----------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        for cb in trainer.callbacks:
            if any(c.__name__ == "RayTrainReportCallback" for c in type(cb).__mro__):
                raise ConfigError(
                    "GeminiCallback and Ray's RayTrainReportCallback are both in Trainer(callbacks=...): remove "
                    "RayTrainReportCallback. gemini_ckpt's checkpointer reports every persisted version to Ray "
                    "Train itself (CheckpointConfig.persist_every); two reporters would pair up differently on "
                    "different ranks"
                )
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            raise ConfigError(
                "GeminiCallback: Trainer(val_check_interval=...) is a time; whether validation follows a step is "
                "then decided by the clock, so the save cannot be placed after it reproducibly. Use a number of "
                "batches (int) or a fraction of an epoch (float)"
            )
        Loops.check_version()

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._restored, self._resume, self._deferred, self._last_saved = None, None, None, -1
        self._extra = {}
        state = TrainState(
            model=pl_module,
            optimizer=list(trainer.optimizers),
            scheduler=[c.scheduler for c in trainer.lr_scheduler_configs],
            scaler=trainer.precision_plugin,
            extra=self._extra,
        )
        self._ckpt = checkpointer_here(state, self.config)
        if trainer.ckpt_path is not None:
            peeked = self._ckpt.peek()
            if peeked is not None:
                raise self._both_error(trainer, peeked.step)
        result = self._ckpt.restore(rng=False)
        self._step_before = trainer.global_step
        if result is None:
            return
        saved = self._extra.get(_KEY)
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"step {result.step} of namespace {self.config.resolved_namespace!r} was not "
                f"saved by GeminiCallback (no Lightning state in it); use another namespace"
            )
        self._restored = result
        loops = Loops(trainer)
        trainer.fit_loop.load_state_dict(saved["fit_loop"])
        if trainer.max_epochs not in (None, -1) and trainer.current_epoch > trainer.max_epochs:
            raise ConfigError(
                f"GeminiCallback restored step {result.step} at current_epoch={trainer.current_epoch}, "
                f"but Trainer(max_epochs={trainer.max_epochs}); raise max_epochs or use a new namespace"
            )
        states = saved["callbacks"]
        for cb in trainer.callbacks:
            if cb is not self and cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
        if trainer.datamodule is not None and saved["datamodule"] is not None:
            trainer.datamodule.load_state_dict(saved["datamodule"])
        self._step_before = trainer.global_step
        self._resume = _Resume(result, saved, loops)
        self._resume.arrange()

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.ckpt_path is not None and self._restored is not None:
            # strategies that restore after setup (FSDP, DeepSpeed) loaded the file after on_fit_start
            raise self._both_error(trainer, self._restored.step)
        if self._resume is not None:
            self._resume.at_train_start()
        self._step_before = trainer.global_step

    # --- saving -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._deferred is not None:
            log.warning(
                "GeminiCallback: the version of step %d waited for a validation that did not run; not saved",
                self._deferred,
            )
            self._deferred = None
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._last_loss = float(loss.detach())
        step = trainer.global_step
        if step == self._step_before or step % self.every_n_steps != 0 or step <= self._last_saved:
            return  # no optimizer step in this batch (accumulating), or not a save step
        if Loops(trainer).validation_follows():
            self._deferred = step
            return
        self._save(trainer, step)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._deferred is not None and not trainer.sanity_checking:
            step, self._deferred = self._deferred, None
            self._save(trainer, step)

    def _save(self, trainer: "pl.Trainer", step: int) -> None:
        loops = Loops(trainer)
        self._extra.clear()
        self._extra[_KEY] = {
            "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb is not self},
            "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else None,
            "generators": [generator_states(dl) for dl in loops.train_loaders()],
            "prefetched": loops.prefetched(),
            "epoch_end": loops.epoch_ends_here(),
        }
        metrics = {"loss": self._last_loss} if self._last_loss is not None else None
        self.last_handle = self._ckpt.save(step, metrics=metrics)
        self._last_saved = step

    # --- the end ----------------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._ckpt is not None and not self._ckpt.closed:
            self._ckpt.abort()
        if self._resume is not None:
            self._resume.loops.unpatch()

    def _close(self) -> None:
        if self._resume is not None:
            self._resume.loops.unpatch()
        if self._ckpt is not None and not self._ckpt.closed:
            self._ckpt.close()

    def _both_error(self, trainer: "pl.Trainer", step: int) -> ConfigError:
        return ConfigError(
            f"fit(ckpt_path={trainer.ckpt_path!r}) and GeminiCallback's version {step} of namespace "
            f"{self.config.resolved_namespace!r} would both be loaded. To resume from gemini_ckpt's newest version, "
            f"call fit() without ckpt_path; to start from the file, give CheckpointConfig a new namespace"
        )


class _Resume:
    """One restore's remaining work: the data position and the random number generators, each
    put back where an uninterrupted run has them."""

    def __init__(self, result: RestoreResult, saved: dict, loops: "Loops") -> None:
        self.result, self.saved, self.loops = result, saved, loops
        self.epoch_end = bool(saved["epoch_end"])
        self.rng_applied = False

    def arrange(self) -> None:
        """In ``on_fit_start``: the loaders' states are loaded where the fit loop would load
        them, or now, when the loaders exist already (``configure_optimizers`` asked for
        ``trainer.estimated_stepping_batches``, which builds them early, and the fit loop then
        never loads their states; docs/integrations.md)."""
        if self.loops.combined_loader() is None:
            self.loops.patch_loader_loading(self.load_loaders)
        else:
            self.load_loaders(existing=True)

    def load_loaders(self, existing: bool = False) -> None:
        loops, saved = self.loops, self.saved
        loaders = loops.train_loaders()
        epoch = loops.epoch_index() + (1 if self.epoch_end else 0)
        for dl in loaders:
            set_epoch(dl, epoch)  # the fit loop sets it only after this iterator exists
        if self.epoch_end:
            # The next epoch starts with a fresh iterator, as in an uninterrupted run: its draws
            # (shuffle, workers' base seed) must come from the saved generators, so no loader
            # state (it says "finished") and the RNG now, before the iterator is created.
            loops.drop_loader_states()
            for dl, states in zip(loaders, saved["generators"], strict=True):
                for name, gen in generators(dl).items():
                    if name in states:
                        gen.set_state(states[name])
            self.result.apply_rng()
            self.rng_applied = True
        else:
            plain = [type(dl).__name__ for dl in loaders if not stateful(dl)]
            if plain:
                raise ConfigError(
                    f"GeminiCallback restored step {self.result.step}, in the middle of an epoch, but the train "
                    f"loader ({', '.join(plain)}) cannot resume there: Lightning would start the epoch again and "
                    f"train on its first batches twice. Use torchdata's StatefulDataLoader (a drop-in "
                    f"replacement for DataLoader), or save only at epoch ends (every_n_steps = steps per epoch)"
                )
            wrapped = [type(dl).__name__ for dl in loaders if wraps_a_sampler(dl)]
            if wrapped:
                raise ConfigError(
                    f"GeminiCallback restored step {self.result.step}, in the middle of an epoch, but the train "
                    f"loader ({', '.join(wrapped)}) has Lightning's DistributedSamplerWrapper around its own sampler "
                    f"(a StatefulDataLoader(shuffle=True) under DDP gets one): the wrapped sampler's shuffle is not "
                    f"part of the loader's state, so the resumed run would read other samples. Give the loader a "
                    f"torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=...) yourself and pass "
                    f"Trainer(use_distributed_sampler=False)"
                )
            loops.load_loader_states()
            for dl, states in zip(loaders, saved["generators"], strict=True):
                # the resuming iterator leaves the loader's generator and the global RNG as saved
                fix_resume(dl, states.get("generator"))
        if existing:
            loops.iterate_again()

    def at_train_start(self) -> None:
        self.loops.unpatch()
        if self.epoch_end:
            self.loops.start_next_epoch_afresh()
        else:
            self.loops.hand_back_prefetched(self.saved["prefetched"])
        if not self.rng_applied:
            self.result.apply_rng()
            self.rng_applied = True
