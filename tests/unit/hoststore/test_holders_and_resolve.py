"""Which stores hold a shard's copies (the holders rule: placement kept, a dead slot replaced by
its ring successor) and when a step counts as committed (every shard on a live store, the newest
committed epoch, never copies of two epochs mixed): the pure functions host stores and restore use."""

from __future__ import annotations

import pytest

from gemini_ckpt import ConfigError
from gemini_ckpt.hoststore.resolve import resolve
from gemini_ckpt.hoststore.slots import holders_for


def test_holders_rule_keeps_placement_and_replaces_dead_slots_by_ring_successors():
    group = [holders_for(s, hosts=4, replicas=2, strategy="group") for s in range(4)]
    assert group == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert holders_for(2, hosts=4, replicas=2, strategy="group", dead={3}) == (2, 0)
    assert holders_for(3, hosts=4, replicas=2, strategy="group", dead={3}) == (2, 0)
    assert holders_for(0, hosts=4, replicas=2, strategy="group", dead={3}) == (0, 1)  # untouched
    assert holders_for(0, hosts=5, replicas=3, strategy="ring", dead={1}) == (0, 2, 3)
    assert holders_for(4, hosts=5, replicas=3, strategy="ring", dead={0, 1}) == (4, 2, 3)
    with pytest.raises(ConfigError, match="replicas=2"):
        holders_for(0, hosts=4, replicas=2, dead={1, 2, 3})
    with pytest.raises(ConfigError, match="needs 3 hosts"):
        holders_for(0, hosts=2, replicas=3)


def _entry(epoch, state, shards, world=2):
    """One store's ``index()`` entry: shards given as rank -> owner slot (all complete)."""
    return {
        "epoch": epoch,
        "state": state,
        "world_size": world,
        "shards": {r: {"owner": o, "complete": True, "plan_id": "p", "nbytes": 10} for r, o in shards.items()},
    }


def test_a_step_counts_only_when_committed_somewhere_with_every_shard_on_a_live_store():
    whole = {0: {7: _entry(1, "committed", {0: 0, 1: 1})}, 1: {7: _entry(1, "prepared", {1: 1, 0: 0})}}
    v = resolve(whole, local_slot=1)[7]
    assert v.committed and v.copies == {0: (1, 0), 1: (1, 0)}  # this node first, then the owner
    assert resolve(whole, local_slot=0)[7].copies == {0: (0, 1), 1: (0, 1)}
    lost = {0: {7: _entry(1, "committed", {0: 0})}}  # slot 1 is gone with the only copy of rank 1's shard
    assert not resolve(lost)[7].committed and resolve(lost)[7].lost
    nobody = {0: {7: _entry(1, "prepared", {0: 0, 1: 1})}}  # voted, never decided: not trusted
    assert not resolve(nobody)[7].committed
    # A step saved again in a newer epoch: the newest committed epoch wins, and copies of
    # another epoch are never mixed in.
    again = {0: {7: _entry(1, "committed", {0: 0, 1: 1})}, 1: {7: _entry(2, "committed", {0: 0, 1: 1})}}
    assert resolve(again)[7].epoch == 2 and resolve(again)[7].copies == {0: (1,), 1: (1,)}
    aborted = {0: {7: _entry(2, "committed", {0: 0})}, 1: {7: _entry(2, "aborted", {1: 1})}}
    assert not resolve(aborted)[7].committed


def test_the_survey_carries_a_shards_plan_and_record_once_unless_the_copies_differ():
    from gemini_ckpt.hoststore.reads import _once_each

    good, forged = (b"plan-1", b"record-1"), (b"plan-1", b"forged")
    infos = {0: {0: good, 1: (b"plan-2", b"record-2")}, 1: {0: good, 1: (b"plan-2", b"record-2")}, 2: {0: forged}}
    assert _once_each(infos) == {0: {0: good, 1: (b"plan-2", b"record-2")}, 2: {0: forged}}
