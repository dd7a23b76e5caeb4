"""Process-group rendezvous for multi-process tests without a port picked and released first.

Picking a free port (bind port 0, close, hand the number on) races with everything else on
the machine: the port can be taken before rank 0 binds it (``EADDRINUSE``, seen in CI-sized
runs). Here the test process binds the rendezvous store itself, on port 0, and keeps it open;
ranks join it as clients (:mod:`gemini_ckpt.testing.ranks`, here for ``mp.spawn`` processes).

    store = master_store(world_size)            # in the test; keep it alive while ranks run
    ... spawn ranks with store.port ...
    join_group(port, rank, world_size)          # in each rank
"""

from __future__ import annotations

from gemini_ckpt.testing import ranks

TIMEOUT_S = 180.0


def master_store(world_size: int) -> ranks.Rendezvous:
    return ranks.Rendezvous(world_size, TIMEOUT_S)


def join_group(port: int, rank: int, world_size: int) -> None:
    ranks.join_group((ranks.LOOPBACK, port), rank, world_size, TIMEOUT_S)
