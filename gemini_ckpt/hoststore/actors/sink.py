"""Where peers' bytes land in a host store: :class:`ReplicaSink`, the data plane's view of the
store (copies straight into its segments, through its :class:`~.replication.Replicator`), and
:func:`verify_copies`, the check a copy passes before it is acknowledged or served as a holder's.
"""

from __future__ import annotations

import logging
from typing import Optional


from ...checksum import checksum
from ...dataplane import Header
from ...errors import ShardFormatError
from ...format.shards import check_record
from .state import StoreState

log = logging.getLogger("gemini_ckpt")


def verify_copies(state: StoreState, shards: list) -> Optional[str]:
    """Check a peer's copies against their records before acknowledging them."""
    for s in shards:
        try:
            with state.lock:
                plan = state.table.plan(s.plan_id, s.rank)
            check_record(s.record, plan)
        except (LookupError, ShardFormatError) as exc:
            return f"the copy of rank {s.rank}'s shard cannot be checked: {exc}"
        if s.seg.nbytes < plan.region_bytes:
            return f"the copy of rank {s.rank}'s shard is {s.seg.nbytes} bytes, its plan {plan.region_bytes}"
        array = s.seg.array
        for t, crc in zip(plan.tensors, s.record.crcs):
            if checksum(array[t.at : t.at + t.nbytes]) != crc:
                return f"the copy of rank {s.rank}'s shard arrived damaged ({t.fqn} fails its checksum)"
    return None


class ReplicaSink:
    """The transport's view of a host store: copies land straight in its segments."""

    def __init__(self, replicator) -> None:  # the store's Replicator
        self.replicator = replicator

    def buffer_for(self, header: Header) -> memoryview:
        return self.replicator.incoming_buffer(header)

    def received(self, header: Header) -> None:
        self.replicator.incoming_done(header, ok=True)

    def failed(self, header: Header, error: BaseException) -> None:
        self.replicator.incoming_done(header, ok=False)
        log.info("node %s: a copy of %s failed: %s", self.replicator.s.node_id[:12], header.describe(), error)
