"""Crafted files never run code: a crafted ``.metadata`` pickle, non-tensor or tensor
item never runs and restore falls back; shard plans and records are checked JSON, not pickles;
the allow-lists take what our own state needs.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.errors import ShardFormatError, VerificationError
from gemini_ckpt.format.shards import ShardPlan, ShardRecord
from gemini_ckpt.trust.metadata import metadata_loads
from gemini_ckpt.trust.values import value_loads
from forge import forge_item, reseal
from helpers import local_tier
from trust_support import (
    EXTRA_KEY,
    METADATA,
    NEWEST,
    JOBS,
    Evil,
    evil_pickle,
    torch_saved,
)
from toy_jobs import copy_versions

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from trust_support import versions as versions


# --- 1. code execution on restore ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["system", "eval"])
@pytest.mark.parametrize("resealed", [False, True], ids=["crc-stale", "crc-recomputed"])
def test_crafted_metadata_pickle_never_runs_and_restore_falls_back(versions, tmp_path, how, resealed):
    root, pwned = copy_versions(versions, tmp_path), tmp_path / "pwned"
    (root / NEWEST / METADATA).write_bytes(evil_pickle(pwned, how))
    if resealed:
        reseal(root / NEWEST)
    JOBS.assert_restored(root, versions, 0, skipped=(1,))
    problems = DurableTier(str(root)).verify(1)
    assert problems and ("allow-listed" in problems[0] if resealed else "replaced" in problems[0]), problems
    assert not pwned.exists()


@pytest.mark.parametrize("layer", ["outer", "inner"])
def test_crafted_non_tensor_item_with_recomputed_crc_never_runs(versions, tmp_path, layer):
    """The ``extra`` item: DCP's own planner would torch.load it with weights_only=False."""
    root, pwned = copy_versions(versions, tmp_path), tmp_path / "pwned"
    payload = torch_saved(Evil(pwned)) if layer == "outer" else torch_saved(evil_pickle(pwned))
    forge_item(root / NEWEST, EXTRA_KEY, payload)
    assert DurableTier(str(root)).verify(1) != []
    JOBS.assert_restored(root, versions, 0, skipped=(1,))
    assert not pwned.exists()


def test_crafted_tensor_item_never_runs(versions, tmp_path):
    root, pwned = copy_versions(versions, tmp_path), tmp_path / "pwned"
    forge_item(root / NEWEST, "model.pos", torch_saved(Evil(pwned)))
    JOBS.assert_restored(root, versions, 0, skipped=(1,))
    assert not pwned.exists()


def _memory_version(step=3):
    """A real version in a process-local memory tier, and its plan and record."""
    _, _, state = JOBS.state(0)
    tier = local_tier()
    ckpt = Checkpointer(state, CheckpointConfig(store="local"), store=tier)
    ckpt.save(step).committed.result(timeout=60)
    ckpt.close()
    view = tier.open(step)
    return view.plans[0], view.records[0]


def test_shard_plans_and_records_are_json_and_checked_not_pickled(tmp_path):
    pwned = tmp_path / "pwned"
    plan, record = _memory_version()
    for obj, cls, magic in ((plan, ShardPlan, b"GEMINI-PLAN\x00"), (record, ShardRecord, b"GEMINI-SHARD\x00")):
        encoded = obj.encode()
        assert cls.decode(encoded) == obj
        assert encoded.startswith(magic) and b'"crc":' in encoded  # JSON, not a pickle
        # A pickle in their place is refused without being unpickled.
        with pytest.raises(ShardFormatError, match="not an encoded"):
            cls.decode(evil_pickle(pwned))
        with pytest.raises(ShardFormatError, match="signing key"):
            cls.decode(encoded, b"a key")  # unsigned, and a key is set
        assert cls.decode(obj.encode(b"a key"), b"a key") == obj
        with pytest.raises(ShardFormatError, match="does not match this signing key"):
            cls.decode(obj.encode(b"a key"), b"another key")
    # A plan whose metadata skeleton is a crafted pickle, every CRC recomputed, decodes (it is
    # consistent), but the metadata allow-list refuses it.
    forged = ShardPlan.decode(replace(plan, metadata=evil_pickle(pwned)).encode())
    with pytest.raises(VerificationError, match="not allow-listed"):
        metadata_loads(forged.metadata)
    assert not pwned.exists()


def test_allow_lists_take_what_our_state_needs(versions):
    """Every opaque value TrainState writes (RNG streams, loader, scheduler, extra) passes the
    value allow-list, and real DCP metadata passes the metadata one."""
    _, _, state = JOBS.state(0)
    import numpy as np

    state.extra.update({"np": np.arange(3), "f": np.float32(1.5), "t": torch.ones(2), "s": {1, 2}})
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state.opaque_state(0))
    assert set(flat) >= {"scheduler", "rank_local.0.rng", "rank_local.0.extra", "rank_local.0.dataloader"}
    for key, blob in flat.items():
        assert _same(value_loads(blob), pickle.loads(blob)), key
    rng = value_loads(flat["rank_local.0.rng"])
    assert rng["python"] == random.getstate() and rng["torch"] == torch.get_rng_state().numpy().tobytes()
    md = metadata_loads((versions[0] / NEWEST / METADATA).read_bytes())
    assert "model.pos" in md.state_dict_metadata


def _same(a, b) -> bool:
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
