"""A damaged newest version falls back to the older one, on every rank alike: every
kind of damage, non-canonical step directories and a bad ``latest`` are ignored, and
``ls``/``verify`` report damage with exit status 1, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gemini_ckpt import CheckpointConfig, Checkpointer
from gemini_ckpt.__main__ import main as cli
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.durable.layout import parse_step_dir
from helpers import local_tier
from rendezvous import join_group, master_store
from toy_jobs import copy_versions, params_of
from trust_support import JOBS, MARKER, METADATA, NEWEST, OLDER

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from trust_support import versions as versions


# --- 3. a damaged newest version falls back -------------------------------------------------------
def _truncate(path: Path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {
    "metadata-truncated": lambda r: _truncate(r / NEWEST / METADATA),
    "metadata-missing": lambda r: (r / NEWEST / METADATA).unlink(),
    "marker-broken-json": lambda r: (r / NEWEST / MARKER).write_text('{"format": "gemini_ckpt/2", "st'),
    "marker-empty": lambda r: (r / NEWEST / MARKER).write_bytes(b""),
    "marker-not-an-object": lambda r: (r / NEWEST / MARKER).write_text("[1, 2, 3]"),
    "marker-of-another-step": lambda r: shutil.copy(r / OLDER / MARKER, r / NEWEST / MARKER),
    "data-truncated": lambda r: _truncate(r / NEWEST / "__0_0.distcp"),
    "data-missing": lambda r: (r / NEWEST / "__0_0.distcp").unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_version_falls_back_to_the_older_one(versions, tmp_path, damage):
    root = copy_versions(versions, tmp_path)
    DAMAGE[damage](root)
    JOBS.assert_restored(root, versions, 0, skipped=(1,))
    assert DurableTier(str(root)).verify(1) != []
    assert DurableTier(str(root)).verify(0) == []


@pytest.mark.parametrize("name", ["step_0000000000009", "step_00000000\u0663", "step_000000009.bak", "step_9"])
def test_non_canonical_step_directories_are_ignored(versions, tmp_path, name, capsys):
    root = copy_versions(versions, tmp_path)
    shutil.copytree(root / NEWEST, root / name)
    assert parse_step_dir(name) is None
    assert DurableTier(str(root)).complete_steps() == [0, 1]
    JOBS.assert_restored(root, versions, 1, skipped=())
    assert cli(["ls", str(root)]) == 0
    assert f"ignored: {name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content",
    [b"step_abc\n", b"", b"\xff\xfe", b"step_0000000000001\n", b"step_00000000\xd9\xa3\n", b"../../etc/passwd"],
)
def test_bad_latest_is_ignored_and_rewritten_by_the_next_persist(versions, tmp_path, content, caplog):
    root = copy_versions(versions, tmp_path)
    (root / "latest").write_bytes(content)
    tier = DurableTier(str(root))
    assert tier.latest() is None
    assert "ignored" in caplog.text or content == b""
    JOBS.assert_restored(root, versions, 1, skipped=())
    # The next persist goes through and rewrites it.
    t, extra, state = JOBS.state(9)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local", namespace=JOBS.fresh_namespace(), durable_uri=str(root), persist_every=1, keep_durable=5
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore().step == 1
    ckpt.save(2)
    ckpt.close()
    assert (root / "latest").read_text() == "step_000000002\n" and tier.latest() == 2


def test_ls_and_verify_report_damage_per_version_and_never_crash(versions, tmp_path, capsys):
    root = copy_versions(versions, tmp_path)
    _truncate(root / NEWEST / METADATA)
    (root / "latest").write_text("step_abc")
    assert cli(["ls", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "latest" in out and "Traceback" not in out
    assert cli(["ls", "--json", str(root)]) == 1
    listing = json.loads(capsys.readouterr().out)
    assert [v["problem"] is None for v in listing["versions"]] == [True, False]
    assert cli(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "step 0: ok" in out and "step 1: BAD" in out and "latest: BAD" in out
    assert cli(["verify", str(root), "--step", "7"]) == 1
    assert "step 7: BAD" in capsys.readouterr().out
    (root / NEWEST / MARKER).write_text("{")
    assert cli(["verify", str(root), "--step", "1"]) == 1 and "damaged" in capsys.readouterr().out
    assert cli(["ls", str(tmp_path / "nothing-here")]) == 0


def test_verify_checks_metadata(versions, tmp_path):
    root = copy_versions(versions, tmp_path)
    raw = bytearray((root / NEWEST / METADATA).read_bytes())
    raw[len(raw) // 2] ^= 0x20
    (root / NEWEST / METADATA).write_bytes(bytes(raw))
    assert any(".metadata fails its checksum" in p for p in DurableTier(str(root)).verify(1))


# --- 5. every rank takes the same decision ---------------------------------------------------------
def _two_rank_worker(rank, world_size, port, roots, out):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    join_group(port, rank, world_size)
    try:
        t, extra, state = JOBS.state(9)
        # Every rank reads its own copy of the durable tier: rank 1's newest one is damaged.
        ckpt = Checkpointer(
            state, CheckpointConfig(store="local"), store=local_tier(), durable=DurableTier(roots[rank])
        )
        result = ckpt.restore()
        ckpt.close()
        torch.save(
            {
                "step": result.step,
                "skipped": tuple(result.skipped_steps),
                "extra": dict(extra),
                "params": params_of(t.model),
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_ranks_agree_to_skip_a_version_only_one_rank_finds_damaged(versions, tmp_path):
    """Rank 1 reads a truncated ``.metadata`` for step 1, rank 0 an intact copy: both skip it
    and load step 0 (no hang, no mix of steps)."""
    intact, damaged = copy_versions(versions, tmp_path), copy_versions(versions, tmp_path)
    _truncate(damaged / NEWEST / METADATA)
    store = master_store(2)
    mp.spawn(_two_rank_worker, args=(2, store.port, [str(intact), str(damaged)], str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["step"] == 0 and got["skipped"] == (1,) and got["extra"] == {"tokens": 1}
        assert all(torch.equal(got["params"][k], v) for k, v in versions[1][0].items())
