"""Hugging Face ``Trainer``: every ``save_steps`` into peer memory, and ``train()`` resumes from the
newest version by itself, with one line.

Example::

    from gemini_ckpt import CheckpointConfig
    from gemini_ckpt.integrations import hf as ghf

    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="steps", save_steps=1),
                      train_dataset=ds, data_collator=collate)
    trainer = ghf.prepare_trainer(trainer, CheckpointConfig(replicas=2, persist_every=100))
    trainer.train()          # after a crash or a Ray Train restart: resumes from memory

How: as Ray's own ``prepare_trainer`` does, the trainer's class is swapped for a subclass (either
order composes with Ray's). ``_save_checkpoint`` (which the Trainer calls every ``save_steps``,
after logging and evaluation, on every rank) saves the model, optimizer, scheduler, scaler, every
rank's RNG, the ``TrainerState`` and the logging accumulators as one version, and writes no
directory (``hf_checkpoints=True`` writes Hugging Face's as well). ``train()`` peeks at the newest
restorable version, hands its ``TrainerState`` to the Trainer as a ``resume_from_checkpoint``
directory holding only ``trainer_state.json`` (so the Trainer computes its own data skip and
restores its stateful callbacks), and loads the rest once the Trainer created its optimizer.
The Trainer's private hooks are named in one place, checked against the installed version.

Exact (every later logged loss, parameters, optimizer, LR, ``TrainerState``) when: the same world
size, arguments and seed; a map-style dataset through the Trainer's seedable sampler (or a
sequential one); nothing in the data path draws random numbers (a masking collator: from a
generator of its own, in loader workers, or, mid-epoch, for the first resumed batch, which the
Trainer fetches before it puts the RNG back); deterministic kernels; DDP with
``ddp_find_unused_parameters=True``. Dropout and everything else drawn in the training step are
exact: every rank's RNG is put back at the Trainer's own points. Better than the Trainer's own
resume: the logging accumulators are restored, so the first logged loss after a resume is the
uninterrupted run's (the Trainer's averages over a shorter window). The run summary's
``train_loss`` averages the steps of this ``train()`` call, as after the Trainer's own resume.
``log_history`` is bounded in each version to its newest ``keep_log_history`` entries.
Refused: DeepSpeed, ``ignore_data_skip``, ``train_sampling_strategy="group_by_length"``,
``load_best_model_at_end`` without ``hf_checkpoints=True``, Ray's ``RayTrainReportCallback``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import warnings
from typing import Any, Optional

from ..checkpointer import Checkpointer
from ..config import CheckpointConfig
from ..errors import CheckpointError, ConfigError
from ..results import RestoreResult
from ..state.train_state import TrainState
from ._worker import checkpointer_here

log = logging.getLogger("gemini_ckpt")

__all__ = ["GeminiTrainerMixin", "prepare_trainer"]

SUPPORTED = ((5, 0), (6, 0))  # transformers versions whose private hooks below were read (5.23, 5.25)
HOOKS = (
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_inner_training_loop",
    "store_flos",
)
MARKER = ".gemini_ckpt"  # in a resume directory we made: the Trainer reads only its trainer_state.json


def prepare_trainer(
    trainer, config: Optional[CheckpointConfig] = None, *, hf_checkpoints: bool = False, keep_log_history: int = 1000
):
    """Make ``trainer`` (a ``transformers.Trainer``) checkpoint into gemini_ckpt and resume from it.

    ``config``: where versions go (``store="local"`` in one process; host stores on Ray);
    inside a Ray Train worker the Checkpointer also reports durable versions to Ray Train.
    ``hf_checkpoints``: also write Hugging Face's checkpoint directories at ``save_steps``.
    ``keep_log_history``: the newest entries of ``TrainerState.log_history`` kept in each version
    (its size is bounded; a resumed run's history starts with these). Returns ``trainer``."""
    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    missing = [h for h in HOOKS if not callable(getattr(transformers.Trainer, h, None))]
    if not SUPPORTED[0] <= version < SUPPORTED[1] or missing:
        raise CheckpointError(
            f"gemini_ckpt.integrations.hf supports transformers 5.x, whose Trainer has "
            f"{', '.join(HOOKS)}; this is {transformers.__version__}"
            + (f" (missing: {', '.join(missing)})" if missing else "")
        )
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"prepare_trainer() needs a transformers.Trainer, got {type(trainer).__name__}")
    if isinstance(trainer, GeminiTrainerMixin):
        raise CheckpointError("prepare_trainer() was already applied to this trainer")
    if isinstance(keep_log_history, bool) or not isinstance(keep_log_history, int) or keep_log_history < 1:
        raise ConfigError(f"prepare_trainer(keep_log_history=...) must be a positive int, got {keep_log_history!r}")
    config = config if config is not None else CheckpointConfig()
    _refuse(trainer, hf_checkpoints)
    cls = trainer.__class__
    trainer.__class__ = type(f"Gemini{cls.__name__}", (GeminiTrainerMixin, cls), {})
    trainer._gemini = _Run(config, hf_checkpoints=hf_checkpoints, keep_log_history=keep_log_history)
    trainer.add_callback(_accumulators_callback(trainer))
    return trainer


def _refuse(trainer, hf_checkpoints: bool) -> None:
    args = trainer.args
    if trainer.is_deepspeed_enabled:
        raise ConfigError(
            "gemini_ckpt does not checkpoint DeepSpeed engines (their ZeRO state is not reachable "
            "through torch.distributed.checkpoint); use FSDP or DDP, or DeepSpeed's own checkpoints"
        )
    if args.ignore_data_skip:
        raise ConfigError(
            "TrainingArguments(ignore_data_skip=True) restarts the resumed epoch from its first "
            "batch, which cannot be resumed exactly; leave it False with gemini_ckpt"
        )
    if getattr(args, "train_sampling_strategy", None) == "group_by_length" or getattr(args, "group_by_length", False):
        raise ConfigError(
            "train_sampling_strategy='group_by_length' shuffles from the global random generator when "
            "an epoch starts, so a resumed epoch's order differs; use the default 'random' sampler"
        )
    if args.load_best_model_at_end and not hf_checkpoints:
        raise ConfigError(
            "TrainingArguments(load_best_model_at_end=True) loads a Hugging Face checkpoint "
            "directory; pass prepare_trainer(..., hf_checkpoints=True) to write them as well"
        )
    for cb in trainer.callback_handler.callbacks:
        if type(cb).__name__ == "RayTrainReportCallback":
            raise ConfigError(
                "remove Ray's RayTrainReportCallback from the Trainer's callbacks: gemini_ckpt reports "
                "its durable versions to Ray Train itself (two reporters would pair up differently "
                "on different ranks)"
            )
    collator = trainer.data_collator
    if type(collator).__name__ == "DataCollatorForLanguageModeling" and getattr(collator, "mlm", False):
        if getattr(collator, "seed", None) is not None or args.dataloader_num_workers > 0:
            warnings.warn(
                "the MLM collator draws its masks from a generator of its own (seed=...) or in loader "
                "worker processes; neither is checkpointed, so the masks after a resume differ from an "
                "uninterrupted run's (the rest is restored exactly)",
                stacklevel=3,
            )


class _Run:
    """One prepared trainer's checkpointing: its config, and per ``train()`` call the Checkpointer,
    the version being resumed and its RNG, not yet applied."""

    def __init__(self, config: CheckpointConfig, *, hf_checkpoints: bool, keep_log_history: int) -> None:
        self.config, self.hf_checkpoints, self.keep_log_history = config, hf_checkpoints, keep_log_history
        self.ckpt: Optional[Checkpointer] = None
        self.state: Optional[TrainState] = None
        self.extra: dict = {}
        self.peeked_step: Optional[int] = None
        self.resume_dir: Optional[str] = None
        self.restored: Optional[RestoreResult] = None
        self.pending_rng: Optional[RestoreResult] = None

    def ours(self, path: Optional[str]) -> bool:
        return (
            path is not None
            and self.resume_dir is not None
            and os.path.normpath(str(path)) == os.path.normpath(self.resume_dir)
        )

    def apply_rng(self) -> None:
        pending, self.pending_rng = self.pending_rng, None
        if pending is not None:
            pending.apply_rng()


class GeminiTrainerMixin:
    """The overrides :func:`prepare_trainer` puts in front of the trainer's own class."""

    _gemini: _Run

    @property
    def gemini_checkpointer(self) -> Optional[Checkpointer]:
        """The Checkpointer of the current (or last) ``train()`` call; None before the first."""
        return self._gemini.ckpt

    @property
    def gemini_restored(self) -> Optional[RestoreResult]:
        """The version the last ``train()`` resumed from (None: it started afresh)."""
        return self._gemini.restored

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        run = self._gemini
        run.extra = {}
        run.state = TrainState(model=self.model, extra=run.extra)
        run.ckpt = checkpointer_here(run.state, run.config)
        run.restored = run.pending_rng = None
        try:
            if resume_from_checkpoint is None:
                peeked = run.ckpt.peek()
                if peeked is not None:
                    resume_from_checkpoint = self._gemini_resume_dir(peeked.step, peeked.extra)
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        except BaseException:
            run.ckpt.abort()
            raise
        finally:
            if run.resume_dir is not None:
                shutil.rmtree(run.resume_dir, ignore_errors=True)
                run.resume_dir = None
        run.ckpt.close()
        return output

    def _gemini_resume_dir(self, step: int, extra: dict) -> str:
        run = self._gemini
        if not isinstance(extra.get("trainer_state"), str):
            raise CheckpointError(
                f"version {step} was not saved by a Hugging Face Trainer prepared by gemini_ckpt "
                f"(it has no TrainerState); use another CheckpointConfig.namespace for this job"
            )
        saved = extra.get("seeds")
        now = [self.args.seed, self.args.data_seed]
        if saved is not None and list(saved) != now:
            raise ConfigError(
                f"version {step} was saved with TrainingArguments seed/data_seed {saved}, this run has "
                f"{now}; the data order follows them, so resuming would not continue the same run. "
                f"Use the saved seeds, or CheckpointConfig(overwrite=True) to start afresh"
            )
        run.resume_dir = tempfile.mkdtemp(prefix="gemini-ckpt-hf-")
        with open(os.path.join(run.resume_dir, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(extra["trainer_state"])
        open(os.path.join(run.resume_dir, MARKER), "w").close()
        run.peeked_step = step
        log.info("rank %d: resuming the Trainer from gemini_ckpt version %d (%s)", run.ckpt.rank, step, run.resume_dir)
        return run.resume_dir

    # --- save ------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        run = self._gemini
        if run.hf_checkpoints:
            super()._save_checkpoint(model, trial)  # refreshes the stateful callbacks and the flops itself
        else:
            if getattr(self, "hp_search_backend", None) is None and trial is None:
                self.store_flos()
            from transformers.trainer_callback import ExportableState

            for cb in self.callback_handler.callbacks + [self.control]:
                if isinstance(cb, ExportableState):
                    name, value = type(cb).__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(value)
                    else:
                        self.state.stateful_callbacks[name] = value
        state = dataclasses.asdict(self.state)
        state["log_history"] = state["log_history"][-run.keep_log_history :]
        run.extra.update(
            {
                "trainer_state": json.dumps(state, sort_keys=True),
                "tr_loss": float(self._tr_loss.item()),
                "globalstep_last_logged": int(self._globalstep_last_logged),
                "seeds": [self.args.seed, self.args.data_seed],
            }
        )
        last = self.state.log_history[-1] if self.state.log_history else {}
        metrics = (
            {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if last.get("step") == self.state.global_step
            else {}
        )
        if not run.state.optimizers:  # the Trainer made them in train(); restore attached them already
            self._gemini_attach()
        run.ckpt.save(self.state.global_step, metrics=metrics)

    def _gemini_attach(self) -> None:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the torch one
        self._gemini.state.attach(
            optimizer=inner, scheduler=self.lr_scheduler, scaler=getattr(self.accelerator, "scaler", None)
        )

    # --- resume: the Trainer's hooks, on a directory we made -------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self._gemini.ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None  # the model is loaded with the optimizer, once it exists

    def _load_optimizer_and_scheduler(self, checkpoint):
        run = self._gemini
        if not run.ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._gemini_attach()
        run.restored = run.ckpt.restore(step=run.peeked_step, rng=False)
        run.pending_rng = run.restored
        return None

    def _load_scaler(self, checkpoint):
        if not self._gemini.ours(checkpoint):
            return super()._load_scaler(checkpoint)
        return None

    def _load_rng_state(self, checkpoint):
        if not self._gemini.ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        # The Trainer's own points: at an epoch boundary before the epoch's first batch; mid-epoch
        # after it, as the loader's iterator only starts (and draws its worker seed) at that fetch.
        self._gemini.apply_rng()
        return None


def _accumulators_callback(trainer):
    """Puts the logging accumulators back after the Trainer reset them (at ``on_train_begin``)."""
    import torch
    from transformers import TrainerCallback

    class _Accumulators(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs) -> None:
            run: _Run = trainer._gemini
            if run.restored is None:
                return
            extra: dict[str, Any] = run.extra
            # _total_loss_scalar is left at 0: the run summary's train_loss averages this train() call, as
            # after the Trainer's own resume
            trainer._tr_loss = torch.tensor(extra["tr_loss"], device=args.device)
            trainer._globalstep_last_logged = extra["globalstep_last_logged"]

    return _Accumulators()
