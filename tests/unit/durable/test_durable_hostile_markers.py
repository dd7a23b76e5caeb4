"""A torn completion marker never counts: a persist failing at the marker leaves no
complete version, retention never counts a torn marker, and one of ours is removed when the
next job opens the tier.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from gemini_ckpt.chaos import faulty_filesystem
from gemini_ckpt import CheckpointConfig, Checkpointer
from gemini_ckpt.toy import lm_loss
from gemini_ckpt.durable.tier import DurableTier
from durable_hostile_support import IN_PROGRESS, JOBS, MARKER


# === 8. a torn marker never counts =================================================================
def test_a_persist_failing_at_the_marker_leaves_no_complete_version_and_retention_keeps_the_good_ones(tmp_path):
    fs, handler = faulty_filesystem(torn_on=MARKER)
    root = str(tmp_path / "d")
    durable = DurableTier(filesystem=fs, root=root, keep=2)
    t, extra, state = JOBS.state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local",
            namespace=JOBS.fresh_namespace(),
            persist_every=3,
            keep_durable=2,
            persist_on_close=False,
            timeout_s=30,
        ),
        durable=durable,
    )
    batches = t.batches()
    for step in range(9):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        (handler.tearing.set if step == 5 else handler.tearing.clear)()
        handle = ckpt.save(step)
        if step in (2, 5, 8):
            handle.persisted.exception(timeout=60)
    handler.tearing.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.close()
    assert ckpt.stats.persist_failed == 1
    assert durable.complete_steps() == [2, 8]
    assert sorted(os.listdir(root)) == ["latest", "step_000000002", "step_000000008"]
    assert durable.verify(2) == [] and durable.verify(8) == []


def _three_versions(tmp_path) -> Path:
    root = tmp_path / "three"
    t, extra, state = JOBS.state(0)
    ckpt = JOBS.checkpointer(state, root, persist_every=3, keep_durable=5, persist_on_close=False)
    for step in range(9):
        ckpt.save(step)
    ckpt.close()
    return root


@pytest.mark.parametrize("ours", [True, False], ids=["in-progress", "no-in-progress"])
def test_a_torn_marker_is_never_counted_by_retention(tmp_path, ours):
    root = _three_versions(tmp_path)
    vdir = root / "step_000000005"
    raw = (vdir / MARKER).read_bytes()
    (vdir / MARKER).write_bytes(raw[: len(raw) // 2])
    if ours:
        (vdir / IN_PROGRESS).write_text('{"step": 5}')
    tier = DurableTier(str(root), keep=2)
    assert tier.apply_retention() == []  # 5 does not count: 2 and 8 are the two kept
    assert (root / "step_000000002").is_dir() and tier.verify(2) == []
    assert tier.abandon(5) is ours
    if not ours:
        assert tier.cleanup_incomplete() == []
        assert vdir.is_dir()  # not provably ours: reported, never deleted
    else:
        assert not vdir.exists()


def test_a_torn_marker_of_ours_is_removed_when_the_next_job_opens_the_tier(tmp_path):
    root = _three_versions(tmp_path)
    vdir = root / "step_000000008"
    raw = (vdir / MARKER).read_bytes()
    (vdir / MARKER).write_bytes(raw[:100])
    (vdir / IN_PROGRESS).write_text('{"step": 8}')
    (root / "latest").write_text("step_000000005\n")
    tier = DurableTier(str(root), keep=2)
    assert tier.cleanup_incomplete() == [8]
    assert tier.complete_steps() == [2, 5]
