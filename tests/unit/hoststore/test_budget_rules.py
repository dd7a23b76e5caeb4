"""The host stores of every namespace on one node budget at most 60% of its RAM together
(gemini_ckpt.hoststore.actors.budget): a default budget shrinks to what the others leave (never
below 1 GiB, with a warning naming them); an explicit one past the share is refused."""

from __future__ import annotations

import pytest

from gemini_ckpt import MemoryBudgetError
from gemini_ckpt.hoststore.actors.budget import DEFAULT_FLOOR_BYTES, choose

GB = 10**9
RAM = 100 * GB


def test_a_default_budget_is_30_percent_when_the_node_has_room():
    assert choose(None, {}, RAM, namespace="a") == (30 * GB, None)
    assert choose(None, {"a": 30 * GB}, RAM, namespace="b") == (30 * GB, None)  # two default stores fit


def test_a_default_budget_shrinks_to_what_the_other_namespaces_leave_and_says_so():
    budget, note = choose(None, {"a": 30 * GB, "b": 20 * GB}, RAM, namespace="c")
    assert budget == 10 * GB and "'a' 30.00 GB, 'b' 20.00 GB" in note and "shutdown_host_stores" in note
    budget, note = choose(None, {"a": 30 * GB, "b": 30 * GB, "c": 10 * GB}, RAM, namespace="d")
    assert budget == DEFAULT_FLOOR_BYTES and note  # four defaults: 30 + 30 + 1 GiB + 1 GiB, not 120%


def test_an_explicit_budget_past_what_the_others_leave_is_refused_naming_them():
    assert choose(25 * GB, {"a": 35 * GB}, RAM, namespace="b") == (25 * GB, None)  # exactly 60%
    with pytest.raises(
        MemoryBudgetError, match=r"host_memory_budget_bytes=26,000,000,000 .*'a' 35.00 GB.*leave 25.00 GB"
    ):
        choose(26 * GB, {"a": 35 * GB}, RAM, namespace="b")
    # two default stores fill the share; a small explicit budget still fits (up to 1 GiB, as a default's)
    full = {"a": 30 * GB, "b": 30 * GB}
    assert choose(DEFAULT_FLOOR_BYTES, full, RAM, namespace="c") == (DEFAULT_FLOOR_BYTES, None)
    with pytest.raises(MemoryBudgetError, match="leave 1.07 GB"):
        choose(DEFAULT_FLOOR_BYTES + 1, full, RAM, namespace="c")
