"""Hugging Face ``Trainer`` through :func:`gemini_ckpt.integrations.hf.prepare_trainer`: a run that
crashes after a save, is rebuilt from scratch with another model seed and calls ``train()`` again
equals an uninterrupted run bit for bit (every logged loss, grad norm and LR, ``log_history``,
parameters, optimizer state, LR, ``global_step``); and what cannot be resumed exactly is refused.
One process, ``store="local"``, a two-layer GPT-2 built from its config (no downloads)."""

from __future__ import annotations

import uuid

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gemini_ckpt import CheckpointConfig  # noqa: E402
from gemini_ckpt.errors import ConfigError  # noqa: E402
from gemini_ckpt.integrations import hf as ghf  # noqa: E402

N_SAMPLES, SEQ, BATCH = 24, 16, 4  # 6 batches per epoch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = N_SAMPLES, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Crash(TrainerCallback):
    """Raises right after the version of step ``at`` is committed."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.trainer = None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.trainer.gemini_checkpointer.wait()
            raise RuntimeError(f"crash after step {self.at}")


def _model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1
    )
    return GPT2LMHeadModel(cfg)


def _trainer(tmp_path, namespace: str, *, model_seed: int, crash_at=None, args=None, prepare=True, callbacks=(), **kw):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=12,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=11,
        learning_rate=1e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
    )
    settings.update(args or {})
    eval_ds = Tokens(8, seed=3) if settings.get("eval_strategy") == "steps" else None
    crash = [Crash(crash_at)] if crash_at is not None else []
    trainer = Trainer(
        model=_model(model_seed),
        args=TrainingArguments(**settings),
        train_dataset=Tokens(),
        eval_dataset=eval_ds,
        callbacks=[*callbacks, *crash],
        **kw,
    )
    if prepare:
        trainer = ghf.prepare_trainer(trainer, CheckpointConfig(store="local", namespace=namespace, keep_in_memory=2))
    for c in crash:
        c.trainer = trainer
    return trainer


def _digest(trainer) -> dict:
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return {
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optim": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()],
        "lr": trainer.lr_scheduler.get_last_lr(),
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        # timings aside (and the run summary, which covers one train() call)
        "log": [
            {k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history
            if "train_runtime" not in e
        ],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"]
    assert a["lr"] == b["lr"]
    assert a["log"] == b["log"], "logged losses / grad norms / LRs differ after the resume"
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert len(a["optim"]) == len(b["optim"])
    for sa, sb in zip(a["optim"], b["optim"]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k


VARIANTS = {
    "mid-epoch": ({}, 4),
    "epoch-boundary": ({}, 6),
    "grad-accumulation": ({"gradient_accumulation_steps": 2, "max_steps": 8}, 4),
    "eval-on-save-step": ({"eval_strategy": "steps", "eval_steps": 2}, 4),
    "loader-workers": ({"dataloader_num_workers": 2, "max_steps": 8}, 3),
    "sparse-logging": ({"logging_steps": 3}, 5),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_crash_rebuild_and_resume_equals_an_uninterrupted_run(tmp_path, variant):
    args, crash_at = VARIANTS[variant]
    plain = _trainer(tmp_path / "a", f"hf-a-{uuid.uuid4().hex}", model_seed=0, args=args)
    plain.train()
    expected = _digest(plain)

    namespace = f"hf-b-{uuid.uuid4().hex}"
    first = _trainer(tmp_path / "b", namespace, model_seed=0, crash_at=crash_at, args=args)
    with pytest.raises(RuntimeError, match="crash after"):
        first.train()
    assert first.state.global_step == crash_at

    again = _trainer(tmp_path / "b", namespace, model_seed=1234, args=args)  # another init: the restore must win
    again.train()
    restored = again.gemini_restored
    assert restored is not None and restored.step == crash_at and restored.source == "memory"
    _assert_same(expected, _digest(again))
    assert not list((tmp_path / "b" / "out").glob("checkpoint-*")), "no Hugging Face checkpoint directory is written"


def test_a_fresh_start_trains_from_scratch_and_saves_every_save_step(tmp_path):
    trainer = _trainer(tmp_path, f"hf-{uuid.uuid4().hex}", model_seed=0, args={"max_steps": 3})
    trainer.train()
    assert trainer.gemini_restored is None
    assert trainer.gemini_checkpointer.stats.committed == 3


def test_a_version_of_another_seed_is_refused(tmp_path):
    namespace = f"hf-{uuid.uuid4().hex}"
    first = _trainer(tmp_path, namespace, model_seed=0, crash_at=2)
    with pytest.raises(RuntimeError):
        first.train()
    other = _trainer(tmp_path, namespace, model_seed=0, args={"seed": 12})
    with pytest.raises(ConfigError, match="seed"):
        other.train()


@pytest.mark.parametrize(
    "args, match",
    [
        ({"ignore_data_skip": True}, "ignore_data_skip"),
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 1}, "hf_checkpoints=True"),
    ],
)
def test_what_cannot_resume_exactly_is_refused(tmp_path, args, match):
    trainer = _trainer(tmp_path, "unused", model_seed=0, args=args, prepare=False)
    with pytest.raises(ConfigError, match=match):
        ghf.prepare_trainer(trainer, CheckpointConfig(store="local"))


def test_rays_report_callback_is_refused(tmp_path):
    class RayTrainReportCallback(TrainerCallback):  # Ray's, by name: ray.train.huggingface.transformers
        pass

    trainer = _trainer(tmp_path, "unused", model_seed=0, prepare=False, callbacks=[RayTrainReportCallback()])
    with pytest.raises(ConfigError, match="RayTrainReportCallback"):
        ghf.prepare_trainer(trainer, CheckpointConfig(store="local"))


def test_an_mlm_collator_with_its_own_generator_is_warned_about(tmp_path):
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[MASK]": 0, "[PAD]": 1, "a": 2}, unk_token="a")),
        mask_token="[MASK]",
        pad_token="[PAD]",
    )
    collator = DataCollatorForLanguageModeling(tok, mlm=True, seed=5)
    trainer = _trainer(tmp_path, "unused", model_seed=0, prepare=False, data_collator=collator)
    with pytest.warns(UserWarning, match="MLM collator"):
        ghf.prepare_trainer(trainer, CheckpointConfig(store="local"))


def test_each_version_keeps_only_the_newest_log_entries(tmp_path):
    namespace = f"hf-{uuid.uuid4().hex}"
    first = _trainer(tmp_path, namespace, model_seed=0, crash_at=5, prepare=False)
    first = ghf.prepare_trainer(first, CheckpointConfig(store="local", namespace=namespace), keep_log_history=3)
    first.callback_handler.callbacks[-2].trainer = first  # Crash, before the accumulators callback
    with pytest.raises(RuntimeError):
        first.train()
    again = ghf.prepare_trainer(
        _trainer(tmp_path, namespace, model_seed=0, args={"max_steps": 6}, prepare=False),
        CheckpointConfig(store="local", namespace=namespace),
        keep_log_history=3,
    )
    again.train()
    steps = [e["step"] for e in again.state.log_history if "loss" in e]
    assert steps == [3, 4, 5, 6]
