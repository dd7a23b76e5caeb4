"""Signing: signed versions restore and unsigned or forged ones are refused, the key is
validated and never printed, a signature binds the namespace (a version copied from another run
is refused; a key needs an explicit namespace), and a damaged memory item is never taken from
another version of the step on disk.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from gemini_ckpt.chaos import damage_copy
from gemini_ckpt import ChecksumError, CheckpointConfig, Checkpointer, ConfigError
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.toy import lm_loss
from gemini_ckpt.signing import ENV_KEY
from forge import reseal
from toy_jobs import params_of
from trust_support import JOBS, MARKER, NAMESPACE, NEWEST, OLDER


# --- 2. signing ----------------------------------------------------------------------------------
def _save_steps(root, steps, *, key=None, config_key=None, monkeypatch=None):
    if monkeypatch is not None:
        if key is None:
            monkeypatch.delenv(ENV_KEY, raising=False)
        else:
            monkeypatch.setenv(ENV_KEY, key)
    t, extra, state = JOBS.state(0)
    cfg = CheckpointConfig(
        store="local",
        namespace=JOBS.fresh_namespace(),
        persist_every=1,
        durable_uri=str(root),
        keep_durable=5,
        signing_key=config_key,
        overwrite=True,
    )
    ckpt = Checkpointer(state, cfg)
    batches = t.batches()
    for step in steps:
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        extra["tokens"] = step + 1
        ckpt.save(step)
    ckpt.close()
    if monkeypatch is not None:
        monkeypatch.delenv(ENV_KEY, raising=False)


def test_signed_versions_restore_and_unsigned_or_forged_ones_are_refused(tmp_path, monkeypatch):
    root = tmp_path / "d"
    _save_steps(root, [0, 1], key="job-secret", monkeypatch=monkeypatch)
    marker = json.loads((root / NEWEST / MARKER).read_text())
    assert len(marker["signature"]) == 64
    _save_steps(root, [2], key=None, monkeypatch=monkeypatch)  # unsigned newest
    assert "signature" not in json.loads((root / "step_000000002" / MARKER).read_text())

    # A forger rewrites step 1's job description with every CRC recomputed, but cannot sign.
    reseal(root / NEWEST, lambda m: m["job"].update(world_size=1, note="forged"))

    with pytest.warns(UserWarning) as caught:
        result, extra, _ = _restore_warned(root, signing_key=b"job-secret")
    assert result.step == 0 and tuple(result.skipped_steps) == (2, 1) and extra == {"tokens": 1}
    text = " ".join(str(w.message) for w in caught)
    assert "is not signed" in text and "does not match this signing key" in text

    # The key can come from the environment too; a wrong key refuses everything.
    monkeypatch.setenv(ENV_KEY, "another-secret")
    with pytest.warns(UserWarning), pytest.raises(ChecksumError, match="signing key"):
        _restore_warned(root)
    monkeypatch.delenv(ENV_KEY)
    # Without a key, signatures are not needed (and everything still goes through allow-lists).
    assert JOBS.restore(root)[0].step == 2

    monkeypatch.setenv(ENV_KEY, "job-secret")
    assert DurableTier(str(root)).verify(0) == []
    assert any("not signed" in p for p in DurableTier(str(root)).verify(2))


def _restore_warned(root, **config):
    t, extra, state = JOBS.state(9)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=JOBS.fresh_namespace(), durable_uri=str(root), **config)
    )
    try:
        result = ckpt.restore()
    finally:
        ckpt.close()
    return result, extra, params_of(t.model)


def test_signing_key_config_is_validated_and_never_printed():
    cfg = CheckpointConfig(store="local", signing_key="s3cr3t-value")
    assert "s3cr3t-value" not in repr(cfg)
    for bad in (b"", "", 42):
        with pytest.raises(ConfigError, match="signing_key"):
            CheckpointConfig(store="local", signing_key=bad)


def test_config_signing_key_signs_local_store_versions(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    root = tmp_path / "d"
    _save_steps(root, [0], config_key=b"cfg-secret")
    assert "signature" in json.loads((root / OLDER / MARKER).read_text())
    assert JOBS.restore(root, signing_key=b"cfg-secret")[0].step == 0


def test_a_signed_version_copied_into_another_run_is_refused(tmp_path, monkeypatch):
    """The signature covers the namespace the version was written for: a directory copied
    from another run (same key) is not restored as this run's."""
    monkeypatch.delenv(ENV_KEY, raising=False)
    root = tmp_path / "d"
    _save_steps(root, [0, 1], config_key=b"shared-key")
    assert json.loads((root / NEWEST / MARKER).read_text())["job"]["namespace"] == NAMESPACE
    assert JOBS.restore(root, signing_key=b"shared-key")[0].step == 1  # its own run restores it
    t, extra, state = JOBS.state(9)
    other = Checkpointer(
        state,
        CheckpointConfig(store="local", namespace="another-run", durable_uri=str(root), signing_key=b"shared-key"),
    )
    try:
        with pytest.warns(UserWarning), pytest.raises(ChecksumError) as caught:
            other.restore()
    finally:
        other.close()
    assert str(caught.value).count(f"is signed for namespace {NAMESPACE!r}, not this job's 'another-run'") == 2


def test_an_item_missing_from_memory_is_never_taken_from_another_version_of_the_step_on_disk(tmp_path):
    """Memory holds one run's step 1, the durable tier another run's step 1 (same namespace):
    a memory item that fails its checksum is not read from the durable copy (a mixed state);
    the version is skipped whole and the older one restored."""
    root = tmp_path / "d"
    _save_steps(root, [0, 1])  # run A: steps 0 and 1 on disk
    t, extra, state = JOBS.state(5)  # run B: another state, its steps 0 and 1 in memory only
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=JOBS.fresh_namespace()))
    batches, params = t.batches(), {}
    for step in (0, 1):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        ckpt.save(step)
        params[step] = params_of(t.model)
    ckpt.close()
    damage_copy(ckpt.store, 1, 0, 0)  # the first item of run B's step 1, in memory
    t2, _, state2 = JOBS.state(9)
    fresh = Checkpointer(state2, CheckpointConfig(store="local", namespace=NAMESPACE, durable_uri=str(root)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fresh.restore()
    finally:
        fresh.close()
    assert result.step == 0 and 1 in result.skipped_steps
    assert all(torch.equal(p, params[0][n]) for n, p in params_of(t2.model).items())


def test_a_signing_key_needs_an_explicit_namespace(monkeypatch):
    """A signature binds the namespace: two jobs left on the default one would accept each
    other's signed versions. A key, from the config or the environment, without a
    namespace is refused before anything is saved; with one, the Checkpointer starts."""
    import warnings

    from torch import nn

    from gemini_ckpt import CheckpointConfig, Checkpointer, ConfigError, TrainState

    state = TrainState(model=nn.Linear(2, 2), optimizer=None)
    with pytest.raises(ConfigError, match="needs an explicit CheckpointConfig.namespace"):
        Checkpointer(state, CheckpointConfig(store="local", signing_key=b"k" * 32)).start()
    monkeypatch.setenv("GEMINI_CKPT_SIGNING_KEY", "from-the-environment")
    with pytest.raises(ConfigError, match=r"\$GEMINI_CKPT_SIGNING_KEY\) needs an explicit"):
        Checkpointer(state, CheckpointConfig(store="local")).start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(state, CheckpointConfig(store="local", signing_key=b"k" * 32, namespace="job-7")).start().close()
        Checkpointer(state, CheckpointConfig(store="local", namespace="job-8")).start().close()
