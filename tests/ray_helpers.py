"""Training ranks as Ray actors, for the multi-host tests (on the session's
:class:`gemini_ckpt.testing.cluster.LocalCluster`, the ``ray_cluster`` fixture of
``tests/integration/conftest.py``).

- :class:`Ranks`: one :class:`RankWorker` actor per host (rank ``i`` pinned to ``host{i}``), each
  a :class:`~gemini_ckpt.testing.ranks.TrainingRank` training a small FSDP2 model over gloo with a
  ``Checkpointer``, its process group joined through a
  :class:`~gemini_ckpt.testing.ranks.Rendezvous`; dead workers are replaced by
  :meth:`Ranks.replace_dead`, and a job restarts with :meth:`Ranks.setup` (new process group).

Add/remove hosts only from the main thread (``Cluster`` is not thread-safe).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from gemini_ckpt.state.digest import digest as digest_state  # noqa: E402
from gemini_ckpt.testing.ranks import Rendezvous, TrainingRank  # noqa: E402

TIMEOUT_S = 180.0  # the process group's join and collectives


def node_id_of_host(i: int) -> str:
    """The Ray node id of live simulated host ``i``."""
    for n in ray.nodes():
        if n["Alive"] and n["Resources"].get(f"host{i}"):
            return n["NodeID"]
    raise LookupError(f"no alive node with resource host{i}")


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


# --- the training rank ---------------------------------------------------------------------------


class RankWorker(TrainingRank):
    """One training process: FSDP2 over gloo, AdamW, a Checkpointer with ``store="ray"``."""

    def setup(
        self, rank: int, world_size: int, rendezvous: tuple, config: dict, seed: int = 0, ballast_mb: int = 0
    ) -> dict:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from gemini_ckpt import CheckpointConfig, TrainState
        from gemini_ckpt.toy import fully_shard_layers, mlp

        self.teardown()
        self.join(rank, world_size, tuple(rendezvous), TIMEOUT_S)
        self.seed = seed
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(seed)
        model = fully_shard_layers(mlp(64), mesh)
        if ballast_mb:  # saved state that takes no part in training: ``ballast_mb`` MB per rank
            from torch.distributed.tensor import Shard, distribute_tensor

            model.register_buffer(
                "ballast", distribute_tensor(torch.ones(ballast_mb * world_size * 2**18), mesh, [Shard(0)])
            )
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.state = TrainState(model=model, optimizer=self.opt, extra={"seen": 0})
        self.replace_checkpointer(self.state, CheckpointConfig(**config))
        return self.info()

    def train_step(self, step: int) -> None:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + self.rank)
        x = torch.randn(8, 32, generator=g)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.state.extra["seen"] += 8

    def digest(self) -> str:
        return digest_state([self.state.tensor_state(), self.state.extra])

    def train(self, steps: list[int], timeout: float = 120.0) -> list[dict]:
        """Train and save each step; wait until the version is committed (or failed)."""
        from gemini_ckpt import BackgroundError

        out = []
        for step in steps:
            self.train_step(step)
            try:
                handle = self.ckpt.save(step)
            except Exception as exc:  # noqa: BLE001 - e.g. this node's store is gone: reported
                out.append(
                    {"step": step, "committed": False, "error": f"{type(exc).__name__}: {exc}", "digest": self.digest()}
                )
                continue
            digest = self.digest()
            try:
                handle.committed.result(timeout=timeout)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                error = f"{type(exc).__name__}: {exc}"
                cause = exc.__cause__
                while cause is not None:
                    error += f" <- {type(cause).__name__}: {cause}"
                    cause = cause.__cause__
                try:
                    self.ckpt.wait()  # the stored background error is raised here once; training goes on
                except BackgroundError:
                    pass
            out.append({"step": step, "committed": error is None, "error": error, "digest": digest})
        return out

    def full_digest(self) -> str:
        """Digest of the whole (unsharded) model and optimizer state: comparable across world
        sizes. Collective: every rank must call it."""
        from torch.distributed.tensor import DTensor

        def full(tree):
            if isinstance(tree, DTensor):
                return tree.full_tensor()
            if isinstance(tree, dict):
                return {k: full(v) for k, v in tree.items()}
            if isinstance(tree, (list, tuple)):
                return type(tree)(full(v) for v in tree)
            return tree

        return digest_state(full(self.state.tensor_state()))

    def die_at(self, phase: str, step: int) -> None:
        """SIGKILL this process when the library reaches ``phase`` of version ``step``."""
        import signal

        from gemini_ckpt import faults as _faults

        def hook(p, **ctx):
            if p == phase and ctx.get("step") == step:
                os.kill(os.getpid(), signal.SIGKILL)

        _faults.set_hook(hook)

    def restore(self, step: Optional[int] = None) -> dict:
        from gemini_ckpt.format.kept import KEPT

        reused = KEPT.reused
        result = self.ckpt.restore(step)
        store = self.ckpt.store
        read = {} if result is None else result.bytes_read
        return {
            "step": None if result is None else result.step,
            "digest": self.digest(),
            "source": None if result is None else result.source,
            "sources": None if result is None else result.sources,
            "read_local": read.get("local", 0),
            "read_peer": read.get("peer", 0),
            "read_durable": read.get("durable", 0),
            "slot": getattr(store, "slot", None),
            "kept_maps_reused": KEPT.reused - reused,  # mappings this process had made before
        }

    def interleave(self) -> None:
        """Hook the model's collectives (FSDP2) for this rank's Checkpointer (docs/interleave.md)."""
        import gemini_ckpt

        self.ckpt.start()
        gemini_ckpt.interleave(self.model, self.ckpt)

    def mark(self) -> None:
        """Enter a collective and never leave it (as a rank that dies inside one)."""
        self.ckpt.comm_marker().enter()

    def store_call(self, method: str, *args) -> Any:
        """Call the Checkpointer's memory tier directly (on this rank)."""
        return getattr(self.ckpt.store, method)(*args)

    def save_then_die(self, step: int) -> None:
        """Train and save ``step``, then SIGKILL this process the moment ``save`` returns."""
        import signal

        self.train_step(step)
        self.ckpt.save(step)
        os.kill(os.getpid(), signal.SIGKILL)

    def save_timed(self, step: int, timeout: float = 120.0) -> dict:
        """Train and save ``step``; when the outcome came (monotonic clock) and what it was."""
        self.train_step(step)
        handle = self.ckpt.save(step)
        try:
            handle.committed.result(timeout=timeout)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        return {"done": time.monotonic(), "error": error}

    def save_then_abort(self, step: int) -> dict:
        """Train and save ``step``, then ``abort()`` at once: how long abort took, and what the
        version's handle said afterwards."""
        self.train_step(step)
        handle = self.ckpt.save(step)
        t0 = time.monotonic()
        self.ckpt.abort()
        abort_s = time.monotonic() - t0
        try:
            handle.committed.result(timeout=30)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        self.ckpt = None
        return {"abort_s": abort_s, "error": error, "resolved_s": time.monotonic() - t0}


class Ranks:
    """``world_size`` RankWorkers, rank ``i`` on host ``i``."""

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = world_size
        self.workers = [self._start(i) for i in range(world_size)]
        self.infos = ray.get([w.info.remote() for w in self.workers], timeout=120)

    @staticmethod
    def _start(i: int):
        return ray.remote(RankWorker).options(num_cpus=0, resources={f"host{i}": 0.01}, max_restarts=0).remote()

    def setup(self, namespace: str, ballast_mb: int = 0, **config) -> list[dict]:
        self._rendezvous = Rendezvous(self.world_size, TIMEOUT_S)  # kept open while the job runs
        cfg = {"store": "ray", "namespace": namespace, "replicas": 2, "keep_in_memory": 2, "timeout_s": 120.0, **config}
        self.infos = ray.get(
            [
                w.setup.remote(r, self.world_size, self._rendezvous.address, cfg, 0, ballast_mb)
                for r, w in enumerate(self.workers)
            ],
            timeout=300,
        )
        return self.infos

    def restart(self, namespace: str, **config) -> list[dict]:
        """A job (re)start: stop every survivor's Checkpointer and process group, replace dead
        workers (on the same simulated host), set every rank up again in ``namespace``."""
        self.teardown()
        self.replace_dead()
        return self.setup(namespace, **config)

    def call(self, method: str, *args, timeout: float = 300.0) -> list:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            late = [r for r, ref in enumerate(refs) if ref in pending]
            raise TimeoutError(f"{method}{args!r}: ranks {late} did not finish within {timeout}s")
        return ray.get(refs)

    def train(self, steps: list[int]) -> list[list[dict]]:
        """Per rank, per step: committed, error, digest."""
        return self.call("train", list(steps))

    def alive(self, i: int) -> bool:
        """False once Ray knows worker ``i`` died (a busy worker counts as alive)."""
        ref = self.workers[i].info.remote()
        ready, _ = ray.wait([ref], timeout=10)
        if not ready:
            return True
        try:
            ray.get(ref)
            return True
        except ray.exceptions.RayActorError:
            return False

    def replace_dead(self) -> list[int]:
        dead = [i for i in range(self.world_size) if not self.alive(i)]
        for i in dead:
            self.workers[i] = self._start(i)
        ray.get([self.workers[i].info.remote() for i in dead], timeout=120)
        return dead

    def teardown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.teardown.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)


def status(namespace: str):
    from gemini_ckpt.cli.status import cluster_status

    return cluster_status(namespace)[namespace]


def placement_holders(
    slot: int, hosts: int = 4, replicas: int = 2, strategy: str = "auto", dead: Optional[set] = None
) -> tuple[int, ...]:
    from gemini_ckpt.hoststore.slots import holders_for

    return holders_for(slot, hosts=hosts, replicas=replicas, strategy=strategy, dead=dead or ())


def corrupt_shard_copy(namespace: str, host: int, step: int, rank: int) -> str:
    """Flip one byte inside the biggest tensor item of host ``host``'s copy of rank ``rank``'s
    shard of ``step``; returns the item's key."""
    from gemini_ckpt.chaos import damage_copy
    from gemini_ckpt.hoststore.cluster import find_store
    from gemini_ckpt.format.shards import ShardPlan

    store = find_store(namespace, node_id_of_host(host))
    plan_bytes, _ = ray.get(store.shard_info.remote(step, [rank]))[rank]
    item = max(ShardPlan.decode(plan_bytes).tensors, key=lambda t: t.nbytes)
    damage_copy(store, step, rank, item.at + item.nbytes // 2)
    return item.fqn


def holds_own_shard(namespace: str, host: int, step: int) -> bool:
    """Whether host ``host``'s store holds a complete copy of its own rank's shard of ``step``."""
    from gemini_ckpt.hoststore.cluster import find_store

    index = ray.get(find_store(namespace, node_id_of_host(host)).index.remote())
    shard = index.get(step, {}).get("shards", {}).get(host)
    return bool(shard and shard["complete"])
