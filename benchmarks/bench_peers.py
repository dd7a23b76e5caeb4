"""GEMINI's official implementation (``lm-resiliency``), this library and stock PyTorch DCP on
the same state, on the same machine, in one run.

The state: an FSDP2 stack of bias-free Linear layers (``gemini_ckpt.toy.linear_stack``)
sharded over 4 ranks (gloo, CPU) plus its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``),
about ``--mb`` MB per rank in all (a third of it parameters). Each library is driven through
its public API, in its own harness:

- **lm-resiliency** (PyPI ``lm-resiliency``, GEMINI's authors' implementation) under torchrun
  (``python -m torch.distributed.run --nproc-per-node 4 bench_peers.py --worker ...``):
  ``lm_resiliency.enable_resiliency(model, optimizer, interval=1, enable_detection=False,
  checkpoint=InMemoryCkptConfig(...), device=cpu, recovery_mode="latest")``; every
  ``optimizer.step()`` saves through its post-step hook (local copy into its own buffers, then
  a chunked gloo send to the paired rank). Its peer replica survives a restart only through
  ``flush_for_restart()`` (the SIGTERM path: own and peer buffers to node-local disk), which a
  restarted worker reads. Each simulated node gets its own ``disk_folder``; "peer" = the rank
  reads the folder of its replication peer.
- **gemini_ckpt** under Ray (``benchmarks/_raybench.py``: a local cluster of 4 simulated
  hosts, one rank actor per host): ``Checkpointer(TrainState(model, optimizer),
  CheckpointConfig(store="ray", replicas=2, keep_in_memory=2))``; local restore = a new
  Checkpointer on the same ranks, peer restore = ranks restarted on other hosts
  (``make_ranks(rotate=2)``), as ``bench_restore.py`` does.
- **stock DCP** (``dcp.async_save`` to local disk, warm ``dcp.load`` + ``set_state_dict``),
  run in *both* harnesses; every ratio is against the DCP of the same harness.

Rows: save stall (training thread blocked, median over saves of the slowest rank), time to
safe (save -> replicated to a peer; DCP: -> on local disk), restore from own memory and from a
peer, host memory kept per rank, and a byte flipped in an in-memory replica (caught or restored
silently). A killed rank is not measured here (see ``bench_restore.py``/``bench_recovery.py``).

Setup::

    pip install -e ".[peers]"      # or: pip install -c constraints.txt lm-resiliency==0.2.0

Usage::

    RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 python benchmarks/bench_peers.py   # 128 MB/rank
    python benchmarks/bench_peers.py --mb 256
    python benchmarks/bench_peers.py --quick                                            # 16 MB/rank

Writes ``benchmarks/results/peers.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HOSTS = 4
PG_TIMEOUT_S = 600
INSTALL_HINT = (
    'lm-resiliency is not installed; to compare against it run:  pip install -e ".[peers]"  '
    "(or: pip install -c constraints.txt lm-resiliency==0.2.0)"
)


# --- shared by both harnesses --------------------------------------------------------------------
def param_mb(state_mb: float) -> float:
    """Parameter shard MB per rank for ``state_mb`` of state (params + AdamW's two moments)."""
    return state_mb / 3.0


def build_state(rank: int, world: int, mb: float, fill: bool = True):
    """The FSDP2 linear stack of ``_raybench.Rank.setup`` (same sizes) plus AdamW with its state
    materialized by one step on zero gradients. Needs the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from _raybench import LAYER_DIM
    from gemini_ckpt.toy import linear_stack

    layers = max(1, round(mb * world / (LAYER_DIM * LAYER_DIM * 4 / 2**20)))
    mesh = init_device_mesh("cpu", (world,))
    model = linear_stack(layers, LAYER_DIM, mesh, seed=rank, fill=fill)
    opt = make_optimizer(model)
    return model, opt


def make_optimizer(model):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return opt


def local_tensors(model, opt) -> list:
    """Every local shard of the state: parameters, then each parameter's optimizer state."""
    import torch

    out = []
    for p in model.parameters():
        out.append(p.detach().to_local() if hasattr(p, "to_local") else p.detach())
    for p in model.parameters():
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def state_bytes(model, opt) -> int:
    return sum(t.nbytes for t in local_tensors(model, opt))


def digest(model, opt) -> int:
    """CRC-32 over every local byte of the state (a flipped byte changes it)."""
    import torch

    crc = 0
    for t in local_tensors(model, opt):
        crc = zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def perturb(model, opt) -> None:
    """Overwrite the live state so a restore that does nothing is caught."""
    import torch

    with torch.no_grad():
        for t in local_tensors(model, opt):
            if t.is_floating_point():
                t.add_(1.0)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_async_saves(model, opt, directory: str, saves: int) -> list[dict]:
    """``saves`` timed ``dcp.async_save`` (after one warm-up): the stall (until it returns)
    and save -> on disk (its future done)."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out = []
    for i in range(saves + 1):
        opt.step()
        path = os.path.join(directory, f"step{i}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=path)
        stall = time.perf_counter() - t0
        fut.result(timeout=PG_TIMEOUT_S)
        done = time.perf_counter() - t0
        if i:
            out.append({"stall_s": stall, "safe_s": done})
        dist.barrier()
        if dist.get_rank() == 0 and i:
            shutil.rmtree(os.path.join(directory, f"step{i - 1}"), ignore_errors=True)
    return out


def dcp_load_warm(model, opt, directory: str, saves: int) -> dict:
    """Warm ``dcp.load`` of the newest DCP save into the live state (load + set_state_dict)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(directory, f"step{saves}")
    expect = digest(model, opt)
    perturb(model, opt)
    dist.barrier()
    t0 = time.perf_counter()
    sd = dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "digest_ok": digest(model, opt) == expect}


# --- lm-resiliency under torchrun (one process per rank) -----------------------------------------
def peer_worker(args) -> int:
    """The torchrun worker: DCP, then lm-resiliency, on this rank's state; writes its JSON."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build_state(rank, world, param_mb(args.mb))
    out: dict = {"rank": rank, "state_bytes": state_bytes(model, opt)}
    try:
        # lm-resiliency first, so that its RSS growth is not hidden by memory DCP freed before it.
        out["lmr"] = _lmr_phases(model, opt, rank, world, args)
        out["dcp"] = {"saves": dcp_async_saves(model, opt, os.path.join(args.workdir, "dcp_torchrun"), args.saves)}
        out["dcp"]["load"] = dcp_load_warm(model, opt, os.path.join(args.workdir, "dcp_torchrun"), args.saves)
    finally:
        with open(os.path.join(args.workdir, f"peer-rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _lmr_enable(model, opt, folder: str, run_id: str):
    """lm-resiliency's public entry point: GEMINI checkpointing only (SCOUT detection off),
    every optimizer step saved, CRC-32 on its node-local disk files, no periodic disk flush."""
    import torch
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    cfg = InMemoryCkptConfig(
        disk_flush_interval=0, disk_folder=folder, run_id=run_id, pin_memory=False, verify_integrity=True
    )
    return enable_resiliency(
        model,
        opt,
        interval=1,
        enable_detection=False,
        checkpoint=cfg,
        device=torch.device("cpu"),
        recovery_mode="latest",
    )


def _lmr_phases(model, opt, rank: int, world: int, args) -> dict:
    import torch.distributed as dist

    peer = rank ^ 1  # lm-resiliency's pairing on CPU: replication_jump = 1 -> (0,1), (2,3)
    nodes = [os.path.join(args.workdir, "lmr", f"node{r}") for r in range(world)]
    run_id = f"bench-peers-{args.run_tag}"
    res: dict = {"peer_rank": peer}

    # Timing hooks around lm-resiliency's own post-step hook: one registered before it, one after
    # (optimizer post-step hooks run in registration order).
    marks: dict = {}
    h_before = opt.register_step_post_hook(lambda *_: marks.__setitem__("a", time.perf_counter()))
    rss0 = rss_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    handle = _lmr_enable(model, opt, nodes[rank], run_id)
    res["enable_s"] = time.perf_counter() - t0
    h_after = opt.register_step_post_hook(lambda *_: marks.__setitem__("b", time.perf_counter()))
    saves = []
    for i in range(args.saves + 1):  # the first save allocates the 4 buffer slots and the pair's group
        dist.barrier()
        opt.step()  # -> lm-resiliency's hook: save_tensors(every local shard, step)
        ok = handle.ckpt_manager.finalize_replication(timeout_s=PG_TIMEOUT_S)
        safe = time.perf_counter() - marks["a"]
        if i:
            saves.append({"stall_s": marks["b"] - marks["a"], "safe_s": safe, "replicated": bool(ok)})
    res["saves"] = saves
    res["last_step"] = handle.step_count
    res["rss_growth_bytes"] = rss_bytes() - rss0
    expect = digest(model, opt)
    h_before.remove()
    h_after.remove()

    # Own memory: the same process rolls back to its newest in-memory copy.
    perturb(model, opt)
    dist.barrier()
    t0 = time.perf_counter()
    step = handle.try_recover(mode="latest")
    res["restore_memory"] = {
        "wall_s": time.perf_counter() - t0,
        "step": step,
        "digest_ok": digest(model, opt) == expect,
    }

    # The restart path: SIGTERM-style flush of own + peer buffers to node-local disk.
    dist.barrier()
    t0 = time.perf_counter()
    flushed = handle.flush_for_restart()
    res["flush"] = {"wall_s": time.perf_counter() - t0, "step": flushed}
    handle.close()
    del handle

    # Restart on the same node: a new handle (empty memory) recovers from its node's disk.
    # Restart on the peer's node: rank r reads the folder its peer flushed rank r's replica into.
    for name, folder in (("restore_own_disk", nodes[rank]), ("restore_peer_disk", nodes[peer])):
        perturb(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        h = _lmr_enable(model, opt, folder, run_id)  # recovers at construction
        enable = time.perf_counter() - t0
        row = {"enable_with_recovery_s": enable, "step": h.recovered_step, "digest_ok": digest(model, opt) == expect}
        perturb(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        row["step_again"] = h.try_recover(mode="latest")
        row["wall_s"] = time.perf_counter() - t0
        row["digest_ok_again"] = digest(model, opt) == expect
        res[name] = row
        h.close()
        del h

    res["corrupt"] = _lmr_corrupt(model, opt, rank, world, args)
    return res


def _lmr_corrupt(model, opt, rank: int, world: int, args) -> dict:
    """Flip one byte of rank 0's replica held in rank 1's memory, then the restart path:
    flush, restart with rank 0 reading rank 1's node folder; restored silently or caught?"""
    import torch
    import torch.distributed as dist

    peer = rank ^ 1
    nodes = [os.path.join(args.workdir, "lmr_corrupt", f"node{r}") for r in range(world)]
    run_id = f"bench-peers-corrupt-{args.run_tag}"
    out: dict = {"target": "rank 0's replica in rank 1's peer buffer"}
    handle = _lmr_enable(model, opt, nodes[rank], run_id)
    for _ in range(2):
        dist.barrier()
        opt.step()
        handle.ckpt_manager.finalize_replication(timeout_s=PG_TIMEOUT_S)
    expect = digest(model, opt)
    out["saved_step"] = handle.step_count
    injected = False
    if rank == 1:
        # lm-resiliency has no public hook to reach its replica buffers; the only way in is the
        # manager's private buffer pool (read-only use of its layout: the newest peer slot).
        try:
            slot = handle.ckpt_manager._buffer_pool.peer_current
            t = max(slot.tensors, key=lambda x: x.nbytes)
            b = t.reshape(-1).view(torch.uint8)
            b[b.numel() // 2] ^= 0xFF
            injected = True
            out["injected_step"] = slot.step
        except Exception as exc:  # noqa: BLE001 - report, do not fail the run
            out["inject_error"] = f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([int(injected)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    out["injected"] = bool(flag.item())
    dist.barrier()
    handle.flush_for_restart()
    handle.close()
    del handle
    perturb(model, opt)
    dist.barrier()
    h = _lmr_enable(model, opt, nodes[peer], run_id)
    out["restored_step"] = h.recovered_step
    out["digest_ok"] = digest(model, opt) == expect
    h.close()
    del h
    out["on_disk"] = _lmr_corrupt_file(model, opt, rank, world, args)
    return out


def _lmr_corrupt_file(model, opt, rank: int, world: int, args) -> dict:
    """The same, but the byte is flipped in the file flush_for_restart() wrote (rank 0's replica,
    ``step-N/rank-0.pt`` in rank 1's node folder): at rest, where its CRC-32 applies."""
    import glob

    import torch.distributed as dist

    peer = rank ^ 1
    nodes = [os.path.join(args.workdir, "lmr_corrupt_file", f"node{r}") for r in range(world)]
    run_id = f"bench-peers-corrupt-file-{args.run_tag}"
    out: dict = {"target": "rank 0's replica file flushed by rank 1 (node-local disk)"}
    handle = _lmr_enable(model, opt, nodes[rank], run_id)
    expect = {}
    for _ in range(2):
        dist.barrier()
        opt.step()
        handle.ckpt_manager.finalize_replication(timeout_s=PG_TIMEOUT_S)
        expect[handle.step_count] = digest(model, opt)
    out["saved_step"] = handle.step_count
    dist.barrier()
    handle.flush_for_restart()
    handle.close()
    del handle
    dist.barrier()
    if rank == 1:
        files = glob.glob(os.path.join(nodes[1], "**", f"step-{out['saved_step']}", "rank-0.pt"), recursive=True)
        out["files"] = files
        if files:
            with open(files[0], "r+b") as f:
                f.seek(0, os.SEEK_END)
                at = f.tell() // 2
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    perturb(model, opt)
    h = _lmr_enable(model, opt, nodes[peer], run_id)
    out["restored_step"] = h.recovered_step
    out["digest_ok"] = digest(model, opt) == expect.get(h.recovered_step)
    h.close()
    return out


def run_peer(args, workdir: str, timeout: float) -> tuple[dict, dict]:
    """Run the torchrun job; (per-rank results aggregated, log tail)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(HOSTS),
        "--max-restarts",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        os.path.abspath(__file__),
        "--worker",
        "--mb",
        str(args.mb),
        "--saves",
        str(args.saves),
        "--workdir",
        workdir,
        "--run-tag",
        str(os.getpid()),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [
                os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    log_path = os.path.join(workdir, "torchrun.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
    wall = time.perf_counter() - t0
    with open(log_path) as f:
        text = f.read()
    tail = text[-4000:]
    # what lm-resiliency logged about checkpoints it rejected (checksum / format), for the JSON
    rejected = [
        line
        for line in text.splitlines()
        if any(w in line for w in ("checksum", "Checkpoint validation failed", "malformed", "rejected"))
    ]
    per_rank = []
    for r in range(HOSTS):
        p = os.path.join(workdir, f"peer-rank{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                per_rank.append(json.load(f))
    return {"rc": rc, "wall_s": wall, "per_rank": per_rank}, {"log_tail": tail, "log_rejections": rejected[:20]}


# --- gemini_ckpt under Ray (the _raybench harness) -----------------------------------------------
def _peer_rank_class():
    import _raybench as rb

    class PeerRank(rb.Rank):
        """``_raybench.Rank`` with AdamW state next to the model, saved and restored with it."""

        def setup(self, rank, world_size, rendezvous, mb, fill=True):
            super().setup(rank, world_size, rendezvous, mb, fill)
            self.opt = make_optimizer(self.model)
            return state_bytes(self.model, self.opt)

        def checkpointer(self, **config):
            from gemini_ckpt import CheckpointConfig, TrainState

            return self.replace_checkpointer(
                TrainState(model=self.model, optimizer=self.opt),
                CheckpointConfig(store="ray", timeout_s=PG_TIMEOUT_S, **config),
            )

        def ours_saves(self, saves: int, **config) -> dict:
            import torch.distributed as dist

            ckpt = self.checkpointer(**config)
            out = []
            step = 0
            for i in range(saves + 2):  # two warm-ups: connect, plan, first segments
                self.opt.step()
                dist.barrier()
                t0 = time.perf_counter()
                handle = ckpt.save(step)
                stall = time.perf_counter() - t0
                handle.committed.result(timeout=PG_TIMEOUT_S)
                safe = time.perf_counter() - t0
                if i >= 2:
                    out.append({"stall_s": stall, "staged_stall_s": handle.staged.result().stall_s, "safe_s": safe})
                step += 1
            self.close()
            return {"saves": out, "last_step": step - 1, "digest": digest(self.model, self.opt)}

        def restore_checked(self, expect: int, **config) -> dict:
            import torch.distributed as dist

            perturb(self.model, self.opt)
            dist.barrier()
            t0 = time.perf_counter()
            ckpt = self.checkpointer(**config)
            result = ckpt.restore()
            wall = time.perf_counter() - t0
            self.close()
            return {
                "wall_s": wall,
                "step": result.step,
                "source": result.source,
                "where": result.sources[self.rank],
                "bytes_read": result.bytes_read,
                "skipped_steps": list(result.skipped_steps),
                "skipped_reasons": {str(k): v for k, v in result.skipped_reasons.items()},
                "digest_ok": digest(self.model, self.opt) == expect,
                "path": result.path,
                "stages": result.stage_seconds(),
            }

        def restore_and_stay(self, **config) -> int:
            """Restore and keep the Checkpointer open (attached to its host store), as a job does."""
            return self.checkpointer(**config).restore().step

        def dcp_saves(self, directory: str, saves: int) -> list[dict]:
            return dcp_async_saves(self.model, self.opt, directory, saves)

        def dcp_load(self, directory: str, saves: int) -> dict:
            return dcp_load_warm(self.model, self.opt, directory, saves)

    return PeerRank


def _make_ranks(hosts: int, mb: float, **kw):
    """``_raybench.make_ranks`` with :class:`PeerRank` (model + AdamW)."""
    import _raybench as rb

    return rb.make_ranks(hosts, mb, cls=_peer_rank_class(), **kw)


def _node_id_of_host(i: int) -> str:
    import ray

    for n in ray.nodes():
        if n["Alive"] and n["Resources"].get(f"host{i}"):
            return n["NodeID"]
    raise LookupError(f"no alive node with resource host{i}")


def _corrupt_own_copy(namespace: str, host: int, step: int, rank: int) -> int:
    """Flip one byte in the middle of the biggest item of host ``host``'s copy of ``rank``'s
    shard (``gemini_ckpt.chaos.damage_copy``, as the chaos harness does)."""
    import ray

    from gemini_ckpt.chaos import damage_copy
    from gemini_ckpt.hoststore.cluster import find_store
    from gemini_ckpt.format.shards import ShardPlan

    store = find_store(namespace, _node_id_of_host(host))
    plan_bytes, _ = ray.get(store.shard_info.remote(step, [rank]), timeout=60)[rank]
    item = max(ShardPlan.decode(plan_bytes).tensors, key=lambda t: t.nbytes)
    return damage_copy(store, step, rank, item.at + item.nbytes // 2)


def _store_memory(namespace: str) -> dict:
    from gemini_ckpt.cli.status import cluster_status

    ns = cluster_status(namespace)[namespace]
    return {
        "held_bytes": {h.slot: h.held_bytes for h in ns.hosts},
        "reserved_bytes": {h.slot: h.reserved_bytes for h in ns.hosts},
    }


def run_ours(args, workdir: str, out: dict) -> dict:
    """Fills ``out`` as it goes (so a failure part-way keeps what was measured)."""
    import ray

    import _raybench as rb

    pmb = param_mb(args.mb)
    plasma = max(256, 3 * min(args.mb, 64) * 2 + 64) * 2**20
    ns = f"bench-peers-{os.getpid()}"
    cfg = dict(namespace=ns, replicas=2, keep_in_memory=2, persist_on_close=False)
    out["namespace"] = ns
    ranks = []
    cluster = rb.start_cluster(HOSTS, plasma)
    try:
        ranks, shard = _make_ranks(HOSTS, pmb)
        out["state_bytes"] = shard
        saved = ray.get([r.ours_saves.remote(args.saves, **cfg) for r in ranks], timeout=1800)
        out["saves"] = [s["saves"] for s in saved]
        step = saved[0]["last_step"]
        digests = [s["digest"] for s in saved]
        out["memory"] = _store_memory(ns)

        # Local memory, twice (a new Checkpointer each time; the first also pays connection set-up).
        out["restore_local"] = []
        for _ in range(2):
            time.sleep(rb_restart_window())
            out["restore_local"].append(
                ray.get([r.restore_checked.remote(digests[i], **cfg) for i, r in enumerate(ranks)], timeout=1800)
            )

        # Stock DCP in the same harness.
        dcp_dir = os.path.join(workdir, "dcp_ray")
        out["dcp_saves"] = ray.get([r.dcp_saves.remote(dcp_dir, args.saves) for r in ranks], timeout=1800)
        out["dcp_load"] = ray.get([r.dcp_load.remote(dcp_dir, args.saves) for r in ranks], timeout=1800)
        rb.kill_ranks(ranks)
        ranks = []

        # Peer memory: rank r restarted on host r+2, its shard only on other hosts' stores.
        ranks, _ = _make_ranks(HOSTS, pmb, rotate=2, fill=False)
        out["restore_peer"] = []
        for _ in range(2):
            time.sleep(rb_restart_window())
            out["restore_peer"].append(
                ray.get([r.restore_checked.remote(digests[i], **cfg) for i, r in enumerate(ranks)], timeout=1800)
            )

        rb.kill_ranks(ranks)
        ranks = []

        # A flipped byte, (a) while the job runs: the job (back on its hosts) restored and holds
        # its Checkpointer open, as a training job does; host 1's copy of rank 1's shard (the one
        # rank 1 reads first) is flipped; the job goes down, restarts and restores.
        ranks, _ = _make_ranks(HOSTS, pmb, fill=False)
        time.sleep(rb_restart_window())
        ray.get([r.restore_and_stay.remote(**cfg) for r in ranks], timeout=1800)
        at = _corrupt_own_copy(ns, host=1, step=step, rank=1)
        rb.kill_ranks(ranks)
        ranks = []
        ranks, _ = _make_ranks(HOSTS, pmb, fill=False)
        time.sleep(rb_restart_window())
        got = ray.get([r.restore_checked.remote(digests[i], **cfg) for i, r in enumerate(ranks)], timeout=1800)
        out["corrupt"] = [
            {
                "scenario": "flipped while the job runs, then restart + restore",
                "rank": 1,
                "target": "host 1's copy of rank 1's shard (the one rank 1 reads first)",
                "step": step,
                "offset": at,
                "per_rank": got,
            }
        ]
        # (b) after the restart: the stores already checked their copies when the job went down;
        # host 0's copy of rank 0's shard is flipped after that check, right before a restore.
        time.sleep(rb_restart_window())
        at = _corrupt_own_copy(ns, host=0, step=step, rank=0)
        got = ray.get([r.restore_checked.remote(digests[i], **cfg) for i, r in enumerate(ranks)], timeout=1800)
        out["corrupt"].append(
            {
                "scenario": "flipped after the restart (after the stores' check), right before restore",
                "rank": 0,
                "target": "host 0's copy of rank 0's shard (the one rank 0 reads first)",
                "step": step,
                "offset": at,
                "per_rank": got,
            }
        )
        rb.kill_ranks(ranks)
        ranks = []
    finally:
        if ranks:
            rb.kill_ranks(ranks)
        rb.stop_cluster(cluster, [ns])
    return out


def rb_restart_window() -> float:
    """As bench_restore: the stores get the moment a restart would give them."""
    return 3.0


# --- aggregation and output ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slowest_median(per_rank: list[list[dict]], key: str) -> float:
    """Median over saves of the slowest rank."""
    n = min(len(r) for r in per_rank)
    return statistics.median(max(r[i][key] for r in per_rank) for i in range(n))


def _max(rows: list[dict], key: str) -> float:
    return max(r[key] for r in rows)


def summarize(peer: dict, ours: dict, args) -> dict:
    rows: list[dict] = []
    notes: list[str] = []
    P = peer.get("per_rank") or []
    ok_peer = len(P) == HOSTS and all("lmr" in r for r in P)

    # lm-resiliency / DCP under torchrun
    if ok_peer:
        L = [r["lmr"] for r in P]
        dcp_t = {
            "stall": _slowest_median([r["dcp"]["saves"] for r in P], "stall_s"),
            "safe": _slowest_median([r["dcp"]["saves"] for r in P], "safe_s"),
            "load": max(r["dcp"]["load"]["wall_s"] for r in P),
        }
        lm_stall = _slowest_median([x["saves"] for x in L], "stall_s")
        lm_safe = _slowest_median([x["saves"] for x in L], "safe_s")
        flush = _max([x["flush"] for x in L], "wall_s")
        own_disk = _max([x["restore_own_disk"] for x in L], "wall_s")
        peer_disk = _max([x["restore_peer_disk"] for x in L], "wall_s")
        rows += [
            _row(
                "save stall (s)",
                "lm-resiliency",
                lm_stall,
                dcp_t["stall"],
                "torchrun",
                "time in its optimizer post-step hook (save_tensors: on CPU a synchronous copy into its buffer)",
            ),
            _row(
                "time to safe (s)",
                "lm-resiliency",
                lm_safe,
                dcp_t["safe"],
                "torchrun",
                "hook start -> ckpt_manager.finalize_replication() True (own shard sent to and peer's received from the paired rank)",
            ),
            _row(
                "restore, own memory, same process (s)",
                "lm-resiliency",
                _max([x["restore_memory"] for x in L], "wall_s"),
                dcp_t["load"],
                "torchrun",
                "handle.try_recover(mode='latest') from its own buffer slot",
            ),
            _row(
                "restart, own shard (s)",
                "lm-resiliency",
                own_disk,
                dcp_t["load"],
                "torchrun",
                "after flush_for_restart(): try_recover() of a fresh handle from node-local disk (page cache warm)",
            ),
            _row(
                "restart, own shard incl. flush (s)",
                "lm-resiliency",
                own_disk + flush,
                dcp_t["load"],
                "torchrun",
                f"flush_for_restart() {flush:.3f} s + the load",
            ),
            _row(
                "restore from peer's replica (s)",
                "lm-resiliency",
                peer_disk,
                dcp_t["load"],
                "torchrun",
                "rank reads the file its peer flushed (folder of the peer's node; no network copy here)",
            ),
            _row(
                "restore from peer's replica incl. flush (s)",
                "lm-resiliency",
                peer_disk + flush,
                dcp_t["load"],
                "torchrun",
                "flush_for_restart() on the peer + the load",
            ),
            _row("save stall (s)", "DCP async_save (torchrun)", dcp_t["stall"], dcp_t["stall"], "torchrun", ""),
            _row(
                "time to safe (s)",
                "DCP async_save (torchrun)",
                dcp_t["safe"],
                dcp_t["safe"],
                "torchrun",
                "future done: on local disk, no copy elsewhere",
            ),
            _row(
                "restore (s)",
                "DCP load warm (torchrun)",
                dcp_t["load"],
                dcp_t["load"],
                "torchrun",
                "get_state_dict + dcp.load + set_state_dict, page cache warm",
            ),
        ]
        for x, key in ((L, "restore_memory"), (L, "restore_own_disk"), (L, "restore_peer_disk")):
            bad = [i for i, y in enumerate(x) if not (y[key].get("digest_ok") and y[key].get("digest_ok_again", True))]
            if bad:
                notes.append(f"lm-resiliency {key}: ranks {bad} did NOT get the saved bytes back")
        state = P[0]["state_bytes"]
        rss = [x["rss_growth_bytes"] for x in L]
        mem_lmr = {
            "rss_growth_bytes_per_rank": rss,
            "state_bytes_per_rank": state,
            "x_state": statistics.mean(rss) / state,
            # its documented design: 4 buffer slots (own current/previous, peer current/previous)
            "design_bytes_per_rank": 4 * state,
        }
        c = L[0]["corrupt"]
        corrupt_lmr = {
            **{k: v for k, v in c.items() if k != "digest_ok"},
            "digest_ok_rank0": c["digest_ok"],
            "inject_error": L[1]["corrupt"].get("inject_error"),
            "injected_step": L[1]["corrupt"].get("injected_step"),
            "verdict": (
                "not injected"
                if not c.get("injected")
                else "restored SILENTLY with the flipped byte"
                if c["restored_step"] == c["saved_step"] and not c["digest_ok"]
                else "caught (fell back)"
                if c["digest_ok"] or c["restored_step"] != c["saved_step"]
                else "unclear"
            ),
        }
        d = L[0]["corrupt"]["on_disk"]
        corrupt_lmr_disk = {
            **d,
            "files": L[1]["corrupt"]["on_disk"].get("files"),
            "verdict": (
                "restored SILENTLY with the flipped byte"
                if d["restored_step"] == d["saved_step"] and not d["digest_ok"]
                else f"caught: fell back to step {d['restored_step']} (all ranks)"
                if d["restored_step"] != d["saved_step"] and d["digest_ok"]
                else "bytes correct (no fallback seen)"
                if d["digest_ok"]
                else "unclear"
            ),
        }
    else:
        dcp_t, mem_lmr, corrupt_lmr, corrupt_lmr_disk = None, None, None, None
        notes.append(f"the lm-resiliency torchrun job failed (rc={peer.get('rc')}); see log_tail in the JSON")

    # gemini_ckpt / DCP under Ray (whatever part of it ran)
    ours = ours or {}
    if ours.get("error"):
        notes.append(f"the gemini_ckpt (Ray) part stopped early: {ours['error'].strip().splitlines()[-1]}")
    dcp_r = (
        {
            "stall": _slowest_median(ours["dcp_saves"], "stall_s"),
            "safe": _slowest_median(ours["dcp_saves"], "safe_s"),
            "load": _max(ours["dcp_load"], "wall_s"),
        }
        if "dcp_load" in ours
        else None
    )
    d = dcp_r or {"stall": None, "safe": None, "load": None}
    if "saves" in ours:
        rows += [
            _row(
                "save stall (s)",
                "gemini_ckpt",
                _slowest_median(ours["saves"], "stall_s"),
                d["stall"],
                "ray",
                "wall time of Checkpointer.save() (staging='copy': into the host store's shared memory)",
            ),
            _row(
                "time to safe (s)",
                "gemini_ckpt",
                _slowest_median(ours["saves"], "safe_s"),
                d["safe"],
                "ray",
                "save() -> handle.committed.result() (replicas=2, committed among the holders)",
            ),
        ]
    if len(ours.get("restore_local", [])) == 2:
        rows.append(
            _row(
                "restore, own memory (local host store), new Checkpointer (s)",
                "gemini_ckpt",
                _max(ours["restore_local"][-1], "wall_s"),
                d["load"],
                "ray",
                f"first in the run: {_max(ours['restore_local'][0], 'wall_s'):.3f} s",
            )
        )
    if len(ours.get("restore_peer", [])) == 2:
        rows.append(
            _row(
                "restore from peer's memory, ranks on other hosts (s)",
                "gemini_ckpt",
                _max(ours["restore_peer"][-1], "wall_s"),
                d["load"],
                "ray",
                f"first in fresh actors: {_max(ours['restore_peer'][0], 'wall_s'):.3f} s",
            )
        )
    if dcp_r:
        rows += [
            _row("save stall (s)", "DCP async_save (ray)", dcp_r["stall"], dcp_r["stall"], "ray", ""),
            _row("time to safe (s)", "DCP async_save (ray)", dcp_r["safe"], dcp_r["safe"], "ray", "on local disk"),
            _row(
                "restore (s)",
                "DCP load warm (ray)",
                dcp_r["load"],
                dcp_r["load"],
                "ray",
                "get_state_dict + dcp.load + set_state_dict, page cache warm",
            ),
        ]
    for key in ("restore_local", "restore_peer"):
        for attempt in ours.get(key, []):
            bad = [i for i, y in enumerate(attempt) if not y["digest_ok"]]
            if bad:
                notes.append(f"gemini_ckpt {key}: ranks {bad} did NOT get the saved bytes back")
    mem_ours = None
    if "memory" in ours:
        held = ours["memory"]["held_bytes"]
        mem_ours = {
            "held_bytes_per_host": held,
            "reserved_bytes_per_host": ours["memory"]["reserved_bytes"],
            "state_bytes_per_rank": ours["state_bytes"],
            "x_state": statistics.mean(held.values()) / ours["state_bytes"],
        }
    corrupt_ours = []
    for sc in ours.get("corrupt", []):
        c, k = sc["per_rank"], sc["rank"]
        got = {
            key: c[k][key]
            for key in ("step", "source", "where", "bytes_read", "skipped_steps", "skipped_reasons", "digest_ok")
        }
        verdict = (
            "caught: the bad item was read from the other holder"
            if got["digest_ok"] and got["step"] == sc["step"] and got["where"] != "local"
            else "caught (fell back to an older version/tier)"
            if got["digest_ok"] and got["step"] != sc["step"]
            else "bytes correct (no fallback seen)"
            if got["digest_ok"]
            else "restored SILENTLY with the flipped byte"
        )
        corrupt_ours.append(
            {
                "scenario": sc["scenario"],
                "target": sc["target"],
                "step": sc["step"],
                "rank": k,
                "restored": got,
                "all_digests_ok": all(r["digest_ok"] for r in c),
                "verdict": verdict,
            }
        )
        if "SILENTLY" in verdict:
            notes.append(
                f"gemini_ckpt, {sc['scenario']}: restored the flipped byte silently. A host store "
                "checks its copies when the job goes down here (a rank detaches) and marks them "
                "verified; a local reader then maps and copies a verified copy without checking it "
                "again (gemini_ckpt/restore/direct.py, 'verified'), so a flip after that check and "
                "before the read is not caught."
            )

    notes += [
        "Harnesses differ: lm-resiliency and its DCP baseline run as 4 torchrun processes (one per rank, "
        "one gloo world); gemini_ckpt and its DCP baseline run as 4 Ray actors, each on its own simulated "
        "Ray node, next to a host-store actor per node (4 ranks + 4 stores + Ray's daemons on the same cores). "
        "Every ratio is against the DCP of the same harness.",
        "lm-resiliency's in-memory copies live in the training process; a process restart loses them unless "
        "flush_for_restart() (its SIGTERM handler) wrote them to node-local disk first, and a rank on a new "
        "node gets its peer's replica as a file (copy_checkpoint_to / set_restart_destination, left to the "
        "caller). All simulated nodes share this machine's disk, so its 'peer' restore here reads the peer's "
        "folder in place: a lower bound (no network copy).",
        "On CPU lm-resiliency's AsyncDeviceCopier copies synchronously (its async path is a CUDA stream), so "
        "its stall here is a full memcpy of the state; on a GPU it would overlap.",
        "gemini_ckpt's time to safe is save() until every holder committed (replicas=2); lm-resiliency's is "
        "until the pairwise exchange finished on this rank (it has no commit among ranks).",
        "Killed rank: not measured in this benchmark (see bench_restore.py / bench_recovery.py for ours; "
        "lm-resiliency needs a torchrun restart with the SIGTERM flush).",
        "Timings share 2 cores with whatever else runs (load average in the JSON).",
    ]
    return {
        "rows": rows,
        "notes": notes,
        "memory": {"lm-resiliency": mem_lmr, "gemini_ckpt": mem_ours},
        "corruption": {
            "lm-resiliency": corrupt_lmr,
            "lm-resiliency on disk": corrupt_lmr_disk,
            "gemini_ckpt": corrupt_ours,
        },
        "dcp": {"torchrun": dcp_t, "ray": dcp_r},
    }


def _row(metric: str, library: str, seconds: float, dcp, harness: str, how: str) -> dict:
    return {
        "metric": metric,
        "library": library,
        "seconds": seconds,
        "harness": harness,
        "dcp_same_harness_s": dcp,
        "vs_dcp": (dcp / seconds) if dcp is not None and seconds > 0 else None,
        "how": how,
    }


def _markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"{HOSTS} ranks (FSDP2 + AdamW, gloo, CPU) on {result['machine']['cpus']} cores, "
        f"~{result['state_mb_per_rank']:.0f} MB of state per rank "
        f"(requested {result['mb_requested']} MB), median of {result['saves']} saves (slowest rank); "
        f"load avg start/end {result['load_average_start'][0]:.1f}/{result['load_average_end'][0]:.1f}",
        "",
        "| metric | library | seconds | harness | DCP same harness (s) | DCP / this (>1: faster than DCP) | how |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        ratio = f"{r['vs_dcp']:.2f}x" if r["vs_dcp"] is not None else "-"
        dcp = f"{r['dcp_same_harness_s']:.3f}" if r["dcp_same_harness_s"] is not None else "-"
        lines.append(
            f"| {r['metric']} | {r['library']} | {r['seconds']:.3f} | {r['harness']} | {dcp} | {ratio} | {r['how']} |"
        )
    lines += ["", "| host memory kept per rank | bytes | x state |", "|---|---|---|"]
    m = s["memory"]
    if m["lm-resiliency"]:
        x = m["lm-resiliency"]
        lines.append(
            f"| lm-resiliency: RSS growth of each training process after enable + saves "
            f"| {', '.join(f'{b / 1e6:.0f} MB' for b in x['rss_growth_bytes_per_rank'])} | {x['x_state']:.2f} |"
        )
        lines.append(
            f"| lm-resiliency by its design (BufferPool docstring: 4 slots, own + peer, current + previous) "
            f"| {x['design_bytes_per_rank'] / 1e6:.0f} MB | 4.00 |"
        )
    if m["gemini_ckpt"]:
        x = m["gemini_ckpt"]
        lines.append(
            f"| gemini_ckpt: bytes held by each host store (cluster_status held_bytes; replicas=2, "
            f"keep_in_memory=2) | {', '.join(f'{b / 1e6:.0f} MB' for b in x['held_bytes_per_host'].values())} "
            f"| {x['x_state']:.2f} |"
        )
    lines.append("| DCP async_save | nothing kept in memory after the save (disk) | 0 |")
    lines += ["", "| a byte flipped in a replica held in memory | verdict | detail |", "|---|---|---|"]
    c = s["corruption"]
    if c["lm-resiliency"]:
        x = c["lm-resiliency"]
        lines.append(
            f"| lm-resiliency: {x['target']}, flipped while the job runs, then flush + restart (via the private `ckpt_manager._buffer_pool`: no public hook) "
            f"| {x['verdict']} | saved step {x['saved_step']}, restored step {x['restored_step']}, "
            f"rank 0's bytes equal the saved ones: {x['digest_ok_rank0']} |"
        )
    if c.get("lm-resiliency on disk"):
        x = c["lm-resiliency on disk"]
        lines.append(
            f"| lm-resiliency: {x['target']}, flipped after the flush, before the restart (at rest; "
            f"verify_integrity=True) | {x['verdict']} | saved step {x['saved_step']}, restored step "
            f"{x['restored_step']}, rank 0's bytes equal that step's: {x['digest_ok']} |"
        )
    for x in c["gemini_ckpt"] or []:
        r = x["restored"]
        lines.append(
            f"| gemini_ckpt: {x['target']}, {x['scenario']} (gemini_ckpt.chaos.damage_copy) "
            f"| {x['verdict']} | step {r['step']} from {r['source']}, rank {x['rank']}'s bytes from "
            f"{r['where']}, bytes read {r['bytes_read']}, all ranks' bytes equal the saved ones: "
            f"{x['all_digests_ok']} |"
        )
    lines += ["", "Notes:"] + [f"- {n}" for n in s["notes"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="state per rank in MB: params + AdamW (default 128)")
    ap.add_argument("--quick", action="store_true", help="16 MB per rank, 3 saves")
    ap.add_argument("--saves", type=int, default=5, help="timed saves per library (after warm-up)")
    ap.add_argument("--skip-ours", action="store_true", help="lm-resiliency and its DCP baseline only")
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
            "peers.json",
        ),
    )
    # the torchrun worker (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--run-tag", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return peer_worker(args)
    if args.quick:
        args.mb, args.saves = 16, 3

    try:
        import lm_resiliency  # noqa: F401
    except ImportError:
        from _common import write_report

        return write_report(
            args.out, {"question": "lm-resiliency vs gemini_ckpt vs stock DCP", "skipped": INSTALL_HINT}, INSTALL_HINT
        )
    from importlib.metadata import version

    from _common import write_report

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="gemini_bench_peers_", dir=os.environ.get("BENCH_DISK_DIR"))
    try:
        peer, log = run_peer(args, workdir, timeout=300 if args.quick else 1800)
        ours: dict = {}
        if not args.skip_ours:
            try:
                run_ours(args, workdir, ours)
            except Exception:  # noqa: BLE001 - report what was measured, and why the rest was not
                import traceback

                ours["error"] = traceback.format_exc()
                print(ours["error"], file=sys.stderr)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(peer, ours, args)
    state = ours.get("state_bytes") or (peer["per_rank"][0]["state_bytes"] if peer["per_rank"] else 0)
    result = {
        "question": "lm-resiliency (GEMINI's implementation) vs gemini_ckpt vs stock DCP on the same state",
        "hosts": HOSTS,
        "mb_requested": args.mb,
        "state_bytes_per_rank": state,
        "state_mb_per_rank": state / 1e6,
        "saves": args.saves,
        "lm_resiliency_version": version("lm-resiliency"),
        "wall_s": time.perf_counter() - t_start,
        "load_average_start": list(load0),
        "load_average_end": list(os.getloadavg()),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
        "summary": summary,
        "raw": {"lm_resiliency_torchrun": {**peer, **log}, "gemini_ckpt_ray": ours},
    }
    return write_report(args.out, result, _markdown(result))


if __name__ == "__main__":
    sys.exit(main())
