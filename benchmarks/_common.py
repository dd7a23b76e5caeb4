"""Shared helpers for the benchmark scripts: model-like states, timing, JSON + table output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

# BENCH_RESULTS_DIR redirects output (run_all --quick uses results/quick/ so it never
# overwrites full-size results).
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def model_like(total_mb: int, *, seed: int = 0) -> nn.Module:
    """A module whose parameters look like a transformer's: many tensors, fp32 and bf16,
    a few large matrices and many small vectors, about ``total_mb`` MB in all."""
    torch.manual_seed(seed)
    params = nn.ParameterDict()
    budget = total_mb * 2**20
    i = 0
    while budget > 0:
        big = (i % 4) != 3
        numel = min(budget // 4, 2**20 * (2 if big else 1)) if big else 4096
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = max(1, min(numel, budget // torch.tensor([], dtype=dtype).element_size()))
        params[f"p{i:04d}"] = nn.Parameter(torch.randn(numel).to(dtype), requires_grad=False)
        budget -= numel * params[f"p{i:04d}"].element_size()
        i += 1
    return params


def state_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def median_time(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def write_report(path: str, result: dict, markdown: str) -> int:
    """Write a benchmark's JSON to ``path`` (its ``--out``), print its table and where it went."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown)
    print(f"\nwrote {path}")
    return 0


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
