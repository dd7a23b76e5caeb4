"""``everyones``, the rank-agreements' collective, over gloo between three processes: every rank's
value in rank order, short ones in one round, a long one in a second (a broadcast from its rank
when it is the only long one)."""

from __future__ import annotations

import time

import pytest

from rendezvous import join_group, master_store

WORLD = 3


def _values(rank: int) -> list:
    return [
        (rank, None, ("memory", "f" * 8), True),  # a verdict: short everywhere
        {"rank": rank, "blob": bytes([rank]) * (10_000 if rank == 1 else 10)},  # long on rank 1 only
        "x" * (5_000 + 1_000 * rank),  # long everywhere, of three lengths
        b"\x00" * 4_000,  # about the inline size
    ]


def _worker(rank: int, world_size: int, port: int, queue) -> None:
    import torch.distributed as dist

    from gemini_ckpt.collective import everyones

    join_group(port, rank, world_size)
    try:
        group = dist.new_group(backend="gloo")
        rounds: list[list[str]] = []
        originals = {name: getattr(dist, name) for name in ("all_gather", "broadcast")}

        def counted(name):
            def call(*args, **kwargs):
                rounds[-1].append(name)
                return originals[name](*args, **kwargs)

            return call

        for name in originals:
            setattr(dist, name, counted(name))
        got = []
        for value in _values(rank):
            rounds.append([])
            got.append(everyones(value, world_size=world_size, group=group))
        for name, original in originals.items():
            setattr(dist, name, original)
        queue.put((rank, got, rounds))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_every_ranks_value_in_rank_order_a_short_one_in_one_round():
    import torch.multiprocessing as mp

    store = master_store(WORLD)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = mp.start_processes(_worker, args=(WORLD, store.port, queue), nprocs=WORLD, join=False, start_method="spawn")
    # read before joining: a rank whose results are still in the queue's pipe does not exit
    results = dict((rank, (got, rounds)) for rank, got, rounds in (queue.get(timeout=120) for _ in range(WORLD)))
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=10):  # True once every rank exited (one at a time)
        assert time.monotonic() < deadline, "the ranks did not exit"
    expected = [[_values(r)[i] for r in range(WORLD)] for i in range(len(_values(0)))]
    for rank, (got, rounds) in results.items():
        assert got == expected, f"rank {rank}"
        assert rounds == [
            ["all_gather"],  # short everywhere: one round
            ["all_gather", "broadcast"],  # one long value: sent once, from its rank
            ["all_gather", "all_gather"],  # long on several ranks: gathered
            ["all_gather"],
        ], f"rank {rank}: the rounds of each value"
