"""The durable tier across ranks: a persist that fails on the rank that writes it (the
coordinator) is reported on every rank at once, not after the timeout (two processes).
"""

from __future__ import annotations

import time

import pytest

from gemini_ckpt.chaos import faulty_filesystem
from helpers import local_tier
from rendezvous import join_group, master_store
from gemini_ckpt import BackgroundError, CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.toy import build_training


def _persisting(rank: int, fs, root: str, *, timeout_s: float) -> Checkpointer:
    """A rank's Checkpointer that persists every version to ``fs`` at ``root``. Each rank keeps
    its own shard in its own memory: enough for a persist that fails or stalls at its start."""
    t = build_training(seed=rank, dataset_size=32)
    return Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer),
        CheckpointConfig(persist_every=1, timeout_s=timeout_s, persist_on_close=False),
        store=local_tier(),
        durable=DurableTier(filesystem=fs, root=root),
    )


def _persist_failure_worker(rank: int, world_size: int, port: int, root: str, queue) -> None:
    import torch.distributed as dist

    join_group(port, rank, world_size)
    try:
        fs, handler = faulty_filesystem()
        handler.failing.set()  # rank 0 (the coordinator) cannot write; the others only wait
        ckpt = _persisting(rank, fs, root, timeout_s=120)
        handle = ckpt.save(0)
        handle.committed.result(timeout=60)
        t0 = time.monotonic()
        try:
            handle.persisted.result(timeout=120)
            queue.put((rank, "persisted", time.monotonic() - t0))
        except BackgroundError as exc:
            queue.put((rank, str(exc), time.monotonic() - t0))
        ckpt.abort()
        dist.barrier()  # rank 0 hosts the rendezvous store: keep it up until every rank has read it
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_a_failed_persist_is_reported_on_every_rank_without_waiting_for_the_timeout(tmp_path):
    import torch.multiprocessing as mp

    store = master_store(2)
    port = store.port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _persist_failure_worker, args=(2, port, str(tmp_path / "d"), queue), nprocs=2, join=True, start_method="spawn"
    )
    outcomes = dict((r, (msg, s)) for r, msg, s in (queue.get(timeout=10) for _ in range(2)))
    assert "injected storage failure" in outcomes[0][0]
    assert "rank 0 could not persist step 0" in outcomes[1][0] and "injected storage failure" in outcomes[1][0]
    assert outcomes[1][1] < 30, f"rank 1 waited {outcomes[1][1]:.1f}s (timeout_s is 120)"


def _rank0_lost_worker(rank: int, world_size: int, port: int, root: str, queue) -> None:
    import os
    import signal

    import torch.distributed as dist

    join_group(port, rank, world_size)
    fs, _ = faulty_filesystem(stall_on="step_")  # rank 0's persist hangs in its first write
    ckpt = _persisting(rank, fs, root, timeout_s=30)
    ckpt.save(0).committed.result(timeout=60)
    if rank == 0:
        time.sleep(1.0)  # inside the persist
        os.kill(os.getpid(), signal.SIGKILL)  # lost during the persist
    time.sleep(2.0)  # rank 1 waits for rank 0's outcome, which never comes
    t0 = time.monotonic()
    ckpt.abort()  # an in-place recovery's abort of the failed attempt
    queue.put((time.monotonic() - t0, ckpt.stats.persisted, ckpt.stats.persist_failed))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_an_abort_does_not_wait_for_the_persist_of_a_lost_rank_0(tmp_path):
    """Issue 61, 5: rank 0 lost while it persists; a survivor's abort used to wait for rank 0's
    outcome until ``timeout_s`` (300 s at the defaults) before it could recover."""
    import torch.multiprocessing as mp

    store = master_store(2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(
        _rank0_lost_worker,
        args=(2, store.port, str(tmp_path / "d"), queue),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    took, persisted, failed = queue.get(timeout=120)
    for p in procs.processes:
        p.join(timeout=30)
    assert (persisted, failed) == (0, 0)  # it was waiting for step 0, which never became durable
    assert took < 5, f"rank 1's abort took {took:.1f}s (timeout_s is 30)"
