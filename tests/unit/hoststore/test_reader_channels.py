"""A host store's channels to restoring readers: shared by the pushes of a read, closed once no
push has used them for a while (a reader goes away with its Checkpointer, and nothing else
would close the store's end), and opened again by the next read."""

from __future__ import annotations

import numpy as np
import pytest

from gemini_ckpt.dataplane import ChannelClosedError, Header, TcpConfig, TcpTransport
from gemini_ckpt.format.shards import ALIGN, ShardPlan, Template, TensorItem, make_record
from gemini_ckpt.hoststore.actors.serving import ShardServer
from gemini_ckpt.hoststore.actors.state import StoreState
from gemini_ckpt.hoststore.actors.versions import VersionTable
from gemini_ckpt.hoststore.readahead import ReadSink

SECRET = b"s" * 32
NS = "readers-test"
SIZES = (4096, 70_000)


def _store_with_a_shard(transport) -> tuple[StoreState, ShardPlan]:
    items, at = [], 0
    for i, n in enumerate(SIZES):
        items.append(TensorItem(f"model.w{i}", (0,), i, "uint8", (n,), at, n, i))
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    plan = ShardPlan(
        plan_id="p1",
        rank=0,
        world_size=1,
        tensors=tuple(items),
        values=(),
        templates=tuple(Template(prefix=b"P" * 8, suffix=b"S" * 40, nbytes=n) for n in SIZES),
        metadata=b"",
        job={},
    )
    table = VersionTable(1 << 24)
    lent = table.lend(0, plan.region_bytes)
    lent.seg.array[:] = np.arange(lent.seg.nbytes, dtype=np.uint64).astype(np.uint8)
    v = table.version(1, 5, world_size=1)
    shard = table.stage(v, 0, lent.seg.id, plan, owner=0)
    shard.record = make_record(plan, lent.seg.array, [], epoch=1, step=5)
    shard.record_bytes = shard.record.encode()
    state = StoreState(NS, "node-a" * 8, table)
    state.transport = transport
    return state, plan


def test_an_idle_reader_channel_is_closed_and_the_next_read_connects_again():
    store_side = TcpTransport(SECRET, NS, host_name="store", config=TcpConfig(progress_timeout_s=5.0))
    reader_side = TcpTransport(SECRET, NS, host_name="reader", config=TcpConfig(progress_timeout_s=5.0))
    sink = ReadSink()
    listener = reader_side.listen("127.0.0.1", sink)
    state, plan = _store_with_a_shard(store_side)
    server = ShardServer(state)
    region = state.table.versions[5].shards[0].seg.array
    try:
        for read in range(2):
            into = [np.zeros(n, np.uint8) for n in SIZES]
            tags = [f"read{read}-item{i}" for i in range(len(SIZES))]
            for tag, buf in zip(tags, into):
                sink.expect(tag, buf)
            ranges = [(t.at, t.nbytes, tag) for t, tag in zip(plan.tensors, tags)]
            assert server.push_ranges(5, 0, ranges, listener.endpoint) == sum(SIZES)
            for t, buf in zip(plan.tensors, into):
                assert np.array_equal(buf, region[t.at : t.at + t.nbytes])
            assert len(server.readers) == 1  # one channel, shared by the read's pushes
            channel = next(iter(server.readers.values()))
            assert server.close_idle_readers(3600.0) == 0  # used a moment ago: kept
            assert server.close_idle_readers(0.0) == 1  # the reader went quiet: closed
            assert server.readers == {}
            with pytest.raises(ChannelClosedError):  # closed on the wire too, not only forgotten
                channel.send(Header(NS, 5, "region/0", 0, 1, total=1), np.zeros(1, np.uint8), timeout=5)
    finally:
        listener.close()
        store_side.close()
        reader_side.close()
