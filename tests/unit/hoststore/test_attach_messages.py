"""The attach channel's typed messages: each survives its JSON wire form, and a header that is
not one of them (unknown type, a field missing or of the wrong kind) is refused by name, before
the host store's ranks port touches any state."""

from __future__ import annotations

import json

import pytest
import torch

from gemini_ckpt.hoststore.actors.ranks import RankPort
from gemini_ckpt.hoststore.actors.state import StoreState
from gemini_ckpt.hoststore.actors.versions import VersionTable
from gemini_ckpt.hoststore.attach_messages import (
    AskComm,
    AskSegment,
    CommPage,
    Done,
    GiveBack,
    MapShard,
    SegmentLent,
    SendPlan,
    ShardMapped,
    Staged,
    Unmap,
    VersionOutcome,
    request_from_wire,
)
from gemini_ckpt.save.plan import make_plan

REQUESTS = [
    SendPlan(),
    AskSegment("p1"),
    GiveBack(3),
    AskComm(),
    MapShard(7, 2),
    Unmap(4),
    Staged(12, "p1", 3, persist=True, lengths=(5, 0, 9), verdict={"status": "healthy"}),
]
ANSWERS = [
    Done(),
    SegmentLent(3, 4096, (1, 2)),
    CommPage(1, 64),
    ShardMapped(5, 8192),
    VersionOutcome(12, True, "", "loss is NaN", checked=True),
]


@pytest.mark.parametrize("message", REQUESTS + ANSWERS, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form(message):
    wire = json.loads(json.dumps(message.to_wire()))
    assert wire["type"] == message.TYPE
    assert type(message).from_wire(wire) == message
    if message in REQUESTS:
        assert request_from_wire(wire) == message


@pytest.mark.parametrize(
    "header, says",
    [
        ({"type": "format_disk"}, "unknown attach message 'format_disk'"),
        ({}, "unknown attach message None"),
        ({"type": "segment"}, "'segment' has no 'plan_id'"),
        ({"type": "segment", "plan_id": 7}, "'plan_id' is not str"),
        ({"type": "map", "step": True, "rank": 0}, "'step' is not int (bool)"),
        ({"type": "map", "step": "1", "rank": 0}, "'step' is not int (str)"),
        ({"type": "give_back", "seg": 1.5}, "'seg' is not int (float)"),
        ({"type": "staged", "step": 1, "plan_id": "p", "seg": 1, "lengths": [1, "2"]}, "'lengths' is not tuple"),
        ({"type": "staged", "step": 1, "plan_id": "p", "seg": 1, "persist": 1}, "'persist' is not bool"),
        ({"type": "staged", "step": 1, "plan_id": "p", "seg": 1, "verdict": "healthy"}, "'verdict' is not Optional"),
    ],
)
def test_a_header_that_is_no_message_is_refused_by_name(header, says):
    with pytest.raises(ValueError) as raised:
        request_from_wire(header)
    assert says in str(raised.value)


def test_the_ranks_port_answers_typed_messages_and_refuses_malformed_ones_untouched():
    state = StoreState("ns", "node-a", VersionTable(1 << 20, node="node-a"))
    port = RankPort(state, driver=None, replicator=None)
    conn = object()  # the port keys what a connection holds by it; nothing is sent on it here
    model = {"w": torch.arange(64, dtype=torch.float32)}
    plan, _ = make_plan({"model": model}, rank=0, world_size=1, group=None, job={"test": True})
    assert port.on_attach(conn, 0, SendPlan().to_wire(), plan.shard.encode(), []) == ({"type": "done"}, b"", ())
    reply, payload, fds = port.on_attach(conn, 0, AskSegment(plan.shard.plan_id).to_wire(), b"", [])
    lent = SegmentLent.from_wire(reply)
    assert lent.nbytes >= plan.shard.region_bytes and len(fds) == 1 and payload == b""
    again = SegmentLent.from_wire(port.on_attach(conn, 0, AskSegment(plan.shard.plan_id).to_wire(), b"", [])[0])
    assert again.seg != lent.seg  # the first is still lent
    assert port.on_attach(conn, 0, GiveBack(lent.seg).to_wire(), b"", []) is None
    with pytest.raises(LookupError, match="no comm state"):
        port.on_attach(conn, 0, AskComm().to_wire(), b"", [])
    with pytest.raises(ValueError, match="'seg' is not int"):
        port.on_attach(conn, 0, {"type": "give_back", "seg": str(again.seg)}, b"", [])
    with pytest.raises(ValueError, match="unknown attach message"):
        port.on_attach(conn, 0, {"type": "staged_v2"}, b"", [])
    assert port.sent_fds[conn] == {lent.seg, again.seg}
    asked = [
        SegmentLent.from_wire(port.on_attach(conn, 0, AskSegment(plan.shard.plan_id).to_wire(), b"", [])[0]).seg
        for _ in range(2)
    ]
    assert again.seg not in asked  # the malformed give-back gave nothing back


def test_a_version_is_staged_once_and_never_again_once_decided():
    """A second writer of a rank's shard (a zombie of the same epoch, or one whose message
    arrives late) replaces nothing: not a shard already staged, not any shard of a version that
    committed (a committed version replaced under its readers was refused by a fresh restore)."""
    from gemini_ckpt.commit import VersionState

    table = VersionTable(1 << 20, node="node-a")
    model = {"w": torch.arange(64, dtype=torch.float32)}
    plan, _ = make_plan({"model": model}, rank=0, world_size=2, group=None, job={"test": True})
    v = table.version(1, 4, world_size=2)
    first = table.stage(v, 0, table.lend(0, plan.shard.region_bytes).seg.id, plan.shard, owner=0)
    with pytest.raises(ValueError, match="already holds rank 0's shard"):
        table.stage(v, 0, table.lend(0, plan.shard.region_bytes).seg.id, plan.shard, owner=0)
    assert v.shards[0] is first
    v.state = VersionState.COMMITTED
    with pytest.raises(ValueError, match="committed"):
        table.stage(v, 1, table.lend(1, plan.shard.region_bytes).seg.id, plan.shard, owner=0)
    assert 1 not in v.shards


def test_a_peers_plan_never_drops_a_local_ranks_plan_of_the_same_number():
    """An elastic run renumbers its ranks: this node's new rank 1 sends its plan, and a copy of the
    lost old rank 1's shard (re-replicated) brings that rank's plan: the local rank's plan stays
    (before: the peer's plan pruned it, and the rank's next save failed: "no plan ... of rank 1")."""
    table = VersionTable(1 << 20, node="node-a")
    model = {"w": torch.arange(64, dtype=torch.float32)}
    local, _ = make_plan({"model": model}, rank=1, world_size=3, group=None, job={"test": True})
    peer, _ = make_plan({"model": model}, rank=1, world_size=4, group=None, job={"test": True})
    table.add_plan(local.shard, local.shard.encode())
    table.add_plan(peer.shard, peer.shard.encode(), prune=False)
    assert table.plan(local.shard.plan_id, 1) is not None and table.plan(peer.shard.plan_id, 1) is not None
    table.new_epoch(())  # a new epoch lets go of the plans no held version uses
    with pytest.raises(LookupError):
        table.plan(peer.shard.plan_id, 1)
