"""PyTorch Lightning on Ray Train, checkpointed every step into peer memory by gemini_ckpt.

    python examples/lightning_ray.py                 # 2 simulated hosts, 2 gloo workers, ~1-2 min
    python examples/lightning_ray.py --quick         # fewer steps

What gemini_ckpt adds to an ordinary Ray Train + Lightning job is marked ``# gemini_ckpt``: the
``GeminiCallback`` in ``Trainer(callbacks=...)`` (no ``RayTrainReportCallback``: gemini's
checkpointer reports persisted versions itself) and one ``with`` block around ``fit()`` on the
driver. ``trainer.fit()`` takes no ``ckpt_path``: after a restart it resumes by itself.

The script runs the job twice. In the first run, rank 1 SIGKILLs itself once, right after a
version is committed; Ray Train restarts both workers (``FailureConfig(max_failures=1)``), and
``fit()`` resumes from the host stores' memory. The second run is uninterrupted. It then
compares the final parameters of the two runs and prints the verdict.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import tempfile
import time

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from gemini_ckpt import CheckpointConfig
from gemini_ckpt import ray_train as gray  # gemini_ckpt


def train_loop_per_worker(config: dict) -> dict:
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
    from torch import nn
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    from gemini_ckpt.integrations.lightning import GeminiCallback  # gemini_ckpt

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class KillOnce(pl.Callback):
        """Rank ``kill_rank`` SIGKILLs itself at the first batch after step ``kill_at`` is committed,
        once (a marker file records it happened, so the restarted attempt trains on)."""

        def __init__(self, gemini: GeminiCallback) -> None:
            self.gemini = gemini

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            kill = config["kill"]
            if (
                kill
                and rank == kill["rank"]
                and trainer.global_step >= kill["at"]
                and not os.path.exists(kill["marker"])
            ):
                self.gemini.checkpointer.wait()  # the version of step kill["at"] is committed
                with open(kill["marker"], "w") as f:
                    f.write(str(trainer.global_step))
                os.kill(os.getpid(), signal.SIGKILL)

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.by_step: dict[int, float] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.by_step[trainer.global_step] = outputs["loss"].item()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    # A stateful loader: its position is part of every version. Each rank reads its shard through
    # a DistributedSampler, shuffled by seed and epoch (so the Trainer must not add its own sampler:
    # use_distributed_sampler=False; Lightning's wrapper around a StatefulDataLoader(shuffle=True)
    # would shuffle from an unsaved seed).
    loader = StatefulDataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True, seed=0))

    torch.manual_seed(1 + rank)  # model init and dropout streams; a restart restores them
    model = Regression()
    gemini = GeminiCallback(config["ckpt"])  # gemini_ckpt: every step into peer memory
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(find_unused_parameters=True),  # exact resume on gloo needs it
        plugins=[RayLightningEnvironment()],
        callbacks=[gemini, losses := Losses(), KillOnce(gemini)],
        use_distributed_sampler=False,  # the loader has its DistributedSampler
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, train_dataloaders=loader)  # no ckpt_path: resumes from memory after a restart

    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().numpy().tobytes())
    restored = gemini.restored
    return {
        "digest": digest.hexdigest(),
        "rank": rank,
        "global_step": trainer.global_step,
        "losses": losses.by_step,
        "restored": None if restored is None else {"step": restored.step, "source": restored.source},
    }


def fit(name: str, args, storage: str, hosts: int, kill=None, local: bool = True) -> dict:
    # gemini_ckpt: two copies of every version in memory (this host's and a peer's), the last two kept
    ckpt_config = CheckpointConfig(replicas=min(2, hosts), keep_in_memory=2, timeout_s=60.0)
    run_config = RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=1))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"ckpt": ckpt_config, "kill": kill, "epochs": args.epochs, "samples": args.samples},
        # rank r stays on simulated host r across restarts, so it restores from its own host's memory
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            label_selector=gray.ranks_on_hosts(args.workers, ranks_per_host=max(1, args.workers // hosts))
            if local
            else None,
        ),
        run_config=run_config,
    )
    with gray.host_stores(ckpt_config, run_config=run_config):  # gemini_ckpt: host stores live as long as fit()
        result = trainer.fit()
    return result.return_value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: simulate hosts here)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--local-hosts", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=128, help="dataset size (per epoch, over all ranks)")
    ap.add_argument(
        "--kill-at", type=int, default=None, help="step after which rank 1 is killed (default: in the second epoch)"
    )
    ap.add_argument("--quick", action="store_true", help="a smaller run (64 samples)")
    args = ap.parse_args()
    if args.quick:
        args.samples = 64
    steps_per_epoch = -(-args.samples // (8 * args.workers))
    kill_at = args.kill_at if args.kill_at is not None else steps_per_epoch + steps_per_epoch // 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    t0 = time.perf_counter()
    cluster = None
    if args.address:
        ray.init(address=args.address)
        hosts = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")])
    else:
        from gemini_ckpt.testing.cluster import LocalCluster

        cluster = LocalCluster(
            args.local_hosts, head_cpus=0, cpus_per_host=max(1, args.workers // args.local_hosts)
        ).start()
        hosts = args.local_hosts
    try:
        with tempfile.TemporaryDirectory() as tmp:
            marker = os.path.join(tmp, "killed")
            print(f"run 1: rank 1 is SIGKILLed after step {kill_at} is committed", flush=True)
            crashed = fit(
                "lightning-crash",
                args,
                tmp,
                hosts,
                kill={"rank": 1, "at": kill_at, "marker": marker},
                local=cluster is not None,
            )
            killed = os.path.exists(marker)
            print("run 2: uninterrupted", flush=True)
            reference = fit("lightning-reference", args, tmp, hosts, local=cluster is not None)
    finally:
        if cluster is not None:
            cluster.shutdown()
        else:
            ray.shutdown()
    restored = crashed["restored"]
    if restored is not None:
        print(f"restored step {restored['step']} from {restored['source']}")
    after = crashed["losses"]  # the restarted attempt's: the steps after the restored one
    differ = [s for s in sorted(after) if after[s] != reference["losses"].get(s)]
    print(
        f"losses of steps {min(after)}..{max(after)} after the restart: "
        + ("identical to the uninterrupted run's" if not differ else f"differ from step {differ[0]} on")
    )
    same = (
        not differ and crashed["digest"] == reference["digest"] and crashed["global_step"] == reference["global_step"]
    )
    ok = same and killed and restored is not None and restored["source"] == "memory"
    print(
        f"global_step {crashed['global_step']} (crashed run) vs {reference['global_step']} (uninterrupted); "
        f"worker killed: {killed}; {time.perf_counter() - t0:.0f}s"
    )
    print(
        "VERDICT: "
        + (
            "PASS - the resumed run's final parameters are bit-identical to the uninterrupted run's"
            if ok
            else "FAIL - the resumed run differs from the uninterrupted run (or no restart happened)"
        )
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
