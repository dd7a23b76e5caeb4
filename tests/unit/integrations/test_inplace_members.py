"""In-place recovery's rounds carry a membership: who may form a round, at which rank. A replaced
worker's zombie is refused; a round that renumbers the ranks (an elastic shrink) gives each
survivor its new place; what the round store holds is checked before it is believed."""

from __future__ import annotations

import os

import pytest

from gemini_ckpt.integrations import _members, _rounds
from rounds_support import world


def test_a_replaced_incarnation_is_refused_and_cannot_take_its_replacements_rank():
    """Rank 1's process (incarnation b) was replaced by c while it was stopped: when it runs
    again it reaches the newest round, whose members are a and c, and is refused, whether it
    arrives there first or after the round formed; c forms the round with a at rank 1."""
    from concurrent.futures import ThreadPoolExecutor

    store = _rounds.server("127.0.0.1", timeout_s=10)
    port = store.port
    first = _rounds.open_round(store, world(a=0, b=1))
    _rounds.revoke(store, "b")  # the controller found b failed: it revokes it, asks for a round
    _rounds.raise_latest(store, first + 1)
    replacement = _rounds.open_round(store, world(a=0, c=1))

    def arrive(round_: int, token: str):
        client = _rounds.client("127.0.0.1", port, timeout_s=10, secret=store.secret)
        return _rounds.arrive(client, round_, token=token, patience_s=10)

    with pytest.raises(_members.SupersededError, match="incarnation b was replaced"):
        arrive(first + 1, "b")  # the zombie, before its replacement arrived
    with ThreadPoolExecutor(2) as pool:
        survivor, newcomer = pool.submit(arrive, first + 1, "a"), pool.submit(arrive, replacement, "c")
        assert survivor.result()[0] == newcomer.result()[0] == replacement
    assert newcomer.result()[1].of("c").rank == 1
    with pytest.raises(_members.SupersededError):
        arrive(first, "b")  # and after it formed
    assert store.raw.check([f"{_rounds.PREFIX}r{replacement}/in/c"]) and not store.raw.check(
        [f"{_rounds.PREFIX}r{replacement}/in/b"]
    )


def test_a_round_of_the_same_processes_forms_without_the_controller():
    """A transient fault (a connection reset, no process lost): every rank asks for the next
    round itself; it has no members of its own, so it takes the newest round's the controller
    wrote and forms with the same incarnations at the same ranks. One the controller opens
    meanwhile (a replacement) wins: its own members are read as they appear."""
    from concurrent.futures import ThreadPoolExecutor

    store = _rounds.server("127.0.0.1", timeout_s=10)
    port = store.port
    first = _rounds.open_round(store, world(a=0, b=1))

    def arrive(round_: int, token: str):
        client = _rounds.client("127.0.0.1", port, timeout_s=10, secret=store.secret)
        return _rounds.arrive(client, round_, token=token, patience_s=10)

    with ThreadPoolExecutor(2) as pool:
        done = [f.result() for f in [pool.submit(arrive, first + 1, "a"), pool.submit(arrive, first + 1, "b")]]
    # (two ranks asking at once may ask for one round more: they meet in the newest)
    assert done[0] == done[1] and done[0][0] > first and done[0][1] == world(a=0, b=1)
    first = done[0][0] - 1
    # the controller opens a round while a waits in one asked for by itself: a meets c there
    _rounds.raise_latest(store, first + 2)
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(arrive, first + 2, "a")
        _rounds.revoke(store, "b")
        newcomer = pool.submit(arrive, _rounds.open_round(store, world(a=0, c=1)), "c")
        assert waiting.result()[0] == newcomer.result()[0] == first + 3


def test_a_round_that_renumbers_the_ranks_gives_each_survivor_its_new_place():
    """An elastic shrink: rank 1 of three is lost with its host; the controller opens a round of
    two whose members are the survivors, a at rank 0 and c (rank 2 before) at rank 1."""
    from concurrent.futures import ThreadPoolExecutor

    store = _rounds.server("127.0.0.1", timeout_s=10)
    port = store.port
    first = _rounds.open_round(store, world(a=0, b=1, c=2))
    shrunk = _rounds.open_round(store, world(a=0, c=1))

    def arrive(token: str):
        client = _rounds.client("127.0.0.1", port, timeout_s=10, secret=store.secret)
        return _rounds.arrive(client, first, token=token, patience_s=10)

    with ThreadPoolExecutor(2) as pool:
        a, c = (f.result() for f in [pool.submit(arrive, "a"), pool.submit(arrive, "c")])
    assert a[0] == c[0] == shrunk and c[1].world_size == 2 and c[1].of("c") == _members.Member(1, 0, 1, 1)
    told = _members.Told("127.0.0.1", port, first, 2, 3, "gloo", 10.0, 10.0, "c")
    env = dict(os.environ)
    try:
        moved = told.placed(c[1].of("c"), c[1].world_size)
        assert (moved.rank, moved.world_size, os.environ["RANK"], os.environ["WORLD_SIZE"]) == (1, 2, "1", "2")
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_a_membership_from_the_store_is_checked():
    assert _members.Membership.from_text(world(a=0, b=1).to_text()) == world(a=0, b=1)
    for text in (
        '{"world_size": 2, "members": {"a": [0, 0, 1, 0]}}',  # rank 1 missing
        '{"world_size": 1, "members": {"a": [0, 0, 1, -1]}}',
        '{"world_size": true, "members": {}}',
        '{"world_size": 1, "members": {"a": "x"}}',
        "[]",
        "x" * (_members.MAX_TEXT + 1),
    ):
        with pytest.raises(ValueError):
            _members.Membership.from_text(text)
