"""Shards in memory without torch or Ray: segments shared through a memfd, a pool within its
budget, a host store's version table (lent segments, users, pins), checked plan encoding."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from gemini_ckpt.hoststore.actors.versions import VersionTable
from gemini_ckpt.format.framing import Template
from gemini_ckpt.errors import ShardFormatError
from gemini_ckpt.format.shards import ALIGN, ShardPlan, ShardRecord, TensorItem, ValueItem, make_record
from gemini_ckpt.format.segments import Segment, SegmentPool


def _plan(sizes=(100, 3000), rank=0, plan_id="p1") -> ShardPlan:
    items, at = [], 0
    templates = tuple(Template(prefix=b"P" * 8, suffix=b"S" * 40, nbytes=n) for n in sizes)
    for i, n in enumerate(sizes):
        items.append(TensorItem(f"model.w{i}", (0,), i, "uint8", (n,), at, n, i))
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return ShardPlan(
        plan_id=plan_id,
        rank=rank,
        world_size=2,
        tensors=tuple(items),
        values=(ValueItem("rank_local.0.extra", None, "bytes"),),
        templates=templates,
        metadata=b"skeleton" if rank == 0 else b"",
        job={"world_size": 2},
    )


def test_a_shared_segment_is_the_same_memory_through_its_fd_and_outlives_the_first_mapping():
    seg = Segment(1 << 20, shared=True)
    seg.array[:4] = [1, 2, 3, 4]
    other = Segment(seg.nbytes, fd=os.dup(seg.fd), seg_id=seg.id)  # what a training process maps
    assert list(other.array[:4]) == [1, 2, 3, 4]
    other.array[5] = 9
    assert seg.array[5] == 9
    seg.close()  # the store lets go: the trainer's mapping still holds the pages
    assert list(other.array[:6]) == [1, 2, 3, 4, 0, 9]
    other.close()


def test_the_pool_reuses_released_segments_and_refuses_past_its_budget():
    pool = SegmentPool(10 << 20, shared=False)
    a = pool.reserve(4 << 20)
    pool.release(a)
    b = pool.reserve(4 << 20)
    assert b is a and pool.created == 1  # reused, no new allocation
    pool.reserve(5 << 20)
    with pytest.raises(MemoryError, match="budget of 10,485,760 bytes"):
        pool.reserve(2 << 20)
    assert pool.held == 9 << 20


def test_lent_segments_are_reused_only_when_their_version_is_released_and_nobody_uses_them():
    table = VersionTable(1 << 30)
    plan = _plan()
    lent = table.lend(0, plan.region_bytes)
    lent.seg.array[:] = 7
    record = make_record(plan, lent.seg.array, [b"extra"], epoch=1, step=5)
    v = table.version(1, 5, world_size=2)
    shard = table.stage(v, 0, lent.seg.id, plan, owner=0)
    shard.record, shard.record_bytes = record, record.encode()  # computed after staging, as the store does
    assert table.lend(0, plan.region_bytes).seg is not lent.seg  # held by step 5: another one
    table.use(shard)  # e.g. being sent to a holder
    table.release(v)
    assert lent.state == "held"  # still in use: not free yet
    table.done_with(shard)
    assert lent.state == "free" and table.lend(0, plan.region_bytes).seg is lent.seg
    # A pinned version (being persisted) waits for unpin.
    v2 = table.version(1, 6, world_size=2)
    v2.persist = True
    table.release(v2)
    assert 6 in table.versions
    table.unpin(6)
    assert 6 not in table.versions


def test_segments_lent_to_the_ranks_of_an_earlier_epoch_are_let_go_and_never_block_a_copy():
    """After a restart, the node's ranks may have other numbers (Ray Train places them anew): the
    free and staging segments of the previous processes would otherwise hold budget for good."""
    plan = _plan()
    n = plan.region_bytes
    table = VersionTable(4 * n)
    v = table.version(1, 5, world_size=2)
    held = table.lend(0, n)
    table.stage(v, 0, held.seg.id, plan, owner=0)  # rank 0's shard of step 5, kept
    table.lend(0, n)  # in flight when the process died: staging
    free = table.lend(0, n)
    table.give_back(free.seg.id)
    assert table.pool.held == 3 * n
    table.new_epoch(ranks_here=(1,))  # rank 0 now runs elsewhere; rank 1 here
    assert table.pool.held == n and [x.state for x in table.lent.values()] == ["held"]
    table.release(v)  # the kept shard goes with its version, not back to rank 0's free list
    assert table.pool.held == 0 and not table.lent
    # Free staging memory never makes a peer's copy fail: it is let go when room is needed.
    segs = [table.lend(1, n) for _ in range(3)]
    for lent in segs:
        table.give_back(lent.seg.id)
    assert table.pool.held == 3 * n
    table.receive(table.version(2, 6, world_size=2), 0, owner=0, nbytes=2 * n)
    assert table.pool.held == 2 * n


def test_a_version_of_a_newer_epoch_replaces_an_older_one_of_the_same_step_and_never_the_reverse():
    table = VersionTable(1 << 30)
    old = table.version(1, 5)
    new = table.version(2, 5)
    assert new is not old and table.versions[5] is new
    assert table.version(1, 5) is None  # a zombie of epoch 1 cannot bring its version back


def test_plans_and_records_refuse_what_does_not_fit_them():
    plan = _plan()
    assert ShardPlan.decode(plan.encode()) == plan
    overlapping = replace(plan, tensors=(plan.tensors[0], replace(plan.tensors[1], at=64)))
    with pytest.raises(ShardFormatError, match="overlaps"):
        ShardPlan.decode(overlapping.encode())
    wrong_size = replace(plan, tensors=(replace(plan.tensors[0], nbytes=99), plan.tensors[1]))
    with pytest.raises(ShardFormatError, match="template"):
        ShardPlan.decode(wrong_size.encode())
    record = make_record(plan, bytearray(plan.region_bytes), [b"x"], epoch=3, step=9)
    encoded = bytearray(record.encode())
    encoded[-1] ^= 1  # a blob byte
    with pytest.raises(ShardFormatError, match="blob"):
        ShardRecord.decode(bytes(encoded))
    with pytest.raises(ValueError, match="blobs for"):
        make_record(plan, bytearray(plan.region_bytes), [], epoch=3, step=9)


def test_a_rank_whose_plan_changes_lets_go_of_its_free_segments_and_memory_says_where_the_budget_is():
    plan = _plan()
    n = plan.region_bytes
    table = VersionTable(16 * n)
    v = table.version(1, 5, world_size=2)
    table.stage(v, 0, table.lend(0, n).seg.id, plan, owner=0)  # rank 0's own shard, kept
    table.receive(v, 1, owner=1, nbytes=2 * n)  # a peer's copy
    free = table.lend(0, n)
    table.give_back(free.seg.id)
    staging = table.lend(0, n)  # reuses the free one
    assert staging is free
    table.give_back(staging.seg.id)
    table.lend(1, n)  # another rank's, being filled
    mem = table.memory()
    assert (mem["own"], mem["replicas"], mem["staging"], mem["lent_free"], mem["pooled"], mem["other"]) == (
        n,
        2 * n,
        n,
        n,
        0,
        0,
    )
    assert mem["reserved"] == table.pool.held == 5 * n and mem["budget"] == 16 * n
    # rank 0 saves a state of another size: its free segment goes, not into a growing pile
    table.lend(0, 3 * n)
    mem = table.memory()
    assert mem["lent_free"] == 0 and mem["staging"] == n + 3 * n and mem["reserved"] == 7 * n
    table.release(v)  # the replica goes back to the pool, the own shard to rank 0's free list
    mem = table.memory()
    assert (mem["own"], mem["replicas"], mem["pooled"], mem["lent_free"]) == (0, 0, 2 * n, n)


def test_the_pool_keeps_a_few_free_segments_not_everything_a_burst_let_go():
    pool = SegmentPool(1 << 30, shared=False, max_free=2)
    segs = [pool.reserve(1 << 20) for _ in range(6)]  # e.g. the copies of a re-replication
    for seg in segs:
        pool.release(seg)
    assert pool.held == 0 and pool.pooled == 2 << 20  # the budget is not held by idle buffers
    assert pool.reserve(1 << 20) in segs[4:] and pool.created == 6  # the newest free ones are reused
