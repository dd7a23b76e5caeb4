"""Small helpers shared by the tests (no fixtures, no Ray)."""

from __future__ import annotations

import uuid

from gemini_ckpt.chaos import damage_copy


def corrupt_item(tier, step: int, *, rank: int = 0, item: int | None = None) -> str:
    """Flip one byte inside a tensor item of rank ``rank``'s shard of ``step`` in a memory tier
    (the biggest item unless ``item`` names one); returns the item's key."""
    plan = tier.open(step).plans[rank]
    t = max(plan.tensors, key=lambda t: t.nbytes) if item is None else plan.tensors[item]
    damage_copy(tier, step, rank, t.at + t.nbytes // 2)
    return t.fqn


def local_tier(keep: int = 2):
    """A fresh process-local memory tier of its own namespace."""
    from gemini_ckpt.stores.memory import LocalStore

    return LocalStore(f"test-{uuid.uuid4().hex}").attach(keep=keep)


def corrupt_durable_item(root, step: int, fqn: str) -> None:
    """Flip one byte inside item ``fqn`` of a durable version under the local directory ``root``."""
    import os

    from gemini_ckpt.durable.tier import DurableTier

    view = DurableTier(str(root)).open(step)
    info = next(info for index, info in view.metadata.storage_data.items() if index.fqn == fqn)
    path = os.path.join(str(root), f"step_{step:09d}", info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def listening(port: int) -> bool:
    """Whether a socket on this machine listens on TCP ``port`` (Linux: /proc/net/tcp{,6}).
    Connections of a closed store (TIME_WAIT) and other processes' outgoing sockets that
    happen to get the port next do not count."""
    import os

    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as fh:
                rows += [line.split() for line in fh.readlines()[1:]]
    return any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows)  # 0A: LISTEN
