"""``CheckpointConfig`` compiled once (``gemini_ckpt.settings``): every field reaches the part
that uses it, modes arrive as what the part branches on, and the signing key is resolved at
compile time, not again by each part."""

from __future__ import annotations

import dataclasses

import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, HealthCheck, TrainState
from gemini_ckpt.config import Interleave
from gemini_ckpt.settings import Settings, compile_config, store_settings
from gemini_ckpt.signing import ENV_KEY


def test_every_field_reaches_its_part():
    check = HealthCheck()
    config = CheckpointConfig(
        store="local",
        namespace="compiled",
        replicas=3,
        placement="ring",
        keep_in_memory=4,
        persist_every=5,
        durable_uri="runs/x",
        keep_durable=6,
        persist_on_close=False,
        persist_errors="raise",
        max_inflight=2,
        inflight_policy="skip",
        staging="overlap",
        host_memory_budget_bytes=1 << 30,
        world_size_change="error",
        timeout_s=42,
        signing_key="s3cr3t-q",
        replication_bandwidth=8 << 20,
        interleave="network",
        overwrite=True,
        init_from="stock/dcp",
        health_check=check,
        failure_domain="rack",
        metrics=False,
    )
    s = compile_config(config)
    assert isinstance(s, Settings)
    assert (s.local, s.namespace, s.timeout_s, s.overwrite) == (True, "compiled", 42.0, True)
    assert dataclasses.asdict(s.save) == {
        "timeout_s": 42.0,
        "overlap": True,
        "health_check": dataclasses.asdict(check),
        "max_inflight": 2,
        "skip_when_busy": True,
        "keep": 4,
        "namespace": "compiled",
        "replicas": 3,
        "placement": "ring",
    }
    assert s.save.health_check is check
    assert (s.restore.namespace, s.restore.key, s.restore.derive_world_size, s.restore.init_from) == (
        "compiled",
        b"s3cr3t-q",
        False,
        "stock/dcp",
    )
    assert dataclasses.asdict(s.durable) == {
        "uri": "runs/x",
        "every": 5,
        "keep": 6,
        "on_close": False,
        "raise_errors": True,
        "timeout_s": 42.0,
        "key": b"s3cr3t-q",
    }
    store = s.store
    assert (store.namespace, store.named, store.replicas, store.placement, store.keep) == (
        "compiled",
        True,
        3,
        "ring",
        4,
    )
    assert (store.budget_bytes, store.failure_domain, store.bandwidth, store.metrics) == (
        1 << 30,
        "rack",
        8 << 20,
        False,
    )
    assert store.interleave is Interleave.NETWORK and store.key == b"s3cr3t-q"
    assert store_settings(config) == store
    assert "s3cr3t" not in repr(s)  # the key is never printed


def test_the_defaults_compile_to_the_default_modes():
    s = compile_config(CheckpointConfig(interleave=False))
    assert (s.local, s.save.overlap, s.save.skip_when_busy, s.restore.derive_world_size) == (False, False, False, True)
    assert (s.durable.raise_errors, s.durable.on_close, s.store.named, s.store.interleave) == (
        False,
        True,
        False,
        Interleave.OFF,
    )


def test_the_signing_key_is_resolved_once_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_KEY, "from-env")
    state = TrainState(model=torch.nn.Linear(2, 2))
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace="keyed"))
    monkeypatch.setenv(ENV_KEY, "changed-later")
    assert ckpt.settings.restore.key == ckpt.settings.store.key == ckpt.settings.durable.key == b"from-env"
    assert compile_config(CheckpointConfig(signing_key=b"given")).restore.key == b"given"  # the field wins


def test_a_key_set_after_the_checkpointer_was_built_signs_nothing(monkeypatch, tmp_path):
    """Every tier signs with the key resolved at construction: a key that appears in the
    environment later would otherwise sign the durable copy alone, which the memory tier and
    restore (unsigned) disagree with."""
    from gemini_ckpt.durable.tier import DurableTier

    monkeypatch.delenv(ENV_KEY, raising=False)
    state = TrainState(model=torch.nn.Linear(2, 2))
    uri = str(tmp_path / "durable")
    config = CheckpointConfig(store="local", namespace="late-key", persist_every=1, durable_uri=uri)
    ckpt = Checkpointer(state, config)
    monkeypatch.setenv(ENV_KEY, "set-later")
    ckpt.save(1)
    ckpt.wait_persisted()
    ckpt.close()
    problems = DurableTier(uri).verify(1, signing_key="set-later")
    assert problems and "not signed" in problems[0], problems
    monkeypatch.delenv(ENV_KEY)
    assert DurableTier(uri).verify(1) == []
