"""Failure domains on a real (local) Ray cluster: with ``failure_domain="rack"`` the registry reads
the hosts' ``rack`` labels (the session cluster puts hosts 0, 1 in rack "0" and 2, 3 in rack "1"),
every shard's copy lands in the other rack, and losing a whole rack at once still restores from
memory. Without domains, group placement pairs slots {0, 1} and {2, 3}: the same loss would take
both copies of two shards.
"""

from __future__ import annotations

import uuid

import pytest

from gemini_ckpt.hoststore.slots import holders_for
from ray_helpers import status

# ~34 s on a busy machine: CI runs it after the default suite
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.ci]

HOSTS = 4
RACKS = ("0", "0", "1", "1")


def _copies(namespace: str) -> dict[int, dict[int, tuple[int, ...]]]:
    """step -> rank -> slots holding a complete copy (committed versions only)."""
    return {
        v.step: {s.rank: tuple(sorted(s.copies)) for s in v.shards}
        for v in status(namespace).versions
        if v.state == "committed"
    }


def test_copies_land_in_the_other_rack_and_losing_a_rack_restores_from_memory(ray_cluster, ranks):
    ns = f"domains-{uuid.uuid4().hex[:8]}"
    config = {"failure_domain": "rack", "placement": "group"}
    ranks.restart(ns, **config)
    trained = ranks.train(range(3))
    assert all(r["committed"] for per_rank in trained for r in per_rank)
    copies = _copies(ns)
    assert sorted(copies) == [1, 2]
    spread = {
        r: tuple(sorted(holders_for(r, hosts=HOSTS, replicas=2, strategy="group", domains=RACKS))) for r in range(HOSTS)
    }
    assert spread == {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    for step in copies:  # rank i runs on host i (slot i): one copy in each rack
        assert copies[step] == spread, (step, copies[step])
    seen = status(ns)
    assert [h.domain for h in sorted(seen.hosts, key=lambda h: h.slot)] == list(RACKS)
    header = seen.format().splitlines()[1].split()
    assert header[:2] == ["slot", "domain"]

    ray_cluster.remove_hosts((2, 3))  # rack "1", both hosts at once
    ray_cluster.add_host(2)
    ray_cluster.add_host(3)  # replacements, in rack "1" again
    ranks.restart(ns, **config)
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [2] * HOSTS
    assert [r["source"] for r in restored] == ["memory"] * HOSTS
    assert [r["digest"] for r in restored] == [trained[r][2]["digest"] for r in range(HOSTS)]
