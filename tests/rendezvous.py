"""Process-group rendezvous for multi-process tests without a port picked and released first.

Picking a free port (bind port 0, close, hand the number on) races with everything else on
the machine: the port can be taken before rank 0 binds it (``EADDRINUSE``, seen in CI-sized
runs). Here the test process binds the rendezvous store itself, on port 0, and keeps it open;
ranks join it as clients.

    store = master_store(world_size)            # in the test; keep it alive while ranks run
    ... spawn ranks with store.port ...
    join_group(port, rank, world_size)          # in each rank
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=180)


def master_store(world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def join_group(port: int, rank: int, world_size: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
