"""FSDP2 training with Ray Train, checkpointed every step into peer memory by gemini_ckpt.

    python examples/ray_train_fsdp.py                          # 2 simulated hosts on this machine
    python examples/ray_train_fsdp.py --local-hosts 4 --workers 4 --steps 80
    python examples/ray_train_fsdp.py --address auto --workers 16 --storage /mnt/shared/runs

What gemini_ckpt adds to an ordinary Ray Train job is marked ``# gemini_ckpt``: one ``with``
block around ``fit()`` on the driver and three calls in the training loop. Everything else is
what the job would contain anyway. Run it twice with the same ``--name``: the second run starts from the first
run's newest durable version (the host stores of the first run are gone with its ``fit()``).

On GPUs: ``init_device_mesh("cuda", ...)``, ``ScalingConfig(use_gpu=True)`` and move the
model to the device; nothing else changes (staging copies go through pinned buffers).
"""

from __future__ import annotations

import argparse
import os

import ray
import torch
from ray.train import CheckpointConfig as RayCheckpointConfig
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from gemini_ckpt import CheckpointConfig, TrainState
from gemini_ckpt import ray_train as gray  # gemini_ckpt


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    from gemini_ckpt.toy import TinyLM, TokenDataset, lm_loss, warmup_cosine

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    steps = config["steps"]

    # FSDP2 over the process group TorchTrainer set up (gloo on CPU). On CPU the mesh must be
    # passed explicitly; each transformer layer is its own FSDP unit, then the root.
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = TinyLM(dim=64, layers=2)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, steps // 10), steps))
    # A stateful loader (its position is part of every version); each rank shuffles its own way.
    loader = StatefulDataLoader(
        TokenDataset(n=1024), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(100 + rank)
    )
    torch.manual_seed(1 + rank)  # per-rank dropout streams (saved and restored with each version)
    extra = {"tokens_seen": 0}

    # gemini_ckpt: everything a version holds, and a checkpointer wired to Ray Train (rank, world
    # size, node and process group come from the Ray Train context; namespace and durable location
    # from the run). restore() is the same call on a fresh start and after a failure: newest
    # version in peer memory, else newest durable one, else None.
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader, extra=extra)
    ckpt = gray.checkpointer(state, config["ckpt"])
    restored = ckpt.restore()
    start = restored.step + 1 if restored else 0
    if rank == 0:
        print(restored.summary() if restored else "fresh start", flush=True)

    def batches():
        while True:
            yield from loader

    stream = batches()
    for step in range(start, steps):
        batch = next(stream)
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        extra["tokens_seen"] += batch.numel()
        # gemini_ckpt: blocks only for the copy into CPU buffers. Every persisted version (every
        # persist_every-th step) is reported to Ray Train with these metrics and appears in
        # Result.checkpoint; memory-only versions are not reported.
        ckpt.save(step, metrics={"loss": loss.item()})
        if rank == 0 and step % 10 == 0:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  save stall {ckpt.stats.last_stall_s * 1e3:.1f} ms", flush=True
            )
    ckpt.close()  # gemini_ckpt: waits for in-flight versions, persists and reports the final one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: simulate hosts here)")
    ap.add_argument("--local-hosts", type=int, default=2, help="simulated hosts when no --address is given")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--storage", default="runs", help="RunConfig(storage_path): shared by every node")
    ap.add_argument("--name", default=None, help="RunConfig(name); reuse it to resume a run")
    args = ap.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = None
    if args.address:
        ray.init(address=args.address)
        hosts = len([n for n in ray.nodes() if n["Alive"]])
    else:
        # One Ray node per simulated host; the head runs Ray Train's controller, not workers.
        from gemini_ckpt.testing.cluster import LocalCluster

        cluster = LocalCluster(args.local_hosts, head_cpus=0, cpus_per_host=max(1, args.workers // args.local_hosts))
        cluster.start(log_to_driver=True)
        hosts = args.local_hosts

    # gemini_ckpt: two copies of every shard in memory (this host's and a peer's), the last two
    # versions kept, every 10th version persisted under <storage>/<name>/gemini as a DCP checkpoint.
    ckpt_config = CheckpointConfig(replicas=min(2, hosts), keep_in_memory=2, persist_every=10)
    run_config = RunConfig(
        name=args.name,  # None: Ray names the run (ray_train_run-<date>) when the config is built
        storage_path=os.path.abspath(args.storage) if "://" not in args.storage else args.storage,
        failure_config=FailureConfig(max_failures=3),  # restarts restore from peer memory
        checkpoint_config=RayCheckpointConfig(num_to_keep=3),  # retention of durable versions
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"ckpt": ckpt_config, "steps": args.steps},
        # Simulated hosts carry gemini_ckpt's host label: rank r stays on its host across restarts, so
        # it restores from its own host's memory (on your cluster: `ray start --labels gemini-ckpt.io/host=i`).
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            label_selector=None
            if args.address
            else gray.ranks_on_hosts(args.workers, ranks_per_host=max(1, args.workers // hosts)),
        ),
        run_config=run_config,
    )
    try:
        with gray.host_stores(ckpt_config, run_config=run_config):  # gemini_ckpt: host stores live as long as fit()
            result = trainer.fit()
        print(f"final metrics: {result.metrics}")
        print(f"newest durable version (a stock DCP checkpoint): {result.checkpoint.path}")
    finally:
        if cluster is not None:
            cluster.shutdown()  # disconnects too
        else:
            ray.shutdown()


if __name__ == "__main__":
    main()
