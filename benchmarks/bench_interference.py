"""Replication on real (virtual) links: time to safe against the link floor, and what
every-step checkpointing costs training whose collectives cross the same links.

Setup: ``LocalCluster(4, network="netns", link=--link)``: each simulated host's Ray node in its
own network namespace, its link shaped to ``--link`` in both directions (``tc tbf``), one rank
per host, gloo over the links. Needs CAP_NET_ADMIN (root); elsewhere it writes a result that
says why it was skipped and exits 0.

1. **Time to safe, no training** (``--safe-mb`` per rank, FSDP2 linear stack, replicas=2):
   ``save()`` -> committed, median of ``--saves`` (slowest rank), against
   - the *link floor*: shard bytes x (replicas - 1) / link rate (each host sends its shard to
     one peer over its own link while receiving one, so the floor is one shard's time on a link);
   - a raw TCP stream of the same bytes between the same hosts at the same time.
2. **Interference** (DDP and FSDP2 training of a ``--layers`` x ``--dim`` linear stack, batch
   ``--batch``, AdamW): step time p50/p95 (slowest rank; ``--steps`` after a warm-up) without
   checkpointing, and with a save every step (replicas=2) uncapped, capped
   (``replication_bandwidth`` = ``--cap`` of the link), and interleaved with training's
   collectives (``CheckpointConfig(interleave=True)`` plus the library's DDP/FSDP2 hooks), with
   the median time to safe of the versions. Each workload of ``--device-ms``: 0 computes on the
   shared CPU cores; MS > 0 emulates an accelerator (a step's forward+backward take MS of wall
   time with the CPU released, collectives issued ahead as on a GPU). ``--comm-dtype bf16``:
   FSDP2 in mixed precision (all-gathers and reduce-scatters in bf16, the state in fp32 with
   AdamW's moments: the checkpoint is 6x the bytes per parameter that a collective moves, as in
   LLM training); ``--amsgrad`` adds a third fp32 moment (8x: 16 bytes of checkpoint per
   parameter, the mixed-precision figure with bf16 weights or an EMA beside the fp32 master).
   No checkpoint runs first and again last, pooled: every cost is against both.
   ``--configs`` picks rows (``m``: every step with no copies and the collectives marked, their
   durations the interleaved row's are compared with; ``n``: ``interleave="network"``, the data
   plane marked lower-effort and no gate). ``--qos``: links that honour priority
   (``LocalCluster(qos=True)``, as switches with a scavenger class); unmarked traffic (every
   other row) still shares one queue per link, HTB's packet FIFO instead of tbf's. ``--staging overlap``: every
   checkpointing row copies the parameters and optimizer state during the next step.

Usage::

    python benchmarks/bench_interference.py              # 1 Gbit/s, 128 MiB time-to-safe, 30 steps, CPU + 300 ms accelerator
    python benchmarks/bench_interference.py --quick      # small sizes, a few steps
    python benchmarks/bench_interference.py --kinds fsdp2 --dim 2048 --comm-dtype bf16 \
        --device-ms 1400 --saves 0 --steps 20             # docs/benchmarks.md "Interleaving, measured"
    python benchmarks/bench_interference.py --kinds fsdp2 --dim 2048 --comm-dtype bf16 \
        --device-ms 1400 --saves 0 --steps 20 --qos --staging overlap --configs lunm
    python benchmarks/bench_interference.py --kinds fsdp2 --dim 2048 --layers 10 --comm-dtype bf16 \
        --amsgrad --device-ms 4800 --saves 0 --steps 20 --qos --staging overlap --configs luin  # the target

Writes ``benchmarks/results/interference.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from _common import write_report  # noqa: E402
from _raybench import stop_cluster  # noqa: E402

HOSTS = 4
MIB = 1 << 20


class _Busy(torch.autograd.Function):
    """An emulated accelerator kernel: forward and backward take ``fwd_s`` / ``bwd_s`` of wall
    time with the CPU released, as a GPU host's CPU waits on its device."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class DeviceTime(torch.nn.Module):
    """Passes its input through after ``fwd_s`` (its backward after ``bwd_s``)."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return _Busy.apply(x, self.fwd_s, self.bwd_s)


class NetRank:
    """One rank of the job, inside its host's namespace."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)

    def serve_rendezvous(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: the rendezvous store, listening on a port the kernel picks in this host's
        namespace (a port picked free and bound later can be taken meanwhile)."""
        import datetime

        import torch.distributed as dist

        self.store = dist.TCPStore(
            ray.util.get_node_ip_address(),
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return ray.util.get_node_ip_address(), self.store.port

    def setup(self, rank: int, world_size: int, master: tuple[str, int], timeout_s: float = 600) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = (
            self.store
            if rank == 0
            else dist.TCPStore(master[0], master[1], world_size, is_master=False, timeout=timeout)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def build(
        self,
        kind: str,
        layers: int,
        dim: int,
        batch: int,
        device_ms: float = 0.0,
        comm_dtype: str = "fp32",
        amsgrad: bool = False,
    ) -> int:
        """The model to train (``ddp``, ``fsdp2``) or to save (``stack``: FSDP2, no optimizer);
        returns the bytes this rank's checkpoint holds. With ``device_ms``, each layer is followed
        by an emulated accelerator: a step's forward and backward take ``device_ms`` (1:2) with the
        CPU released, and the collectives are issued ahead as on a GPU (DDP: one bucket per layer;
        FSDP2: the next layer's all-gather prefetched in forward and backward)."""
        import torch
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        from gemini_ckpt.toy import fully_shard_layers, linear_stack

        mesh = init_device_mesh("cpu", (self.world_size,))
        self.kind, self.opt = kind, None
        if kind == "stack":
            self.model = linear_stack(layers, dim, mesh, seed=self.rank)
            return sum(p.to_local().nbytes for p in self.model.parameters())
        torch.manual_seed(0)
        if device_ms > 0:
            fwd, bwd = device_ms / 3e3 / layers, 2 * device_ms / 3e3 / layers
            blocks = [nn.Sequential(nn.Linear(dim, dim, bias=False), DeviceTime(fwd, bwd)) for _ in range(layers)]
        else:
            blocks = [nn.Linear(dim, dim, bias=False) for _ in range(layers)]
        model = nn.Sequential(*blocks)
        if kind == "ddp":
            per_layer_mb = dim * dim * 4 / MIB
            model = nn.parallel.DistributedDataParallel(
                model, **({"bucket_cap_mb": per_layer_mb} if device_ms > 0 else {})
            )
        elif comm_dtype == "bf16":  # mixed precision: gathered and reduced in bf16, kept in fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        else:
            fully_shard_layers(model, mesh, layers=blocks)
            if device_ms > 0:
                for i, block in enumerate(blocks):
                    block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
                    block.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i])
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, amsgrad=amsgrad)
        self.batch = torch.rand(batch, dim, generator=torch.Generator().manual_seed(self.rank))
        self._step()  # the optimizer's state exists from here on
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        copies = 4 if amsgrad else 3  # the parameters and AdamW's moments (amsgrad: a third)
        return sum(t.nbytes for t in local) * copies // (1 if kind == "fsdp2" else self.world_size)

    def _step(self) -> None:
        loss = self.model(self.batch).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _checkpointer(
        self, namespace: str, cap: int | None, interleave: bool, replicas: int = 2, staging: str = "copy"
    ):
        from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState

        fields = CheckpointConfig.__dataclass_fields__
        extra = {"interleave": interleave} if "interleave" in fields else {}
        if "staging" in fields:
            extra["staging"] = staging
        ckpt = Checkpointer(
            TrainState(model=self.model, optimizer=self.opt),
            CheckpointConfig(
                store="ray",
                namespace=namespace,
                replicas=replicas,
                keep_in_memory=1,
                timeout_s=self.timeout_s,
                replication_bandwidth=cap,
                **extra,
            ),
        )
        if interleave is True:  # the gate: the library's hooks mark the collectives
            import gemini_ckpt

            if hasattr(gemini_ckpt, "interleave"):
                gemini_ckpt.interleave(self.model, ckpt)
        return ckpt

    def safe(self, namespace: str, saves: int) -> list[float]:
        """Seconds from ``save()`` to committed, ``saves`` times after one warm-up save."""
        from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState

        ckpt = Checkpointer(
            TrainState(model=self.model),
            CheckpointConfig(store="ray", namespace=namespace, replicas=2, keep_in_memory=1, timeout_s=self.timeout_s),
        )
        out = []
        try:
            for step in range(saves + 1):
                t0 = time.perf_counter()
                ckpt.save(step).committed.result(timeout=self.timeout_s)
                if step:
                    out.append(time.perf_counter() - t0)
        finally:
            ckpt.close()
        return out

    def train(
        self,
        steps: int,
        warmup: int,
        namespace: str | None,
        cap: int | None,
        interleave: bool,
        replicas: int = 2,
        staging: str = "copy",
        timeline: bool = False,
    ) -> dict:
        """Step times (training + save) and each version's save -> committed seconds; with
        ``timeline`` (rank 0 only: it perturbs its steps), each version's host-store phases in
        seconds after its ``save()``, fetched during the next step."""
        ckpt = self._checkpointer(namespace, cap, interleave, replicas, staging) if namespace else None
        times, stalls, safe, lock = [], [], [], threading.Lock()
        phases, saved_at = [], {}
        begun = time.perf_counter()

        def committed_at(t0: float):
            def record(_future) -> None:
                with lock:
                    safe.append(time.perf_counter() - t0)

            return record

        try:
            for step in range(warmup + steps):
                t0 = time.perf_counter()
                self._step()
                if ckpt is not None and timeline and self.rank == 0 and step - 1 in saved_at:
                    phases.append(_store_timeline(namespace, step - 1, saved_at[step - 1]))
                if ckpt is not None:
                    t1 = time.perf_counter()
                    saved_at[step] = time.time()
                    handle = ckpt.save(step)
                    if step >= warmup:
                        stalls.append(time.perf_counter() - t1)
                        handle.committed.add_done_callback(committed_at(t1))
                if step >= warmup:
                    times.append(time.perf_counter() - t0)
            if ckpt is not None:
                ckpt.wait(timeout=self.timeout_s)
        except BaseException:
            if ckpt is not None:  # the error goes to the driver now, not after close() waited for versions
                threading.Thread(target=ckpt.abort, daemon=True).start()
            raise
        if ckpt is not None:
            ckpt.close()
        return {
            "step_s": times,
            "safe_s": safe,
            "save_s": stalls,
            "wall_s": time.perf_counter() - begun,
            "timeline": phases,
        }

    # --- the floor: raw TCP between the same hosts over the same links ---------------------------
    def raw_listen(self, nbytes: int) -> tuple[str, int]:
        server = socket.create_server((ray.util.get_node_ip_address(), 0))
        server.settimeout(self.timeout_s)
        buf = np.empty(nbytes, np.uint8)

        def serve():
            conn, _ = server.accept()
            conn.settimeout(self.timeout_s)
            view, got = memoryview(buf), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, 4 * MIB))
                if not n:
                    break
                got += n
            conn.sendall(b"k")
            conn.close()
            server.close()

        threading.Thread(target=serve, daemon=True).start()
        return server.getsockname()

    def raw_send(self, target: tuple[str, int], nbytes: int) -> float:
        data = np.ones(nbytes, np.uint8)
        t0 = time.perf_counter()
        with socket.create_connection(tuple(target), timeout=self.timeout_s) as sock:
            sock.sendall(memoryview(data))
            sock.recv(1)
        return time.perf_counter() - t0

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _store_timeline(namespace: str, step: int, saved_at: float) -> dict:
    """Per host store, when each phase of ``step`` happened, in seconds after its ``save()``."""
    from gemini_ckpt.hoststore.cluster import alive_node_ids, find_store

    out = {}
    for node in alive_node_ids():
        handle = find_store(namespace, node)
        if handle is not None:
            marks = ray.get(handle.timeline.remote(step), timeout=60)
            out[node[:12]] = {k: round(v - saved_at, 4) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    return out


def _gate_counters(namespace: str) -> dict:
    """Each host store's interleaving counters (pieces, waits, chunk size, measured rate)."""
    from gemini_ckpt.hoststore.cluster import alive_node_ids, find_store

    out = {}
    for node in alive_node_ids():
        handle = find_store(namespace, node)
        if handle is not None:
            out[node[:12]] = ray.get(handle.describe.remote(), timeout=60).get("interleave", {})
    return out


def _gather(refs: list, timeout: float, what: str) -> list:
    """Every rank's answer, or the first rank's error at once: ranks wait for each other in
    collectives, so one that fails leaves the others blocked until gloo's timeout (the run then
    hangs with nothing on its log); and a deadline on the whole call."""
    deadline, pending = time.monotonic() + timeout, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{what}: {len(pending)} of {len(refs)} ranks had not answered after {timeout:.0f} s")
        ray.get(ready)  # a rank's error, raised here as soon as it happens
    return ray.get(refs)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(r[i] for r in per_rank) for i in range(min(len(r) for r in per_rank))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", default="1gbit", help="each host's link rate, tc units (default 1gbit)")
    ap.add_argument("--safe-mb", type=int, default=128, help="shard per rank for time to safe (MiB, default 128)")
    ap.add_argument("--saves", type=int, default=3, help="timed saves for time to safe (0: skip that part)")
    ap.add_argument("--kinds", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=None, help="default 64 computed on the CPU, 8 with --device-ms")
    ap.add_argument(
        "--device-ms",
        type=float,
        nargs="+",
        default=[0.0, 300.0],
        help="workloads to run: 0 computes on the shared CPU cores; MS > 0 emulates an accelerator, "
        "a step's forward+backward taking MS with the CPU released and the collectives issued "
        "ahead (default: 0 300)",
    )
    ap.add_argument(
        "--comm-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="FSDP2's all-gathers and reduce-scatters in this dtype (bf16: mixed precision, the "
        "state kept in fp32); DDP always fp32",
    )
    ap.add_argument(
        "--amsgrad",
        action="store_true",
        help="AdamW with amsgrad: a third fp32 moment, 16 bytes of checkpoint per parameter instead "
        "of 12 (as mixed precision's 16 with bf16 weights or an EMA beside the fp32 master), "
        "for the same bytes on the wire per step",
    )
    ap.add_argument("--steps", type=int, default=30, help="timed training steps per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--configs",
        default="luci",
        help="which to run besides no checkpoint: l no copies, u uncapped, c capped, i interleaved (the "
        "gate), n interleaved by the network (marked, no gate; with --qos), m no copies with the "
        "collectives marked (default luci)",
    )
    ap.add_argument(
        "--staging",
        choices=["copy", "overlap"],
        default="copy",
        help="CheckpointConfig.staging for every checkpointing row (overlap: the parameters' and "
        "optimizer state's copy runs during the next forward and backward)",
    )
    ap.add_argument(
        "--qos",
        action="store_true",
        help="links that honour priority (LocalCluster(qos=True): DSCP CS1 goes only when other traffic "
        "leaves the link idle), as a switch with a scavenger class; unmarked traffic shares one queue "
        "per link as without it",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="diagnosis: rank 0 fetches each version's host-store phases during the next step (its "
        "step times then include the Ray calls)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds a collective may wait for the other ranks and a version for its commit (quick: 120)",
    )
    ap.add_argument("--cap", type=float, default=0.5, help="replication_bandwidth as a fraction of the link")
    ap.add_argument("--quick", action="store_true", help="16 MiB time to safe, 2 layers, 8 steps, --qos, row n too")
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
            "interference.json",
        ),
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.safe_mb, args.saves, args.layers, args.steps, args.warmup, args.device_ms = 16, 1, 2, 8, 2, [300.0]
        args.timeout = min(args.timeout, 120)
        args.qos, args.configs = True, args.configs + ("n" if "n" not in args.configs else "")

    from gemini_ckpt.testing import netns
    from gemini_ckpt.hoststore.cluster import shutdown_host_stores
    from gemini_ckpt.testing.cluster import LocalCluster

    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()}
    reason = netns.unavailable_reason()
    if reason is not None:
        result = {"question": "replication on shaped links", "skipped": reason, "machine": machine}
        return write_report(args.out, result, f"skipped: {reason}")
    link_bits = netns.parse_rate(args.link)
    link_bytes = link_bits / 8
    plasma = 256 * MIB
    cluster = LocalCluster(
        HOSTS, head_cpus=1, object_store_bytes=plasma, network="netns", link=args.link, qos=args.qos
    ).start()
    namespaces = []
    try:
        ranks = [ray.remote(NetRank).options(num_cpus=0, resources={f"host{i}": 0.01}).remote() for i in range(HOSTS)]
        master = _gather([ranks[0].serve_rendezvous.remote(HOSTS, args.timeout)], args.timeout, "start")[0]
        _gather(
            [r.setup.remote(i, HOSTS, master, args.timeout) for i, r in enumerate(ranks)], args.timeout, "rendezvous"
        )

        # 1. time to safe without training
        safe_row = None
        if args.saves > 0:
            layers = max(1, round(args.safe_mb * MIB * HOSTS / (1024 * 1024 * 4)))
            shard = _gather([r.build.remote("stack", layers, 1024, 0) for r in ranks], args.timeout, "build")[0]
            namespaces.append("bench-net-safe")
            safe = _slowest(
                _gather([r.safe.remote("bench-net-safe", args.saves) for r in ranks], 3 * args.timeout, "time to safe")
            )
            shutdown_host_stores("bench-net-safe")
            addrs = _gather([r.raw_listen.remote(shard) for r in ranks], args.timeout, "raw TCP listen")
            raw = max(
                _gather(
                    [r.raw_send.remote(addrs[(i + 1) % HOSTS], shard) for i, r in enumerate(ranks)],
                    args.timeout,
                    "raw TCP",
                )
            )
            floor = shard / link_bytes
            safe_row = {
                "shard_bytes": shard,
                "replicas": 2,
                "link_floor_s": floor,
                "raw_tcp_s": raw,
                "save_to_committed_s": statistics.median(safe),
                "raw": safe,
                "vs_floor": statistics.median(safe) / floor,
                "raw_vs_floor": raw / floor,
            }
            print(
                f"time to safe: {safe_row['save_to_committed_s']:.3f}s for {shard / MIB:.0f} MiB per host, "
                f"link floor {floor:.3f}s ({safe_row['vs_floor']:.2f}x), raw TCP {raw:.3f}s",
                flush=True,
            )

        # 2. interference
        cap = int(args.cap * link_bytes)
        # (label, namespace tag, cap, interleave, replicas); replicas=1 saves every step without
        # sending a byte: the CPU cost of checkpointing on these shared cores, apart from the links
        configs = [
            ("no checkpoint", None, None, False, 2),
            ("every step, no copies (replicas=1)", "l", None, False, 1),
            ("every step, uncapped", "u", None, False, 2),
            (f"every step, capped {args.cap:.0%} of link", "c", cap, False, 2),
            ("every step, interleaved", "i", None, True, 2),
            # no gate, the data plane marked lower-effort (CS1): on links that honour
            # priority (--qos) the network interleaves it packet by packet
            ("every step, interleaved by the network (CS1, no gate)", "n", None, "network", 2),
            # marked but nothing to send: the collectives' own durations, for comparison
            ("every step, no copies, collectives marked", "m", None, True, 1),
        ]
        configs = [c for c in configs if c[1] is None or c[1] in args.configs]
        rows = []
        for device_ms, kind in [(d, k) for d in args.device_ms for k in args.kinds]:
            batch = args.batch or (8 if device_ms else 64)
            state = _gather(
                [
                    r.build.remote(kind, args.layers, args.dim, batch, device_ms, args.comm_dtype, args.amsgrad)
                    for r in ranks
                ],
                args.timeout,
                f"build {kind}",
            )
            base = None
            for label, tag, limit, inter, replicas in configs:
                ns = None if tag is None else f"bench-net-{kind}-{device_ms:.0f}-{tag}"
                if ns:
                    namespaces.append(ns)
                out = _gather(
                    [
                        r.train.remote(args.steps, args.warmup, ns, limit, inter, replicas, args.staging, args.timeline)
                        for r in ranks
                    ],
                    3 * args.timeout,
                    f"{kind} {label}",
                )
                steps = _slowest([o["step_s"] for o in out])
                safe_s = [s for o in out for s in o["safe_s"]]
                row = {
                    "kind": kind,
                    "device_ms": device_ms,
                    "batch": batch,
                    "config": label,
                    "state_bytes_per_rank": max(state),
                    "p50_s": statistics.median(steps),
                    "p95_s": _pct(steps, 0.95),
                    "raw": steps,
                    "safe_p50_s": statistics.median(safe_s) if safe_s else None,
                    # save(): the copy, plus any wait for the previous version (back-pressure)
                    "save_p50_s": statistics.median(_slowest([o["save_s"] for o in out])) if ns else None,
                }
                if base is None:
                    base = row
                row["p50_overhead"] = row["p50_s"] / base["p50_s"] - 1
                row["p95_overhead"] = row["p95_s"] / base["p95_s"] - 1
                if args.timeline:
                    row["timeline"] = out[0]["timeline"]
                if ns and inter is True:
                    row["gate"] = _gate_counters(ns)
                    # the share of the training's wall time its collectives were in flight (marked)
                    wall = min(o["wall_s"] for o in out)
                    busy = [g.get("busy_s", 0.0) / wall for g in row["gate"].values() if wall > 0]
                    row["collectives_busy_fraction"] = statistics.mean(busy) if busy else None
                if safe_s and replicas > 1:
                    row["safe_vs_floor"] = row["safe_p50_s"] / (max(state) / link_bytes)
                rows.append(row)
                print(
                    f"{kind} device_ms={device_ms:.0f} {label}: p50 {row['p50_s'] * 1e3:.0f} ms ({row['p50_overhead']:+.1%}), "
                    f"p95 {row['p95_s'] * 1e3:.0f} ms ({row['p95_overhead']:+.1%})"
                    + (f", time to safe {row['safe_vs_floor']:.2f}x floor" if row.get("safe_vs_floor") else ""),
                    flush=True,
                )
                if ns:
                    shutdown_host_stores(ns)
            # the baseline again at the end, pooled with the first (a noisy minute on a shared
            # machine moves one run of it; every cost is against both)
            again = _slowest(
                [
                    o["step_s"]
                    for o in _gather(
                        [r.train.remote(args.steps, args.warmup, None, None, False) for r in ranks],
                        3 * args.timeout,
                        f"{kind} no checkpoint, again",
                    )
                ]
            )
            base["raw"] = base["raw"] + again
            base["p50_s"], base["p95_s"] = statistics.median(base["raw"]), _pct(base["raw"], 0.95)
            for row in rows:
                if row["kind"] == kind and row["device_ms"] == device_ms:
                    row["p50_overhead"] = row["p50_s"] / base["p50_s"] - 1
                    row["p95_overhead"] = row["p95_s"] / base["p95_s"] - 1
            print(
                f"{kind} device_ms={device_ms:.0f} no checkpoint, both runs: p50 {base['p50_s'] * 1e3:.0f} ms, "
                f"p95 {base['p95_s'] * 1e3:.0f} ms",
                flush=True,
            )
        _gather([r.teardown.remote() for r in ranks], 120, "teardown")
    finally:
        stop_cluster(cluster, namespaces)

    result = {
        "question": "replication on shaped links: time to safe vs the link floor; training interference",
        "hosts": HOSTS,
        "link": args.link,
        "link_bits_per_s": link_bits,
        "layers": args.layers,
        "dim": args.dim,
        "comm_dtype": args.comm_dtype,
        "amsgrad": args.amsgrad,
        "staging": args.staging,
        "qos": args.qos,
        "device_ms": args.device_ms,
        "steps": args.steps,
        "cap_fraction": args.cap,
        "machine": machine,
        "safe": safe_row,
        "interference": rows,
    }
    return write_report(args.out, result, _markdown(result))


def _markdown(result: dict) -> str:
    s = result["safe"]
    shaper = "tc htb honouring DSCP CS1 as lower-effort" if result.get("qos") else "tc tbf"
    lines = [
        f"{result['hosts']} hosts, each in its own network namespace on a {result['link']} link "
        f"({shaper}, both ways), {result['machine']['cpus']} cores shared"
        + (f", staging={result['staging']}" if result.get("staging", "copy") != "copy" else ""),
        "",
    ]
    if s:
        lines += [
            "| time to safe | seconds | vs link floor |",
            "|---|---|---|",
            f"| link floor ({s['shard_bytes'] / MIB:.0f} MiB per host, replicas=2) | {s['link_floor_s']:.3f} | 1.00x |",
            f"| raw TCP, same hosts, same time | {s['raw_tcp_s']:.3f} | {s['raw_vs_floor']:.2f}x |",
            f"| gemini_ckpt save -> committed | {s['save_to_committed_s']:.3f} | {s['vs_floor']:.2f}x |",
            "",
        ]
    for device_ms in dict.fromkeys(r.get("device_ms", 0) for r in result["interference"]):
        rows = [r for r in result["interference"] if r.get("device_ms", 0) == device_ms]
        lines += [
            f"Training ({result['layers']} x {result['dim']}^2 linears, batch {rows[0].get('batch')}, AdamW"
            + (" with amsgrad" if result.get("amsgrad") else "")
            + (f", {result['comm_dtype']} collectives" if result.get("comm_dtype", "fp32") != "fp32" else "")
            + (
                f", an emulated accelerator: {device_ms:.0f} ms forward+backward per step with the CPU released"
                if device_ms
                else ", computed on the shared CPU cores"
            )
            + f"), {result['steps']} steps, slowest rank:",
            "",
            "| model | checkpointing | state per rank (MiB) | step p50 (ms) | p50 cost | step p95 (ms) | p95 cost "
            "| save() p50 (ms) | time to safe p50 (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            safe = f"{r['safe_p50_s']:.3f}" if r.get("safe_p50_s") is not None else "-"
            if r.get("safe_vs_floor") is not None:
                safe += f" ({r['safe_vs_floor']:.2f}x floor)"
            save = f"{r['save_p50_s'] * 1e3:.0f}" if r.get("save_p50_s") is not None else "-"
            lines.append(
                f"| {r['kind']} | {r['config']} | {r['state_bytes_per_rank'] / MIB:.1f} | {r['p50_s'] * 1e3:.0f} "
                f"| {r['p50_overhead']:+.1%} | {r['p95_s'] * 1e3:.0f} | {r['p95_overhead']:+.1%} | {save} "
                f"| {safe} |"
            )
        busy = [r for r in rows if r.get("collectives_busy_fraction") is not None]
        if busy:
            lines += [
                "",
                "collectives in flight (interleaved runs): "
                + ", ".join(f"{r['kind']} {r['collectives_busy_fraction']:.0%} of the time" for r in busy),
            ]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
