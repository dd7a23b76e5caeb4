"""The verdict on a version: it is signed with the rest (a forged one in a record or
a durable marker is refused with a signing key; ``ls`` and ``verify`` show it), and a missing
verdict is never a healthy one.
"""

from __future__ import annotations

import json
import math
import struct

import crc32c
import pytest
import torch
from torch import nn

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState, UnhealthyVersionError
from gemini_ckpt.__main__ import main as cli
from gemini_ckpt.checksum import checksum
from gemini_ckpt.toy import build_training
from gemini_ckpt.restore import UnhealthyRestoreWarning
from gemini_ckpt.format.manifest import ItemChecksum, VersionManifest
from gemini_ckpt.errors import ShardFormatError
from gemini_ckpt.signing import canonical
from gemini_ckpt.format.shards import RECORD_MAGIC, ShardRecord
from gemini_ckpt.trust.manifest import canonical_bytes
from health_support import job_config, toy_lm, save_committed, train_step


# --- the verdict is signed with the rest ----------------------------------------------------------------
def _reframe_record(encoded: bytes, change) -> bytes:
    """A forger's record: ``change`` applied to its JSON, every CRC recomputed, the signature kept."""
    start = len(RECORD_MAGIC) + 8
    (n,) = struct.unpack("<Q", encoded[len(RECORD_MAGIC) : start])
    head = json.loads(encoded[start : start + n])
    change(head["record"])
    head["crc"] = crc32c.crc32c(canonical(head["record"]))
    text = canonical(head)
    return RECORD_MAGIC + struct.pack("<Q", len(text)) + text + encoded[start + n :]


def test_a_records_forged_verdict_is_refused_with_a_signing_key():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[1, 1] = math.nan
    ckpt = Checkpointer(TrainState(model=model), job_config(signing_key="job-secret"))
    save_committed(ckpt, 0)
    record = ckpt.store.open(0).records[0]
    assert record.health.unhealthy
    encoded = record.encode(b"job-secret")
    assert ShardRecord.decode(encoded, b"job-secret").health == record.health

    def heal(body):
        body["health"] = {"status": "healthy", "check": "", "item": "", "detail": "", "rank": None}

    forged = _reframe_record(encoded, heal)
    assert ShardRecord.decode(forged).health.status == "healthy"  # without a key only the CRC is checked
    with pytest.raises(ShardFormatError, match="signature that does not match this signing key"):
        ShardRecord.decode(forged, b"job-secret")
    ckpt.close()


def _reseal_marker(vdir, change) -> None:
    """A forger's marker: ``change`` applied, the manifest CRC recomputed, the signature kept."""
    marker_path = vdir / ".gemini_complete"
    marker = json.loads(marker_path.read_text())
    change(marker)
    m = VersionManifest(
        step=marker["step"],
        world_size=marker["world_size"],
        metadata=(vdir / ".metadata").read_bytes(),
        checksums=tuple(ItemChecksum(*c) for c in marker["checksums"]),
        file_sizes=marker["file_sizes"],
        job=marker["job"],
        metadata_crc=marker["metadata_crc"],
        health=marker.get("health"),
    )
    marker["manifest_crc"] = checksum(canonical_bytes(m))
    marker_path.write_text(json.dumps(marker))


def test_the_durable_verdict_is_signed_shown_by_ls_and_verify_and_a_forged_one_is_refused(
    tmp_path, capsys, monkeypatch
):
    uri = str(tmp_path / "d")
    config = job_config(durable_uri=uri, persist_every=1, keep_durable=3, signing_key="job-secret")
    t, ckpt = toy_lm(config)
    batches = t.batches()
    for step in range(2):
        train_step(t, batches)
        save_committed(ckpt, step)
    ckpt.close()
    marker = json.loads((tmp_path / "d" / "step_000000001" / ".gemini_complete").read_text())
    assert marker["health"] == {"status": "healthy", "check": "", "item": "", "detail": "", "rank": None}

    monkeypatch.setenv("GEMINI_CKPT_SIGNING_KEY", "job-secret")
    assert cli(["ls", "--json", uri]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [(r["step"], r["health"]["status"]) for r in rows] == [(0, "healthy"), (1, "healthy")]
    assert cli(["verify", uri, "--step", "1"]) == 0
    assert capsys.readouterr().out.startswith("step 1: ok, healthy (")

    # A writer of the storage directory marks step 1 unhealthy (it could as well mark a bad one healthy).
    def condemn(m):
        m["health"] = {
            "status": "unhealthy",
            "check": "finite",
            "item": "model.head.weight",
            "detail": "forged",
            "rank": 0,
        }

    _reseal_marker(tmp_path / "d" / "step_000000001", condemn)
    assert cli(["verify", uri, "--step", "1"]) == 1
    assert "signature that does not match this signing key" in capsys.readouterr().out
    t2 = build_training(seed=4, dataset_size=32)
    fresh = Checkpointer(
        TrainState(model=t2.model, optimizer=t2.optimizer, scheduler=t2.scheduler),
        job_config(durable_uri=uri, signing_key="job-secret"),
    )
    with pytest.warns(UserWarning, match=r"step 1 \(durable\) could not be restored.*does not match this signing key"):
        result = fresh.restore()
    assert (result.step, result.skipped_steps) == (0, (1,))
    fresh.close()

    monkeypatch.delenv("GEMINI_CKPT_SIGNING_KEY")  # without the key, the forged verdict is what ls shows
    assert cli(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "UNHEALTHY" in out and "unhealthy: rank 0: model.head.weight failed the finite check (forged)" in out


# --- a missing verdict is never a healthy one -----------------------------------
def test_a_store_that_gives_no_verdict_never_makes_a_version_healthy_for_the_trainer_or_for_restore(tmp_path):
    """A store of another gemini_ckpt version (the one the audit ran) takes the shard but neither
    checks it nor passes the trainer's verdict on: its records carry no verdict, its outcome
    says nothing. On main 17f5790 a NaN step saved through it was ``healthy`` on the trainer and
    the restore choice. Now the trainer counts each such version unhealthy (check ``verdict``),
    and restore, which reads the signed plan asking for the finite check beside a record without
    a verdict, never picks one (``restore(step=...)`` still loads it, with a warning). A store
    that does check (the same tier, verdicts kept) makes the same versions healthy and NaN-free."""
    import dataclasses

    from dir_tier import DirTier

    class UncheckingStore(DirTier):
        def record(self, step, plan, segment, blobs, verdict):  # checks nothing, passes no verdict on
            return super().record(step, dataclasses.replace(plan, checked=()), segment, blobs, None)

    def run(store_cls, root):
        model = nn.Linear(8, 4)
        ckpt = Checkpointer(
            TrainState(model=model), CheckpointConfig(store="local"), store=store_cls(str(root), rank=0, world_size=1)
        )
        verdicts = [save_committed(ckpt, 0).health.result()]
        with torch.no_grad():
            model.weight.view(-1)[5] = math.nan
        verdicts.append(save_committed(ckpt, 1).health.result())
        ckpt.close()
        fresh = nn.Linear(8, 4)
        again = Checkpointer(
            TrainState(model=fresh), CheckpointConfig(store="local"), store=store_cls(str(root), rank=0, world_size=1)
        )
        return verdicts, again, fresh

    verdicts, again, fresh = run(DirTier, tmp_path / "checking")
    assert [v.status for v in verdicts] == ["healthy", "unhealthy"] and verdicts[1].check == "finite"
    assert again.restore().step == 0 and torch.isfinite(fresh.weight).all()
    again.close()

    verdicts, again, fresh = run(UncheckingStore, tmp_path / "unchecking")
    assert [(v.status, v.check) for v in verdicts] == [("unhealthy", "verdict")] * 2
    assert "did not say that every shard carries a verdict" in verdicts[1].reason
    with pytest.raises(
        UnhealthyVersionError,
        match="its record carries no verdict, though its plan asks for the finite check of 2 items",
    ):
        again.restore()
    assert torch.isfinite(fresh.weight).all()
    with pytest.warns(UnhealthyRestoreWarning):
        assert again.restore(step=1).step == 1  # on purpose, by name
    assert not torch.isfinite(fresh.weight).all()
    again.close()
