"""What the default health check costs: save() stall and time to safe, check on vs off.

    python benchmarks/bench_health.py            # ~1 GiB per version (params + AdamW state), 12 saves each
    python benchmarks/bench_health.py --quick    # ~256 MiB, 6 saves each

Single process, ``store="local"``: a stack of bias-free ``Linear(2048, 2048)`` layers with
AdamW state (params, exp_avg, exp_avg_sq; fp32). Two Checkpointers of the same state, one with
the default ``HealthCheck()`` (every parameter and optimizer-state value finite, checked on the
raw bits beside the checksums, on the tier's threads) and one with ``health_check=None``, save
alternately (who goes first alternates too), so background load on a shared machine hits both
alike. For each save:

- *stall*: the ``save()`` call until it returns (the training thread's cost);
- *time to safe*: the ``save()`` call until ``handle.committed`` resolves (checksums, the
  check and the commit done).

The target: both within 5% of the check off, by median. Writes
``benchmarks/results/health.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
import warnings

import torch
from torch import nn

from _common import table, write_results
from gemini_ckpt import CheckpointConfig, Checkpointer, HealthCheck, TrainState

TARGET = 1.05


def build(layers: int, dim: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the optimizer state exists from here on
    opt.zero_grad(set_to_none=True)
    return model, opt


def alternate(ckpts: dict, res: dict, saves: int, warmup: int) -> tuple[int, dict]:
    """Save with each Checkpointer in turn (the order rotates every step), ``warmup`` + ``saves``
    steps; per save the stall and the time to safe into ``res[name]``. Returns (bytes staged per
    version, each Checkpointer's last handle)."""
    staged, last, names = 0, {}, list(ckpts)
    for step in range(saves + warmup):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            t0 = time.perf_counter()
            handle = ckpts[name].save(step)
            t1 = time.perf_counter()
            handle.committed.result(timeout=300)
            t2 = time.perf_counter()
            staged, last[name] = handle.staged.result().staged_bytes, handle
            if step >= warmup:
                res[name]["stall"].append(t1 - t0)
                res[name]["safe"].append(t2 - t0)
    return staged, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=21, help="Linear(dim, dim) layers (21 x 2048^2 x 3 fp32: ~1 GiB)")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--saves", type=int, default=12, help="measured saves per config (after 2 warm-up saves)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.saves = 5, 6
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    configs = {"on": HealthCheck(), "off": None}
    ckpts, res = {}, {name: {"stall": [], "safe": []} for name in configs}
    for name, check in configs.items():
        model, opt = build(args.layers, args.dim)
        cfg = CheckpointConfig(
            store="local",
            namespace=f"health-{name}-{uuid.uuid4().hex[:6]}",
            keep_in_memory=1,
            timeout_s=300,
            health_check=check,
        )
        ckpts[name] = Checkpointer(TrainState(model=model, optimizer=opt), cfg)
    warmup = 2
    staged, last = alternate(ckpts, res, args.saves, warmup)
    health = last["on"].health.result(timeout=60)
    for ckpt in ckpts.values():
        ckpt.close()
    if health is None or health.status != "healthy":
        raise SystemExit(f"the checked saves did not come out healthy: {health}")

    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    ratios = {k: med["on"][k] / med["off"][k] for k in ("stall", "safe")}
    met = all(r <= TARGET for r in ratios.values())
    print(
        f"state: {staged / 2**30:.3f} GiB per version, {args.saves} saves per config after {warmup} warm-up, "
        f"alternating"
    )
    rows = [
        [what, med["off"][k], med["on"][k], f"{ratios[k]:.3f}", f"<= {TARGET}", "yes" if ratios[k] <= TARGET else "NO"]
        for what, k in (("save() stall", "stall"), ("time to safe (committed)", "safe"))
    ]
    print(table(["seconds (median)", "check off", "default check", "on / off", "target", "met"], rows))
    path = write_results(
        "health",
        {
            "staged_bytes": staged,
            "saves": args.saves,
            "quick": args.quick,
            "median_s": med,
            "samples_s": res,
            "ratio_on_off": ratios,
            "target_ratio": TARGET,
            "target_met": met,
            "note": "single process, store='local'; the check runs beside the checksums on the tier's threads",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
