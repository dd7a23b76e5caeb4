"""Every-step checkpointing overhead: training throughput with a save after every step vs never.

    python benchmarks/bench_overhead.py [--quick]

The training step is sized to take about 10x the staging time (the issue's setting). Runs
alternate (never, every step, never, ...) so drift on a shared machine hits both equally.
Output: benchmarks/results/overhead.json and a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
import warnings

import torch

from _common import table, write_results
from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt._toy import TinyLM, lm_loss


def run(model, opt, batch, steps: int, ckpt) -> tuple[float, list[float]]:
    stalls = []
    t0 = time.perf_counter()
    for step in range(steps):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ckpt is not None:
            stalls.append(ckpt.save(step).staged.result().stall_s)
    if ckpt is not None:
        ckpt.wait()
    return steps / (time.perf_counter() - t0), stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 12, 2
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = TinyLM(vocab=256, dim=args.dim, heads=4, layers=4, seq=64, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (args.batch, 65))
    ckpt = Checkpointer(TrainState(model=model, optimizer=opt),
                        CheckpointConfig(store="local", namespace=uuid.uuid4().hex, keep_in_memory=2))
    run(model, opt, batch, 3, ckpt)  # warm-up: allocates staging buffers, caches plans
    state_mb = ckpt.stats.staging_bytes / 2**20
    never, every, stalls = [], [], []
    for _ in range(args.rounds):
        never.append(run(model, opt, batch, args.steps, None)[0])
        tput, s = run(model, opt, batch, args.steps, ckpt)
        every.append(tput)
        stalls += s
    ckpt.close()
    step_s = 1 / statistics.median(never)
    stall = statistics.median(stalls)
    ratio = statistics.median(every) / statistics.median(never)
    rows = [["never checkpoint", statistics.median(never), step_s * 1e3, "-"],
            ["checkpoint every step", statistics.median(every), 1e3 / statistics.median(every), stall * 1e3]]
    print(f"state {state_mb:.0f} MiB; step {step_s * 1e3:.0f} ms = {step_s / stall:.1f}x the median save stall")
    print(table(["run", "steps/s", "ms/step", "save stall ms"], rows))
    print(f"throughput ratio (every step / never): {ratio:.3f} (target >= 0.97)")
    write_results("overhead", {"state_mib": state_mb, "step_s": step_s, "stall_s": stall,
                               "step_over_stall": step_s / stall, "throughput_never": never,
                               "throughput_every_step": every, "ratio": ratio, "target": 0.97,
                               "target_met": ratio >= 0.97})


if __name__ == "__main__":
    main()
