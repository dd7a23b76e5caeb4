"""Checkpoint every step of a single-process training job, crash it, and resume exactly.

    python examples/train_local.py                 # train 60 steps, "crash" at step 37, resume
    python examples/train_local.py --steps 100 --crash-at 70

A small transformer LM with dropout, AdamW, warmup+cosine LR and a shuffling
StatefulDataLoader with 2 workers. Every step is saved to process memory
(``store="local"``, the last 2 versions kept). At ``--crash-at`` every training object is
thrown away and rebuilt from scratch with other seeds, ``restore()`` brings back the newest
version, and the run finishes. It then replays the same run without a crash and checks that
every loss after the restore and the final parameters are bit-identical.
"""

from __future__ import annotations

import argparse
import time

import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss


def run(steps: int, crash_at: int | None, namespace: str, log_every: int) -> tuple[list[float], dict]:
    seed = 0
    t = build_training(seed=seed, num_workers=2, total_steps=steps)
    extra = {"tokens_seen": 0}
    state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=t.loader, extra=extra)
    config = CheckpointConfig(store="local", namespace=namespace, keep_in_memory=2)
    ckpt = Checkpointer(state, config)
    torch.manual_seed(1234)
    losses: list[float] = []
    step, batches, stalls = 0, t.batches(), []
    while step < steps:
        if step == crash_at:
            print(f"  step {step}: simulated crash - every training object is rebuilt from scratch")
            ckpt.close()
            seed += 1000  # a rebuilt job would not even use the same seeds
            t = build_training(seed=seed, num_workers=2, total_steps=steps)
            extra = {}
            state = TrainState(
                model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=t.loader, extra=extra
            )
            ckpt = Checkpointer(state, config)
            result = ckpt.restore()
            print(f"  {result.summary()}; tokens_seen={extra['tokens_seen']}")
            step, batches = result.step + 1, t.batches()
            crash_at = None
            del losses[step:]
            continue
        batch = next(batches)
        loss = lm_loss(t.model, batch)
        loss.backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        extra["tokens_seen"] += batch.numel()
        losses.append(loss.item())
        handle = ckpt.save(step)
        stalls.append(handle.staged.result().stall_s)
        if step % log_every == 0 or step == steps - 1:
            print(
                f"  step {step:4d}  loss {loss.item():.4f}  lr {t.scheduler.get_last_lr()[0]:.2e}  "
                f"save stall {stalls[-1] * 1e3:.2f} ms"
            )
        step += 1
    ckpt.close()
    return losses, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--crash-at", type=int, default=37)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()
    if not 0 < args.crash_at < args.steps:
        ap.error("--crash-at must be between 1 and --steps - 1")
    t0 = time.perf_counter()
    print(f"run with a crash at step {args.crash_at}:")
    crashed, params_a = run(args.steps, args.crash_at, "example-crash", args.log_every)
    print("reference run without a crash:")
    reference, params_b = run(args.steps, None, "example-reference", args.log_every)
    same_losses = crashed == reference
    same_params = all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    print(
        f"losses identical: {same_losses}; final parameters identical: {same_params} ({time.perf_counter() - t0:.1f}s)"
    )
    if not (same_losses and same_params):
        raise SystemExit("resume was not exact")


if __name__ == "__main__":
    main()
