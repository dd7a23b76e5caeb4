"""Shared harness for the multi-host benchmarks (restore, persist): a local Ray cluster of
simulated hosts (one Ray node each, all on this machine) and one FSDP2 rank actor per host (a
:class:`gemini_ckpt.testing.ranks.TrainingRank`, its process group joined through a
:class:`~gemini_ckpt.testing.ranks.Rendezvous` this process holds).

The rank class is shipped to Ray workers by value (``cloudpickle.register_pickle_by_value``),
so the workers need not have ``benchmarks/`` on their path."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from gemini_ckpt.testing.ranks import Rendezvous, TrainingRank  # noqa: E402

LAYER_DIM = 2048  # one fp32 layer = 16 MiB, sharded over the ranks
TIMEOUT_S = 900  # the process group's join and collectives, and each Checkpointer's


def load_average() -> list[float]:
    return list(os.getloadavg())


def drop_page_cache() -> tuple[bool, str]:
    """Try ``sync; echo 3 > /proc/sys/vm/drop_caches``; (dropped?, why not)."""
    try:
        subprocess.run(["sync"], check=False, timeout=120)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"


def start_cluster(hosts: int, plasma_bytes: int):
    """A head (1 CPU) plus ``hosts`` simulated hosts with the library's health checks
    (:class:`gemini_ckpt.testing.cluster.LocalCluster`), this process connected."""
    from gemini_ckpt.testing.cluster import LocalCluster

    return LocalCluster(hosts, head_cpus=1, object_store_bytes=plasma_bytes).start()


def stop_cluster(cluster, namespaces=()) -> None:
    """Stop ``cluster`` (its gemini_ckpt actors first, ``namespaces`` included)."""
    from gemini_ckpt.hoststore.cluster import shutdown_host_stores

    for ns in namespaces:
        try:
            shutdown_host_stores(ns)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
    cluster.shutdown()


def median(values: list[float]) -> float:
    return statistics.median(values)


class Rank(TrainingRank):
    """One rank: an FSDP2 stack of Linear layers whose local shard is about ``mb`` MB."""

    def setup(self, rank: int, world_size: int, rendezvous: tuple, mb: int, fill: bool = True) -> int:
        from torch.distributed.device_mesh import init_device_mesh

        from gemini_ckpt.toy import linear_stack

        self.join(rank, world_size, tuple(rendezvous), TIMEOUT_S)
        layers = max(1, round(mb * world_size / (LAYER_DIM * LAYER_DIM * 4 / 2**20)))
        mesh = init_device_mesh("cpu", (world_size,))
        self.model = model = linear_stack(layers, LAYER_DIM, mesh, seed=rank, fill=fill)
        return sum(p.to_local().nbytes for p in model.parameters())

    def node_id(self) -> str:
        return self.info()["node_id"]

    def checkpointer(self, **config):
        from gemini_ckpt import CheckpointConfig, TrainState

        return self.replace_checkpointer(
            TrainState(model=self.model), CheckpointConfig(store="ray", timeout_s=TIMEOUT_S, **config)
        )

    def close(self) -> None:
        self.close_checkpointer()

    # --- restore ------------------------------------------------------------------------------
    def save_version(self, step: int, persist: bool, **config) -> dict:
        ckpt = self.checkpointer(**config)
        handle = ckpt.save(step, persist=persist)
        handle.committed.result(timeout=900)
        if persist:
            handle.persisted.result(timeout=900)
        return {"stall_s": handle.staged.result().stall_s}

    def restore(self, **config) -> dict:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        ckpt = self.checkpointer(**config)
        result = ckpt.restore()
        wall = time.perf_counter() - t0
        self.close()
        return {
            "wall_s": wall,
            "seconds": result.seconds,
            "source": result.source,
            "where": result.sources[self.rank],
            "bytes_read": result.bytes_read,
            "step": result.step,
            "path": result.path,
            "stages": result.stage_seconds(),
        }

    def copy_floor(self, repeats: int = 2) -> float:
        """The floor of a restore from memory: one plain copy of this rank's bytes from a buffer
        in this process into the live tensors (seconds, the best of ``repeats``)."""
        import numpy as np
        import torch
        import torch.distributed as dist

        locals_ = [p.detach().to_local() for p in self.model.parameters()]
        src = np.random.default_rng(0).integers(0, 255, sum(t.nbytes for t in locals_), dtype=np.uint8)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            at = 0
            for t in locals_:
                t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(src[at : at + t.nbytes]))
                at += t.nbytes
            best = min(best, time.perf_counter() - t0)
        return best

    def dcp_save(self, path: str) -> float:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"model": self.model.state_dict()}, checkpoint_id=path)
        return time.perf_counter() - t0

    def dcp_load(self, path: str) -> float:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        sd = {"model": self.model.state_dict()}
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=path)
        return time.perf_counter() - t0

    # --- persist ------------------------------------------------------------------------------
    def persist_run(self, rounds: int, **config) -> list[dict]:
        """Per round: a memory-only save, then a persisting save, then (while the persist runs)
        another memory-only save; times each stall, save -> committed and save -> persisted."""
        ckpt = self.checkpointer(**config)
        out = []
        step = 0
        for _ in range(2):  # warm-up: connect, plan, first allocations
            ckpt.save(step).committed.result(timeout=900)
            step += 1
        for _ in range(rounds):
            h0 = ckpt.save(step)
            h0.committed.result(timeout=900)
            step += 1
            t0 = time.perf_counter()
            h1 = ckpt.save(step, persist=True)
            done: list[float] = []
            h1.persisted.add_done_callback(lambda _f, done=done: done.append(time.perf_counter()))
            h1.committed.result(timeout=900)
            t_commit = time.perf_counter() - t0
            step += 1
            h2 = ckpt.save(step)  # overlaps the persist of h1
            h2.committed.result(timeout=900)
            step += 1
            h1.persisted.result(timeout=900)
            t_persist = (done[0] if done else time.perf_counter()) - t0
            out.append(
                {
                    "memory_stall_s": h0.staged.result().stall_s,
                    "persist_step_stall_s": h1.staged.result().stall_s,
                    "stall_during_persist_s": h2.staged.result().stall_s,
                    "save_to_committed_s": t_commit,
                    "save_to_persisted_s": t_persist,
                    "committed_to_persisted_s": t_persist - t_commit,
                }
            )
        self.close()
        return out

    def teardown(self, limit_s: float = 10.0) -> bool:
        """A benchmark's job ends cleanly: its Checkpointer is closed (in-flight work awaited), not
        aborted, before the process group is left."""
        self.close()
        return super().teardown(limit_s)


class RankGroup(list):
    """The rank actors of one job, and the :class:`Rendezvous` their process group joined (held
    open by this process until :func:`kill_ranks`)."""

    rendezvous: Rendezvous


def make_ranks(hosts: int, mb: int, *, rotate: int = 0, fill: bool = True, cls: type = Rank):
    """Rank ``r`` (a ``cls``, :class:`Rank` or a subclass) runs on simulated host
    ``(r + rotate) % hosts``; returns (a :class:`RankGroup`, shard bytes)."""
    for module in {__name__, cls.__module__}:  # shipped by value: Ray's own cloudpickle, not ours
        ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    ranks = RankGroup(
        ray.remote(cls).options(num_cpus=0, resources={f"host{(i + rotate) % hosts}": 0.01}).remote()
        for i in range(hosts)
    )
    ranks.rendezvous = Rendezvous(hosts, TIMEOUT_S)
    shard = ray.get(
        [r.setup.remote(i, hosts, ranks.rendezvous.address, mb, fill) for i, r in enumerate(ranks)], timeout=TIMEOUT_S
    )
    return ranks, int(statistics.mean(shard))


def kill_ranks(ranks: RankGroup) -> None:
    for r in ranks:
        try:
            ray.get(r.teardown.remote(), timeout=120)
        except Exception:  # noqa: BLE001 - best-effort
            pass
        ray.kill(r, no_restart=True)
    ranks.rendezvous.close()


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --- the raw TCP floor between the same nodes ------------------------------------------------------
class TcpEnd:
    """One end of a raw TCP floor measurement: plain blocking sockets, ``streams`` connections,
    each carrying its slice of ``nbytes`` (what the data plane's 4 streams do, without it)."""

    def __init__(self) -> None:
        self.server = None
        self.buffer = None

    def listen(self, nbytes: int, streams: int = 4) -> tuple:
        import socket

        import numpy as np

        self.buffer = np.zeros(nbytes, np.uint8)  # touched: like the live tensors a restore fills
        self.streams = streams
        self.server = socket.create_server((ray.util.get_node_ip_address(), 0))
        return self.server.getsockname()

    def receive(self) -> float:
        """Accept the sender's streams and read every byte; seconds from the first connection."""
        import threading

        import numpy as np

        socks = [self.server.accept()[0] for _ in range(self.streams)]
        t0 = time.perf_counter()
        bounds = np.linspace(0, self.buffer.nbytes, self.streams + 1).astype(int)
        view = memoryview(self.buffer)

        def run(i: int) -> None:
            part, pos = view[bounds[i] : bounds[i + 1]], 0
            while pos < len(part):
                k = socks[i].recv_into(part[pos:])
                if not k:
                    raise ConnectionError("the sender went away")
                pos += k
            socks[i].sendall(b"k")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(self.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in socks:
            s.close()
        return time.perf_counter() - t0

    def send(self, address: tuple, nbytes: int, streams: int = 4) -> float:
        import socket
        import threading

        import numpy as np

        data = np.ones(nbytes, np.uint8)
        bounds = np.linspace(0, nbytes, streams + 1).astype(int)
        socks = [socket.create_connection(tuple(address)) for _ in range(streams)]
        t0 = time.perf_counter()

        def run(i: int) -> None:
            socks[i].sendall(memoryview(data)[bounds[i] : bounds[i + 1]])
            socks[i].recv(1)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in socks:
            s.close()
        return time.perf_counter() - t0


def tcp_floor(pairs: list[tuple[int, int]], nbytes: int) -> float:
    """Seconds until every ``(sender host, receiver host)`` pair moved ``nbytes`` over raw TCP,
    all pairs at once (the slowest pair)."""
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ends = [
        (
            ray.remote(TcpEnd).options(num_cpus=0, resources={f"host{s}": 0.01}, max_concurrency=2).remote(),
            ray.remote(TcpEnd).options(num_cpus=0, resources={f"host{r}": 0.01}, max_concurrency=2).remote(),
        )
        for s, r in pairs
    ]
    try:
        addresses = ray.get([recv.listen.remote(nbytes) for _, recv in ends], timeout=300)
        received = [recv.receive.remote() for _, recv in ends]
        sent = [send.send.remote(addr, nbytes) for (send, _), addr in zip(ends, addresses)]
        ray.get(sent, timeout=600)
        return max(ray.get(received, timeout=600))
    finally:
        for pair in ends:
            for actor in pair:
                ray.kill(actor, no_restart=True)
