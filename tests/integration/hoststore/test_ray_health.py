"""Validated versions with host stores: 4 FSDP2 ranks, one per host, replicas=2. One
rank's shard of a weight turns NaN at step 6 and training goes on to step 9: every rank hears the
version is unhealthy, no host store counts it for retention, it is never persisted, and a
restarted job restores step 5, bit-identical, unless it names step 6."""

from __future__ import annotations

import math
import uuid
import warnings

import pytest
import ray

from ray_helpers import status

HOSTS = 4
BAD_STEP, BAD_RANK = 6, 1


def _train(worker, steps: list[int], bad_step: int, bad_rank: int) -> list[dict]:
    """On every rank (a collective): train and save each step; rank ``bad_rank`` puts a NaN into
    its local shard of the first weight right after the optimizer step of ``bad_step``."""
    import torch

    out = []
    for step in steps:
        worker.train_step(step)
        if step == bad_step and worker.rank == bad_rank:
            with torch.no_grad():
                next(iter(worker.model.parameters())).to_local().view(-1)[3] = math.nan
        handle = worker.ckpt.save(step)
        handle.committed.result(timeout=120)
        health = handle.health.result(timeout=120)
        out.append(
            {
                "step": step,
                "health": health.status,
                "reason": health.reason,
                "digest": worker.digest(),
                "persisted": handle.persisted.result(timeout=120),
            }
        )
    worker.ckpt.wait_persisted()
    return out


def _restore(worker, step=None) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = worker.ckpt.restore(step)
    return {
        "step": result.step,
        "source": result.source,
        "health": result.health.status,
        "skipped": result.skipped_steps,
        "reasons": result.skipped_reasons,
        "digest": worker.digest(),
        "warnings": [str(w.message) for w in caught if "UNHEALTHY" in str(w.message)],
    }


def _on_every_rank(ranks, fn, *args, timeout: float = 600) -> list:
    refs = [w.__ray_call__.remote(fn, *args) for w in ranks.workers]
    return ray.get(refs, timeout=timeout)


@pytest.mark.ray
def test_a_nan_on_one_host_is_never_kept_over_persisted_over_or_restored_instead_of_healthy_versions(
    ray_cluster, ranks, tmp_path
):
    ns = f"health-{uuid.uuid4().hex[:8]}"
    config = dict(persist_every=2, keep_durable=2, keep_in_memory=3, durable_uri=str(tmp_path / ns))
    ranks.restart(ns, **config)
    trained = _on_every_rank(ranks, _train, list(range(10)), BAD_STEP, BAD_RANK)

    for rank, per_step in enumerate(trained):
        assert [s["health"] for s in per_step] == ["healthy"] * 6 + ["unhealthy"] * 4, rank
        # every rank hears why, from the store of the rank whose shard failed
        assert per_step[BAD_STEP]["reason"].startswith(
            f"rank {BAD_RANK}: model.0.weight failed the finite check (1 NaN of 512 values"
        ), per_step[BAD_STEP]
        assert [s["persisted"] is None for s in per_step] == [True, False, True, False, True, False] + [True] * 4
    st = status(ns)
    assert st.committed_steps == [3, 4, 5, 6] and st.unhealthy_steps == [6]  # 3 healthy + where it went bad
    assert all(h.versions == (3, 4, 5, 6) for h in st.hosts if h.slot is not None)
    bad = next(v for v in st.versions if v.step == BAD_STEP)
    assert bad.health_reason.startswith(f"rank {BAD_RANK}: model.0.weight failed the finite check")
    assert [v.health for v in st.versions] == ["healthy"] * 3 + ["unhealthy"]
    assert "UNHEALTHY" in st.format()
    durable = ray.get(ranks.workers[0].__ray_call__.remote(lambda w: w.ckpt.durable.complete_steps()))
    assert durable == [3, 5]

    # The job restarts (new processes' Checkpointers over the same host stores).
    ranks.restart(ns, **config)
    named = _on_every_rank(ranks, _restore, BAD_STEP)  # on purpose, for debugging
    restored = _on_every_rank(ranks, _restore)
    for rank in range(HOSTS):
        assert (named[rank]["step"], named[rank]["health"]) == (BAD_STEP, "unhealthy")
        assert named[rank]["digest"] == trained[rank][BAD_STEP]["digest"]
        assert len(named[rank]["warnings"]) == 1 and "restore(step=6) asked for it" in named[rank]["warnings"][0]
        r = restored[rank]
        assert (r["step"], r["source"], r["health"], r["skipped"]) == (5, "memory", "healthy", (6,)), r
        assert r["reasons"][6].startswith(f"unhealthy: rank {BAD_RANK}: model.0.weight failed the finite check")
        assert r["digest"] == trained[rank][5]["digest"], f"rank {rank} did not restore step 5 bit-identically"
