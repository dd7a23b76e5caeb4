"""After a host is lost, the survivors bring every in-memory version back to ``replicas``
copies, and a replacement host's store is given the lost host's copies as soon as it joins,
so the restarted job restores locally (``Recovery.rereplicate``, ``HostStore.send_copy``).

Rank ``i`` runs on host ``i`` (slot ``i``); group placement with 4 hosts and ``replicas=2``
pairs slots {0, 1} and {2, 3}.
"""

from __future__ import annotations

import time
import uuid

import pytest

from gemini_ckpt.hoststore.slots import holders_for
from ray_helpers import node_id_of_host, status, wait_for

pytestmark = pytest.mark.ray

HOSTS = 4


def _copies(namespace: str) -> dict[int, dict[int, tuple[int, ...]]]:
    """step -> rank -> slots holding a complete copy (committed versions only)."""
    return {
        v.step: {s.rank: tuple(sorted(s.copies)) for s in v.shards}
        for v in status(namespace).versions
        if v.state == "committed"
    }


def _placed(dead: set) -> dict[int, tuple[int, ...]]:
    return {
        r: tuple(sorted(holders_for(r, hosts=HOSTS, replicas=2, strategy="group", dead=dead))) for r in range(HOSTS)
    }


@pytest.mark.slow
@pytest.mark.ci  # ~33 s on a busy machine: CI runs it after the default suite
def test_a_lost_hosts_copies_are_made_again_and_a_replacement_is_seeded_before_the_restart(ray_cluster, ranks):
    ns = f"rerep-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns, ballast_mb=8)
    trained = ranks.train(range(3))
    assert all(r["committed"] for per_rank in trained for r in per_rank)
    kept = sorted(_copies(ns))
    assert kept == [1, 2] and all(_copies(ns)[s] == _placed(set()) for s in kept)

    t0 = time.monotonic()
    ray_cluster.remove_hosts((1,), wait=False)
    # Slot 1's shards (and the copies of slot 0's it held) go to slot 2, the next live slot: the
    # newest version's at once, the older one's OLDER_AFTER_S (10 s) after the loss.
    wait_for(lambda: _copies(ns).get(2) == _placed({1}), timeout=60, what="step 2 back to 2 copies")
    rereplicated_s = time.monotonic() - t0
    wait_for(lambda: _copies(ns).get(1) == _placed({1}), timeout=60, what="step 1 back to 2 copies")
    made = [e["message"] for e in status(ns).events if e["message"].startswith("re-replicated")]
    assert " copies of step 2 " in made[0] and "; 2 of older steps follow 10s after the loss or join" in made[0], made
    assert any(" copies of step 1 " in m for m in made[1:]), made

    ray_cluster.add_host(1)
    new_node = node_id_of_host(1)
    # The replacement takes slot 1 before any rank of the job runs there, and holds its copies
    # of the newest version (what its restore reads).
    wait_for(
        lambda: (
            status(ns).host(1).node_id == new_node
            and 1 in _copies(ns).get(2, {}).get(1, ())
            and 1 in _copies(ns).get(2, {}).get(0, ())
        ),
        timeout=60,
        what="the replacement host to hold the lost host's copies of step 2",
    )
    assert any("took over slot 1" in m for m in (e["message"] for e in status(ns).events))

    ranks.restart(ns, ballast_mb=8)
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [2] * HOSTS
    assert [r["digest"] for r in restored] == [trained[r][2]["digest"] for r in range(HOSTS)]
    # Its whole shard is local; from peers only the few bytes of replicated tensors (AdamW's
    # step counters) that DCP's deduplication saved in the other group's shards.
    assert restored[1]["read_local"] > 8 << 20 and restored[1]["read_peer"] < 1024, restored[1]
    print(f"the newest version re-replicated after losing 1 of 4 hosts: {rereplicated_s:.2f}s")

    # Training goes on: retention lets the versions from before the loss go (those made again
    # and seeded included), so no store keeps more than it did before the failure.
    more = ranks.train(range(3, 7))
    assert all(r["committed"] for per_rank in more for r in per_rank)
    wait_for(
        lambda: sorted(_copies(ns)) == [5, 6],
        timeout=30,
        what=f"only the newest 2 versions kept (held: {sorted(_copies(ns))})",
    )
    held = {h: status(ns).host(h).held_bytes for h in range(HOSTS)}
    assert all(v <= (2 + 1) * 2 * (9 << 20) for v in held.values()), held


def test_a_replacement_that_joins_at_once_leaves_no_copies_behind_as_training_goes_on(ray_cluster, ranks):
    """As a cloud replaces a host: the new node joins before the loss is even noticed."""
    ns = f"rerep-fast-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns, ballast_mb=8)
    trained = ranks.train(range(3))
    assert all(r["committed"] for per_rank in trained for r in per_rank)
    ray_cluster.remove_hosts((1,), wait=False)
    ray_cluster.add_host(1)
    new_node = node_id_of_host(1)
    wait_for(lambda: status(ns).host(1).node_id == new_node, timeout=60, what="the replacement to take slot 1")
    ranks.restart(ns, ballast_mb=8)
    restored = ranks.call("restore")
    assert [r["step"] for r in restored] == [2] * HOSTS
    more = ranks.train(range(3, 9))
    assert all(r["committed"] for per_rank in more for r in per_rank)
    wait_for(
        lambda: sorted(_copies(ns)) == [7, 8],
        timeout=30,
        what=f"only the newest 2 versions kept (held: {sorted(_copies(ns))})",
    )
    time.sleep(2)  # anything late (a copy made again after its version was let go) has landed
    held = {h: status(ns).host(h).held_bytes for h in range(HOSTS)}
    assert all(v <= (2 + 1) * 2 * (9 << 20) for v in held.values()), held
