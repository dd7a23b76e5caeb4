"""A Hugging Face ``Trainer`` on Ray Train, checkpointed every step into peer memory by gemini_ckpt;
one worker is killed once and the run resumes from memory.

    python examples/hf_trainer_ray.py                   # 2 simulated hosts on this machine
    python examples/hf_trainer_ray.py --address auto --workers 8 --steps 200

What gemini_ckpt adds to an ordinary Ray Train + Trainer job is marked ``# gemini_ckpt``: one line
after the Trainer is built and one ``with`` block around ``fit()``. The Trainer needs no
``resume_from_checkpoint``: after Ray Train restarts the workers, ``trainer.train()`` resumes from
the newest version in the host stores' memory. The example runs the job twice, once uninterrupted
and once with rank 1 SIGKILLed right after version ``--kill-at`` is committed, and compares what
both runs ended with (parameters, and every logged loss after the failure).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from gemini_ckpt import CheckpointConfig
from gemini_ckpt import ray_train as gray  # gemini_ckpt


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    from ray.train.huggingface.transformers import prepare_trainer
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gemini_ckpt.integrations import hf as ghf  # gemini_ckpt

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 128, (256, 32), generator=torch.Generator().manual_seed(7))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class KillOnce(TrainerCallback):
        """The failure: rank 1's process is killed right after version ``at`` is committed, once."""

        def on_save(self, args, state, control, **kwargs):
            marker = os.path.join(config["out"], "killed")
            if (
                config["kill_at"] is not None
                and rank == 1
                and state.global_step == config["kill_at"]
                and not os.path.exists(marker)
            ):
                trainer.gemini_checkpointer.wait()
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)  # the same initial model in both runs (a resumed one loads its version over it)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=os.path.join(config["out"], "hf"),
        max_steps=config["steps"],
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=11,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[KillOnce()])
    trainer = prepare_trainer(trainer)  # Ray's
    trainer = ghf.prepare_trainer(trainer, config["ckpt"])  # gemini_ckpt: the one added line
    trainer.train()
    restored = trainer.gemini_restored
    if rank == 0:
        print(restored.summary() if restored else "fresh start", flush=True)
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            os.path.join(config["out"], "final.pt"),
        )
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        with open(os.path.join(config["out"], "result.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "restored": restored.step if restored else None,
                    "source": restored.source if restored else None,
                },
                f,
            )


def run(name: str, out: str, *, workers: int, steps: int, kill_at, storage: str, hosts: int, local: bool) -> dict:
    os.makedirs(out, exist_ok=True)
    ckpt_config = CheckpointConfig(replicas=min(2, hosts), keep_in_memory=2, persist_every=10)  # gemini_ckpt
    run_config = RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=1))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"ckpt": ckpt_config, "steps": steps, "kill_at": kill_at, "out": out},
        scaling_config=ScalingConfig(
            num_workers=workers,
            label_selector=gray.ranks_on_hosts(workers, ranks_per_host=max(1, workers // hosts)) if local else None,
        ),
        run_config=run_config,
    )
    with gray.host_stores(ckpt_config, run_config=run_config):  # gemini_ckpt: host stores live as long as fit()
        trainer.fit()
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    result["params"] = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: simulate hosts here)")
    ap.add_argument("--local-hosts", type=int, default=2, help="simulated hosts when no --address is given")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill-at", type=int, default=7, help="kill rank 1 right after this version is committed")
    ap.add_argument("--storage", default=None, help="RunConfig(storage_path) (default: a temporary directory)")
    args = ap.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    storage = os.path.abspath(args.storage or tempfile.mkdtemp(prefix="gemini-hf-"))
    cluster = None
    if args.address:
        ray.init(address=args.address)
        hosts = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")])
    else:
        from gemini_ckpt.testing.cluster import LocalCluster

        cluster = LocalCluster(args.local_hosts, head_cpus=0, cpus_per_host=max(1, args.workers // args.local_hosts))
        cluster.start()
        hosts = args.local_hosts
    try:
        common = dict(workers=args.workers, steps=args.steps, storage=storage, hosts=hosts, local=cluster is not None)
        plain = run("uninterrupted", os.path.join(storage, "plain"), kill_at=None, **common)
        killed = run("killed", os.path.join(storage, "killed"), kill_at=args.kill_at, **common)
    finally:
        if cluster is not None:
            cluster.shutdown()
        else:
            ray.shutdown()
    print(f"killed run: restored step {killed['restored']} from {killed['source']}")
    same_params = plain["params"].keys() == killed["params"].keys() and all(
        torch.equal(plain["params"][k], killed["params"][k]) for k in plain["params"]
    )
    after = [s for s in plain["losses"] if int(s) > args.kill_at]
    same_losses = all(plain["losses"][s] == killed["losses"].get(s) for s in after) and bool(after)
    print(f"losses after the failure identical: {same_losses}; final parameters identical: {same_params}")


if __name__ == "__main__":
    main()
