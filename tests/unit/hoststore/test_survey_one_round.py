"""A restore's survey asks each host store once: a store sends, read with its index, the plans and
records of its shards of the newest step it holds committed, and the surveying rank asks a store
again only for a step it did not send (another newest there: a version in flight, an older
epoch)."""

from __future__ import annotations

import threading

from gemini_ckpt.commit import VersionState
from gemini_ckpt.format.shards import ALIGN, ShardPlan, Template, TensorItem, make_record
from gemini_ckpt.hoststore.actors.serving import ShardServer
from gemini_ckpt.hoststore.actors.state import StoreState
from gemini_ckpt.hoststore.actors.versions import VersionTable
from gemini_ckpt.hoststore.reads import TierReads
from gemini_ckpt.hoststore.resolve import resolve

SIZE = 4096


def _plan(rank: int, world_size: int) -> ShardPlan:
    return ShardPlan(
        plan_id="p1",
        rank=rank,
        world_size=world_size,
        tensors=(TensorItem("model.w", (rank * SIZE,), rank, "uint8", (SIZE,), 0, SIZE, 0),),
        values=(),
        templates=(Template(prefix=b"P" * 8, suffix=b"S" * 40, nbytes=SIZE),),
    )


def _stage(table: VersionTable, step: int, rank: int, state: str) -> None:
    plan = _plan(rank, 2)
    table.add_plan(plan, plan.encode())
    lent = table.lend(rank, (SIZE + ALIGN - 1) // ALIGN * ALIGN)
    lent.seg.array[:] = step
    v = table.version(1, step, world_size=2)
    v.state = VersionState.PENDING  # its shards are all staged before it is decided
    shard = table.stage(v, rank, lent.seg.id, plan, owner=0)
    shard.record = make_record(plan, lent.seg.array, [], epoch=1, step=step)
    shard.record_bytes = shard.record.encode()
    v.state = state


def test_a_store_sends_its_newest_committed_steps_plans_and_records_with_its_index():
    table = VersionTable(1 << 24)
    server = ShardServer(StoreState("survey-test", "node-a" * 8, table))
    assert server.survey() == {"index": {}, "newest": None, "infos": {}}
    for rank in (0, 1):
        _stage(table, 5, rank, VersionState.COMMITTED)
        _stage(table, 6, rank, VersionState.PENDING)  # in flight: not what a restore opens
    got = server.survey()
    assert got["index"] == server.index()
    assert got["newest"] == 5
    assert got["infos"] == server.shard_info(5, [0, 1])
    assert set(got["infos"]) == {0, 1} and all(plan and record for plan, record in got["infos"].values())


class _Hosts:
    """Two live stores whose calls are counted (a store asked again answers from its table)."""

    def __init__(self, servers: dict) -> None:
        self.servers, self.asked = servers, []

    def live(self) -> dict:
        return {slot: _Handle(self, slot) for slot in self.servers}


class _Handle:
    def __init__(self, hosts: _Hosts, slot: int) -> None:
        self.shard_info = _Remote(
            lambda step, ranks: (hosts.asked.append((slot, step)), hosts.servers[slot].shard_info(step, ranks))[1]
        )


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn


def test_the_surveying_rank_asks_a_store_again_only_for_a_step_it_did_not_send(monkeypatch):
    import gemini_ckpt.hoststore.reads as reads

    monkeypatch.setattr(reads.ray, "get", lambda value, timeout=None: value)  # the fake calls answer at once
    tables = {0: VersionTable(1 << 24), 1: VersionTable(1 << 24)}
    for slot, table in tables.items():
        for rank in (0, 1):
            _stage(table, 5, rank, VersionState.COMMITTED)
    _stage(tables[1], 6, 0, VersionState.COMMITTED)  # slot 1's newest committed is another step
    _stage(tables[1], 6, 1, VersionState.COMMITTED)
    servers = {slot: ShardServer(StoreState("survey-test", f"node-{slot}" * 8, t)) for slot, t in tables.items()}
    replies = {slot: server.survey() for slot, server in servers.items()}
    where = resolve({slot: r["index"] for slot, r in replies.items()}, local_slot=0)
    fetched = {slot: (r["newest"], r["infos"]) for slot, r in replies.items()}
    hosts = _Hosts(servers)
    reader = TierReads.__new__(TierReads)
    reader._hosts, reader.settings, reader.rank = hosts, type("S", (), {"timeout_s": 5})(), 0

    got = reader._shard_infos(5, where[5], fetched)
    assert got == {slot: servers[slot].shard_info(5, [0, 1]) for slot in (0, 1)}
    assert hosts.asked == [(1, 5)]  # slot 0 sent step 5 with its index; slot 1 sent step 6
    hosts.asked.clear()
    assert reader._shard_infos(6, where[6], fetched) == {1: servers[1].shard_info(6, [0, 1])}
    assert hosts.asked == []


def test_stores_of_an_earlier_release_are_surveyed_in_two_rounds():
    """A store left running by a release before ``survey`` (the same attach protocol) has no such
    method: the survey asks every store for its index instead, and for plans and records later."""
    table = VersionTable(1 << 24)
    for rank in (0, 1):
        _stage(table, 5, rank, VersionState.COMMITTED)
    server = ShardServer(StoreState("survey-test", "node-0" * 8, table))

    class OldStores:
        def __init__(self) -> None:
            self.asked: list[str] = []

        def gather(self, method):
            self.asked.append(method)
            if method == "survey":
                raise AttributeError("'ActorHandle' object has no attribute 'survey'")
            return {0: getattr(server, method)()}

    stores = OldStores()
    reader = TierReads.__new__(TierReads)
    reader._hosts, reader.rank, reader.slot = stores, 0, 0
    reader._lock, reader._prefetched = threading.Lock(), {}
    assert reader.committed_steps(prefetch=True) == [5]
    assert stores.asked == ["survey", "index"] and reader._prefetched == {}
