"""A restore that gives up on a slow peer leaves nothing writing into the live state.
4 hosts, replicas=2: host 1's own copy of its biggest item (the ballast) is damaged,
so rank 1 asks host 0 for it, and host 0 sends at 1 MiB/s (``replication_bandwidth``, the
store's cap, which restore pushes share): the reader's wait (``timeout_s``) ends long before the
push would, the version is skipped on every rank and the one before it restored. The test then
sets the ballast to 7.0 and watches it for as long as the abandoned push would have gone on:
nothing may change it. With the default interleaving (the gate) and with ``"network"``."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from ray_helpers import corrupt_shard_copy

HOSTS = 4
BALLAST_MB = 10  # per rank: 10 s of push at the cap
CAP = 1 << 20  # bytes/s: the smallest replication_bandwidth
TIMEOUT_S = 6.0  # the reader gives up after this (CheckpointConfig.timeout_s; lower risks a loaded CI)


def _restore_then_watch(worker, watch_s: float) -> dict:
    """Restore (a collective), then set the ballast to 7.0 at once and watch it for ``watch_s``:
    how much of it changed back, and when."""
    import torch

    t0 = time.monotonic()
    result = worker.ckpt.restore()
    returned = time.monotonic()
    ballast = worker.model.ballast.to_local()
    with torch.no_grad():
        ballast.fill_(7.0)
    changed, first_change = 0.0, None
    while time.monotonic() - returned < watch_s:
        time.sleep(0.25)
        changed = (ballast != 7.0).float().mean().item()
        if changed and first_change is None:
            first_change = time.monotonic() - returned
    return {
        "step": result.step,
        "source": result.source,
        "path": result.path,
        "changed": changed,
        "first_change_s": first_change,
        "restore_s": returned - t0,
        "skipped": result.skipped_reasons,
    }


@pytest.mark.ray
@pytest.mark.parametrize(
    "interleave",
    # the real network's interleaving (~19 s) runs with CI's slow and ci set: the default suite's budget
    [True, pytest.param("network", marks=[pytest.mark.slow, pytest.mark.ci])],
    ids=["gate", "network"],
)
def test_nothing_writes_into_the_live_state_after_restore_gave_up_on_a_slow_peer(ray_cluster, ranks, interleave):
    ns = f"abandon-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns, ballast_mb=BALLAST_MB, interleave=interleave)
    trained = ranks.train(range(3))
    assert all(r["committed"] for per_rank in trained for r in per_rank), trained
    assert corrupt_shard_copy(ns, host=1, step=2, rank=1) == "model.ballast"
    ranks.restart(ns, ballast_mb=BALLAST_MB, interleave=interleave, replication_bandwidth=CAP, timeout_s=TIMEOUT_S)
    # As long as the whole push at the cap would take, from the moment the reader gave up.
    watch_s = BALLAST_MB * 2**20 / CAP - TIMEOUT_S + 2.0
    out = ray.get([w.__ray_call__.remote(_restore_then_watch, watch_s) for w in ranks.workers], timeout=300)
    # Step 2 could not be read in time on rank 1 (its other copy is too slow): step 1, from memory, directly.
    assert [(r["step"], r["source"], r["path"]) for r in out] == [(1, "memory", "direct")] * HOSTS, out
    for rank, r in enumerate(out):
        assert r["changed"] == 0.0, (
            f"rank {rank}: {r['changed']:.0%} of the ballast was overwritten "
            f"{r['first_change_s']:.1f}s after restore() returned"
        )
    assert "model.ballast" in out[1]["skipped"][2] and "LookupError" in out[1]["skipped"][2], out[1]["skipped"]
