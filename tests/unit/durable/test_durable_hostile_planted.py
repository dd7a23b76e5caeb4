"""A hostile writer plants symlinks and FIFOs in the durable directory: a persist
never writes outside the directory, no FIFO hangs a restore, a persist or close, and the
property: anything planted anywhere the durable tier opens neither writes outside, nor hangs,
nor bloats memory, and the newest good version is restored.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch

from gemini_ckpt import faults
from gemini_ckpt.durable.tier import DurableTier
from durable_hostile_support import (
    BOMB,
    DATA,
    DEADLINE_S,
    MARKER,
    METADATA,
    NEWEST,
    SLACK,
    MiB,
    PeakMemory,
    JOBS,
    continue_job,
    version_bytes,
)
from toy_jobs import copy_versions, within

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from durable_hostile_support import fifos as fifos
from durable_hostile_support import outside as outside
from durable_hostile_support import versions as versions


# === 1. a persist never writes outside the directory ==============================================
def test_a_planted_latest_tmp_symlink_is_never_written_through(versions, tmp_path, outside):
    root = copy_versions(versions, tmp_path)
    (root / "latest.tmp").symlink_to(outside)
    result, ckpt = within(DEADLINE_S, continue_job, root, [2])
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "step_000000002\n"
    assert DurableTier(str(root)).complete_steps() == [0, 1, 2]


@pytest.mark.parametrize("name", [".metadata.tmp", ".gemini_complete.tmp"])
def test_links_planted_in_a_version_being_written_are_never_written_through(versions, tmp_path, outside, name):
    """Planted while the version's data files are written (between begin and commit)."""
    root = copy_versions(versions, tmp_path)

    def plant(phase, **ctx):
        if phase == "persist_commit" and ctx["step"] == 2:
            (root / "step_000000002" / name).symlink_to(outside)

    faults.set_hook(plant)
    try:
        result, ckpt = within(DEADLINE_S, continue_job, root, [2])
    finally:
        faults.set_hook(None)
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    tier = DurableTier(str(root))
    assert tier.complete_steps() == [0, 1, 2] and tier.latest() == 2 and tier.verify(2) == []
    assert not (root / "step_000000002" / name).exists()


def test_a_data_file_is_created_exclusively_never_through_a_planted_link(versions, tmp_path, outside):
    root = copy_versions(versions, tmp_path)
    tier = DurableTier(str(root))
    tier.begin(2)
    (root / "step_000000002" / DATA).symlink_to(outside)  # planted after begin, before the write
    with tier.open_output(2, DATA) as out:
        out.write(b"ours")
    assert not (root / "step_000000002" / DATA).is_symlink()
    assert (root / "step_000000002" / DATA).read_bytes() == b"ours"
    assert tier.abandon(2) and not (root / "step_000000002").exists()


def test_a_planted_step_directory_symlink_is_never_followed(versions, tmp_path, outside):
    root = copy_versions(versions, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / NEWEST, elsewhere)
    shutil.rmtree(root / NEWEST)
    (root / NEWEST).symlink_to(elsewhere)  # a complete version, but not inside the directory
    tier = DurableTier(str(root))
    assert tier.complete_steps() == [0]
    JOBS.assert_restored(root, versions, 0)
    result, ckpt = within(DEADLINE_S, continue_job, root, [1])
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([DATA, METADATA, MARKER])
    assert not (root / NEWEST).is_symlink() and tier.verify(1) == []


# === 2. no FIFO hangs anything =====================================================================
@pytest.mark.parametrize("name", [DATA, METADATA, MARKER])
@pytest.mark.parametrize("how", ["fifo", "link-to-fifo"])
def test_a_fifo_in_a_version_is_refused_not_waited_for(versions, tmp_path, fifos, name, how):
    root = copy_versions(versions, tmp_path)
    path = root / NEWEST / name
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "fifo")
        fifos.append(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    fifos.append(path)
    JOBS.assert_restored(root, versions, 0)
    problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert problems and any("regular file" in p or "link" in p for p in problems), problems


@pytest.mark.parametrize("how", ["fifo", "link-to-fifo"])
def test_a_fifo_as_latest_neither_blocks_the_persist_nor_close(versions, tmp_path, fifos, how):
    root = copy_versions(versions, tmp_path)
    (root / "latest").unlink()
    if how == "fifo":
        os.mkfifo(root / "latest")
    else:
        os.mkfifo(tmp_path / "fifo")
        fifos.append(tmp_path / "fifo")
        (root / "latest").symlink_to(tmp_path / "fifo")
    fifos.append(root / "latest")
    assert within(DEADLINE_S, DurableTier(str(root)).latest) is None
    result, ckpt = within(DEADLINE_S, continue_job, root, [2])
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    assert (root / "latest").is_file() and not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step_000000002\n"


# === the property: anything planted anywhere the durable tier opens ===============================
KINDS = ("link-out", "fifo", "link-to-fifo", "sparse", "dir")
AT_REST = {  # path under the root -> the step restore must end at
    f"{NEWEST}/{DATA}": 0,
    f"{NEWEST}/{METADATA}": 0,
    f"{NEWEST}/{MARKER}": 0,
    "latest": 1,
    "latest.tmp": 1,
}
IN_FLIGHT = (".metadata.tmp", ".gemini_complete.tmp", DATA)  # in step 2's directory, before its commit


def _plant(path: Path, kind: str, outside: Path, fifos: list) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if kind == "link-out":
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
        fifos.append(path)
    elif kind == "link-to-fifo":
        fifo = outside.parent.parent / f"fifo-{uuid.uuid4().hex[:8]}"
        os.mkfifo(fifo)
        fifos.append(fifo)
        path.symlink_to(fifo)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(BOMB)
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"x")


def test_property_nothing_planted_anywhere_writes_outside_hangs_or_bloats(versions, tmp_path, outside, fifos):
    """Every path the durable tier opens (a version's data file, ``.metadata`` and marker,
    ``latest``, and the temp names of ``latest``, ``.metadata`` and the marker, plus a data file
    replaced before its commit) x every kind of plant: a new job restores the newest good
    version, persists the next, and nothing is written outside the directory, nothing hangs,
    memory stays within twice the version's size; then another job restores that."""
    cases = [(p, k, step) for p, step in AT_REST.items() for k in KINDS]
    cases += [(f"<in flight>/{n}", k, 1) for n in IN_FLIGHT for k in KINDS]
    bound = 2 * version_bytes(versions[0]) + SLACK
    t0 = time.perf_counter()
    for where, kind, expected in cases:
        case = f"{kind} at {where}"
        root = copy_versions(versions, tmp_path)
        hook = None
        if where.startswith("<in flight>/"):
            name = where.split("/", 1)[1]

            def hook(phase, name=name, root=root, kind=kind, **ctx):
                if phase == "persist_commit" and ctx["step"] == 2:
                    _plant(root / "step_000000002" / name, kind, outside, fifos)
        else:
            _plant(root / where, kind, outside, fifos)
        with PeakMemory() as mem:
            for step in DurableTier(str(root)).complete_steps():
                problems = within(DEADLINE_S, DurableTier(str(root)).verify, step)
                assert isinstance(problems, list), case
            faults.set_hook(hook)
            try:
                result, ckpt = within(DEADLINE_S, continue_job, root, [2])
            finally:
                faults.set_hook(None)
        assert result is not None and result.step == expected, (case, result)
        assert mem.rise < bound, f"{case}: memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
        assert outside.read_bytes() == b"not yours\n", f"{case}: written outside the durable directory"
        # the older good version is what the next job gets (or the step persisted on top of it)
        final, extra, params = within(DEADLINE_S, JOBS.restore, root)
        assert final is not None and final.step in (expected, 2), (case, final)
        assert all(torch.equal(params[k], v) for k, v in versions[1][expected].items()), case
        if final.step == 2:
            assert DurableTier(str(root)).verify(2) == [], case
        shutil.rmtree(root)
    print(f"\nproperty: {len(cases)} plants in {time.perf_counter() - t0:.1f}s")
