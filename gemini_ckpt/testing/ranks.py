"""A training rank as a Ray actor, and the rendezvous its process group joins: the machinery the
tests' ranks, the chaos harness's ranks and the benchmarks' ranks share.

- :class:`Rendezvous`: on the driver, the process group's ``TCPStore``, bound to port 0 and held
  open while the ranks run;
- :func:`join_group`: in a rank, join a gloo process group as a client of that store;
- :class:`TrainingRank`: the base of a rank actor: its identity (:meth:`~TrainingRank.info`), the
  join, a barrier, its ``Checkpointer`` (built, replaced, closed) and :meth:`~TrainingRank.teardown`.
  Each harness subclasses it with its own model and methods.

Example::

    rendezvous = Rendezvous(world_size, timeout_s=180)     # on the driver; kept while ranks run
    ranks = [ray.remote(MyRank).remote() for _ in range(world_size)]
    ray.get([r.join.remote(i, world_size, rendezvous.address, 180) for i, r in enumerate(ranks)])
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

LOOPBACK = "127.0.0.1"


class Rendezvous:
    """The rendezvous of one job start: a ``torch.distributed.TCPStore`` served by the driver,
    bound to port 0 so that the port it listens on is chosen by the kernel at ``bind`` and
    stays ours until :meth:`close`. Ranks connect to :attr:`address` as clients.

    (A port found free and released again before the process group binds it can be taken in
    between by any process on the machine: EADDRINUSE. Nothing here picks a port in advance.)

    ``host``: the address it binds and advertises; on hosts with their own network namespaces
    the head's bridge address, the one the ranks can reach.
    """

    HOST = LOOPBACK

    def __init__(self, world_size: int, timeout_s: float, *, host: str = HOST) -> None:
        import datetime

        import torch.distributed as dist

        self.host = host
        self._store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.port: int = self._store.port

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Stop serving and release the port (the store's last reference is dropped)."""
        self._store = None


def join_group(rendezvous: tuple[str, int], rank: int, world_size: int, timeout_s: float) -> None:
    """Join a gloo process group as a client of the store a :class:`Rendezvous` serves at
    ``rendezvous`` (host, port); ``timeout_s`` bounds the join and the group's collectives."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = rendezvous
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


class TrainingRank:
    """One training process as a Ray actor: a gloo process group joined through the driver's
    :class:`Rendezvous`, and at most one ``Checkpointer`` (:attr:`ckpt`) at a time.

    Subclasses build their model and state after :meth:`join` and hand them to
    :meth:`replace_checkpointer`. One thread for torch's CPU kernels: many ranks share this
    machine's cores."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = -1
        self.world_size = 0
        self.ckpt = None

    def info(self) -> dict:
        """This process's id and the Ray node it runs on."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def join(self, rank: int, world_size: int, rendezvous: tuple[str, int], timeout_s: float) -> None:
        """Become ``rank`` of ``world_size`` in a new gloo process group (:func:`join_group`)."""
        self.rank, self.world_size = rank, world_size
        join_group(rendezvous, rank, world_size, timeout_s)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def replace_checkpointer(self, state, config, *, store=None, durable=None) -> Any:
        """A new ``Checkpointer(state, config, store=..., durable=...)`` as :attr:`ckpt`; the one
        before it is closed first (:meth:`close_checkpointer`)."""
        from gemini_ckpt import Checkpointer

        self.close_checkpointer()
        self.ckpt = Checkpointer(state, config, store=store, durable=durable)
        return self.ckpt

    def close_checkpointer(self) -> None:
        """Close :attr:`ckpt` (waiting for its in-flight work, raising what failed), if any."""
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()

    def teardown(self, limit_s: float = 10.0) -> bool:
        """Abort :attr:`ckpt` quietly (a job going down) and leave the process group. False when
        the abort did not finish within ``limit_s`` (stuck in a collective with a dead peer): the
        process group is then left as it is and the process is not safe to reuse."""
        import torch.distributed as dist

        clean = True
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            stopper = threading.Thread(target=_abort_quietly, args=(ckpt,), daemon=True)
            stopper.start()
            stopper.join(limit_s)
            clean = not stopper.is_alive()
        if clean and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is still gone
                traceback.print_exc()
        return clean and not dist.is_initialized()


def _abort_quietly(ckpt) -> None:
    try:
        ckpt.abort()
    except BaseException:  # noqa: BLE001 - a crashed job's leftovers
        pass
