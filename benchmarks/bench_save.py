"""Training-visible stall of ``save()`` vs the memcpy floor, torch.save, dcp.save, dcp.async_save.

    python benchmarks/bench_save.py            # ~1 GB state, 5 repeats
    python benchmarks/bench_save.py --quick    # 256 MB, 3 repeats

The floor is copying the same tensors into preallocated CPU buffers: the least any snapshot
that does not alias live memory can cost. Output: benchmarks/results/save.json and a table.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import uuid
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from _common import median_time, model_like, state_bytes, table, write_results
from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats = 256, 3
    warnings.simplefilter("ignore")
    model = model_like(args.mb)
    nbytes = state_bytes(model)
    tensors = list(model.state_dict().values())
    print(f"state: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB (fp32 + bf16)")

    buffers = [torch.empty_like(t) for t in tensors]

    def torch_copy():
        for b, t in zip(buffers, tensors):
            b.copy_(t)

    def raw_memcpy():
        for b, t in zip(buffers, tensors):
            np.copyto(b.view(torch.uint8).numpy(), t.detach().view(torch.uint8).numpy())

    torch_copy()
    t_torch_copy = median_time(torch_copy, args.repeats)
    t_memcpy = median_time(raw_memcpy, args.repeats)
    # The floor is the fastest way to make the copy on this machine, whichever that is.
    t_floor = min(t_torch_copy, t_memcpy)

    config = CheckpointConfig(store="local", namespace=uuid.uuid4().hex, keep_in_memory=1)
    ckpt = Checkpointer(TrainState(model=model), config)
    stalls, allocs = [], []
    for step in range(max(10, args.repeats)):
        handle = ckpt.save(step)
        stalls.append(handle.staged.result().stall_s)
        allocs.append((ckpt.stats.staging_allocations, ckpt.stats.staging_bytes))
        handle.committed.result()  # measure stall alone, not contention with the previous version
    ckpt.close()
    ours = sorted(stalls[2:])[len(stalls[2:]) // 2]  # the first saves plan and allocate segments
    first = stalls[0]

    tmp = tempfile.mkdtemp(prefix="bench_save_")
    try:
        t_torch = median_time(lambda: torch.save(model.state_dict(), f"{tmp}/model.pt"), args.repeats)
        t_dcp = median_time(
            lambda: dcp.save(model.state_dict(), checkpoint_id=f"{tmp}/dcp", no_dist=True),
            args.repeats,
            setup=lambda: shutil.rmtree(f"{tmp}/dcp", ignore_errors=True),
        )
        blocking = []

        def async_blocking():
            t0 = __import__("time").perf_counter()
            fut = dcp.async_save(model.state_dict(), checkpoint_id=f"{tmp}/async", no_dist=True)
            blocking.append(__import__("time").perf_counter() - t0)
            getattr(fut, "upload_completion", fut).result()

        for _ in range(args.repeats):
            shutil.rmtree(f"{tmp}/async", ignore_errors=True)
            async_blocking()
        t_async = sorted(blocking)[len(blocking) // 2]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [
        ["floor: memcpy into preallocated buffers", t_floor, 1.0],
        ["  Tensor.copy_ into preallocated buffers", t_torch_copy, t_torch_copy / t_floor],
        ["gemini_ckpt save() stall", ours, ours / t_floor],
        ["gemini_ckpt first save (plans with DCP, allocates a segment)", first, first / t_floor],
        ["torch.save to local disk", t_torch, t_torch / t_floor],
        ["dcp.save to local disk", t_dcp, t_dcp / t_floor],
        ["dcp.async_save (blocking part)", t_async, t_async / t_floor],
    ]
    print(table(["what", "seconds (median)", "x floor"], rows))
    # A version lives in the segment it was staged into: keep_in_memory + max_inflight segments
    # are made by the first saves, and every later save reuses one.
    settled = config.keep_in_memory + config.max_inflight
    grows = [a for a in allocs[settled:] if a != allocs[settled - 1]]
    print(
        f"staging memory: {allocs[-1][0]} segment(s) of {allocs[0][1] / 2**20:.0f} MiB; "
        f"{'constant' if not grows else 'GREW'} after the first {settled} of {len(allocs)} saves"
    )
    path = write_results(
        "save",
        {
            "state_bytes": nbytes,
            "tensors": len(tensors),
            "repeats": args.repeats,
            "seconds": {r[0]: r[1] for r in rows},
            "ratio_to_floor": {r[0]: r[2] for r in rows},
            "staging_bytes": allocs[0][1],
            "staging_allocations_per_save": [a[0] for a in allocs],
            "segments_constant_after": settled,
            "segments_grew": bool(grows),
            "target_ratio": 1.15,
            "target_met": ours / t_floor <= 1.15,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
