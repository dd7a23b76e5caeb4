"""Verify before interpret, and any damaged version falls back (issue 13).

Crafted files never run code (allow-lists, checksums before unpickling, optional HMAC), and
every kind of damage to the newest version ends in the next older good version restored,
on every rank alike; ``ls``/``verify`` report damage with exit status 1, never a traceback.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
import uuid
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gemini_ckpt.chaos import damage_copy
from gemini_ckpt import ChecksumError, CheckpointConfig, Checkpointer, ConfigError, TrainState
from gemini_ckpt.__main__ import main as cli
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.durable.layout import parse_step_dir
from gemini_ckpt.stores.views import MemoryVersion
from gemini_ckpt.stores.memory import LocalTier, drop_local_store
from gemini_ckpt.errors import ShardFormatError, VerificationError
from gemini_ckpt.format.shards import ShardPlan, ShardRecord
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.trust.manifest import ENV_KEY
from gemini_ckpt.trust.metadata import metadata_loads
from gemini_ckpt.trust.values import value_loads
from forge import forge_item as _forge_item
from forge import reseal as _reseal
from helpers import local_tier
from rendezvous import join_group, master_store

NAMESPACE = "trust-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """This module's jobs share one namespace (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


MARKER, METADATA, EXTRA_KEY = ".gemini_complete", ".metadata", "rank_local.0.extra"
NEWEST, OLDER = "step_000000001", "step_000000000"


class _Evil:
    """A pickle that, when loaded with arbitrary globals, creates ``path``."""

    def __init__(self, path, how="system"):
        self.path, self.how = str(path), how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.path}",))
        return (eval, (f"open({self.path!r}, 'w').close()",))


def _evil_pickle(path, how="system") -> bytes:
    return pickle.dumps(_Evil(path, how))


def _state(seed):
    t = build_training(seed=seed, dataset_size=32)
    extra = {}
    return (
        t,
        extra,
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=t.loader, extra=extra),
    )


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A durable directory with two good versions (steps 0 and 1) and the model at each."""
    root = tmp_path_factory.mktemp("versions") / "d"
    t, extra, state = _state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local", namespace=_job_namespace(), persist_every=1, durable_uri=str(root), keep_durable=5
        ),
    )
    batches, params = t.batches(), {}
    for step in range(2):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()
        extra["tokens"] = step + 1
        ckpt.save(step)
        params[step] = _params(t.model)
    ckpt.close()
    return root, params


def _copy(versions, tmp_path) -> Path:
    dst = tmp_path / f"d{uuid.uuid4().hex[:8]}"
    shutil.copytree(versions[0], dst)
    return dst


def _restore(root, **config):
    """A new job (empty memory) restores from ``root``: (result, extra, params)."""
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=_job_namespace(), durable_uri=str(root), **config)
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = ckpt.restore()
    finally:
        ckpt.close()
    return result, extra, _params(t.model)


def _assert_restored(root, versions, step, skipped=(), **config):
    result, extra, params = _restore(root, **config)
    assert result is not None and result.step == step, result
    assert tuple(result.skipped_steps) == tuple(skipped), result.skipped_steps
    assert extra == {"tokens": step + 1}
    for name, value in versions[1][step].items():
        assert torch.equal(params[name], value), name


# --- forging: what a writer of the storage directory can do without the key -------------------
def _torch_saved(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- 1. code execution on restore ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["system", "eval"])
@pytest.mark.parametrize("reseal", [False, True], ids=["crc-stale", "crc-recomputed"])
def test_crafted_metadata_pickle_never_runs_and_restore_falls_back(versions, tmp_path, how, reseal):
    root, pwned = _copy(versions, tmp_path), tmp_path / "pwned"
    (root / NEWEST / METADATA).write_bytes(_evil_pickle(pwned, how))
    if reseal:
        _reseal(root / NEWEST)
    _assert_restored(root, versions, 0, skipped=(1,))
    problems = DurableTier(str(root)).verify(1)
    assert problems and ("allow-listed" in problems[0] if reseal else "replaced" in problems[0]), problems
    assert not pwned.exists()


@pytest.mark.parametrize("layer", ["outer", "inner"])
def test_crafted_non_tensor_item_with_recomputed_crc_never_runs(versions, tmp_path, layer):
    """The ``extra`` item: DCP's own planner would torch.load it with weights_only=False."""
    root, pwned = _copy(versions, tmp_path), tmp_path / "pwned"
    payload = _torch_saved(_Evil(pwned)) if layer == "outer" else _torch_saved(_evil_pickle(pwned))
    _forge_item(root / NEWEST, EXTRA_KEY, payload)
    assert DurableTier(str(root)).verify(1) != []
    _assert_restored(root, versions, 0, skipped=(1,))
    assert not pwned.exists()


def test_crafted_tensor_item_never_runs(versions, tmp_path):
    root, pwned = _copy(versions, tmp_path), tmp_path / "pwned"
    _forge_item(root / NEWEST, "model.pos", _torch_saved(_Evil(pwned)))
    _assert_restored(root, versions, 0, skipped=(1,))
    assert not pwned.exists()


def _memory_version(step=3):
    """A real version in a process-local memory tier, and its plan and record."""
    _, _, state = _state(0)
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
            cls.decode(_evil_pickle(pwned))
        with pytest.raises(ShardFormatError, match="signing key"):
            cls.decode(encoded, b"a key")  # unsigned, and a key is set
        assert cls.decode(obj.encode(b"a key"), b"a key") == obj
        with pytest.raises(ShardFormatError, match="does not match this signing key"):
            cls.decode(obj.encode(b"a key"), b"another key")
    # A plan whose metadata skeleton is a crafted pickle, every CRC recomputed, decodes (it is
    # consistent), but the metadata allow-list refuses it.
    forged = ShardPlan.decode(replace(plan, metadata=_evil_pickle(pwned)).encode())
    with pytest.raises(VerificationError, match="not allow-listed"):
        metadata_loads(forged.metadata)
    assert not pwned.exists()


def test_allow_lists_take_what_our_state_needs(versions):
    """Every opaque value TrainState writes (RNG streams, loader, scheduler, extra) passes the
    value allow-list, and real DCP metadata passes the metadata one."""
    _, _, state = _state(0)
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


# --- 2. signing ----------------------------------------------------------------------------------
def _save_steps(root, steps, *, key=None, config_key=None, monkeypatch=None):
    if monkeypatch is not None:
        if key is None:
            monkeypatch.delenv(ENV_KEY, raising=False)
        else:
            monkeypatch.setenv(ENV_KEY, key)
    t, extra, state = _state(0)
    cfg = CheckpointConfig(
        store="local",
        namespace=_job_namespace(),
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
    _reseal(root / NEWEST, lambda m: m["job"].update(world_size=1, note="forged"))

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
    assert _restore(root)[0].step == 2

    monkeypatch.setenv(ENV_KEY, "job-secret")
    assert DurableTier(str(root)).verify(0) == []
    assert any("not signed" in p for p in DurableTier(str(root)).verify(2))


def _restore_warned(root, **config):
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=_job_namespace(), durable_uri=str(root), **config)
    )
    try:
        result = ckpt.restore()
    finally:
        ckpt.close()
    return result, extra, _params(t.model)


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
    assert _restore(root, signing_key=b"cfg-secret")[0].step == 0


def test_a_signed_version_copied_into_another_run_is_refused(tmp_path, monkeypatch):
    """The signature covers the namespace the version was written for: a directory copied
    from another run (same key) is not restored as this run's."""
    monkeypatch.delenv(ENV_KEY, raising=False)
    root = tmp_path / "d"
    _save_steps(root, [0, 1], config_key=b"shared-key")
    assert json.loads((root / NEWEST / MARKER).read_text())["job"]["namespace"] == NAMESPACE
    assert _restore(root, signing_key=b"shared-key")[0].step == 1  # its own run restores it
    t, extra, state = _state(9)
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
    t, extra, state = _state(5)  # run B: another state, its steps 0 and 1 in memory only
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=_job_namespace()))
    batches, params = t.batches(), {}
    for step in (0, 1):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        ckpt.save(step)
        params[step] = _params(t.model)
    ckpt.close()
    damage_copy(ckpt.store, 1, 0, 0)  # the first item of run B's step 1, in memory
    t2, _, state2 = _state(9)
    fresh = Checkpointer(state2, CheckpointConfig(store="local", namespace=NAMESPACE, durable_uri=str(root)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fresh.restore()
    finally:
        fresh.close()
    assert result.step == 0 and 1 in result.skipped_steps
    assert all(torch.equal(p, params[0][n]) for n, p in _params(t2.model).items())


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
    root = _copy(versions, tmp_path)
    DAMAGE[damage](root)
    _assert_restored(root, versions, 0, skipped=(1,))
    assert DurableTier(str(root)).verify(1) != []
    assert DurableTier(str(root)).verify(0) == []


@pytest.mark.parametrize("name", ["step_0000000000009", "step_00000000\u0663", "step_000000009.bak", "step_9"])
def test_non_canonical_step_directories_are_ignored(versions, tmp_path, name, capsys):
    root = _copy(versions, tmp_path)
    shutil.copytree(root / NEWEST, root / name)
    assert parse_step_dir(name) is None
    assert DurableTier(str(root)).complete_steps() == [0, 1]
    _assert_restored(root, versions, 1)
    assert cli(["ls", str(root)]) == 0
    assert f"ignored: {name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content",
    [b"step_abc\n", b"", b"\xff\xfe", b"step_0000000000001\n", b"step_00000000\xd9\xa3\n", b"../../etc/passwd"],
)
def test_bad_latest_is_ignored_and_rewritten_by_the_next_persist(versions, tmp_path, content, caplog):
    root = _copy(versions, tmp_path)
    (root / "latest").write_bytes(content)
    tier = DurableTier(str(root))
    assert tier.latest() is None
    assert "ignored" in caplog.text or content == b""
    _assert_restored(root, versions, 1)
    # The next persist goes through and rewrites it.
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local", namespace=_job_namespace(), durable_uri=str(root), persist_every=1, keep_durable=5
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore().step == 1
    ckpt.save(2)
    ckpt.close()
    assert (root / "latest").read_text() == "step_000000002\n" and tier.latest() == 2


def test_ls_and_verify_report_damage_per_version_and_never_crash(versions, tmp_path, capsys):
    root = _copy(versions, tmp_path)
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
    root = _copy(versions, tmp_path)
    raw = bytearray((root / NEWEST / METADATA).read_bytes())
    raw[len(raw) // 2] ^= 0x20
    (root / NEWEST / METADATA).write_bytes(bytes(raw))
    assert any(".metadata fails its checksum" in p for p in DurableTier(str(root)).verify(1))


# --- 4. fuzz ---------------------------------------------------------------------------------------
def _fuzz_cases(root: Path, rng: random.Random, pwned: Path):
    """(name, mutate(root)) for every file of the newest version and ``latest``: truncations at
    sampled lengths, byte flips at sampled offsets, crafted pickles with CRCs recomputed."""
    files = sorted(p.name for p in (root / NEWEST).iterdir()) + ["latest"]
    for name in files:
        path = lambda r, n=name: r / "latest" if n == "latest" else r / NEWEST / n
        size = path(root).stat().st_size
        for keep in sorted({0, 1, size // 3, size - 1, rng.randrange(size)}):
            yield f"{name}:truncate@{keep}", (lambda r, p=path, k=keep: p(r).write_bytes(p(r).read_bytes()[:k]))
        for offset in sorted({0, size - 1, *(rng.randrange(size) for _ in range(4))}):
            bit = 1 << rng.randrange(8)

            def flip(r, p=path, o=offset, b=bit):
                data = bytearray(p(r).read_bytes())
                data[o] ^= b
                p(r).write_bytes(bytes(data))

            yield f"{name}:flip@{offset}^{bit}", flip
        for how in ("system", "eval"):
            if name == METADATA:
                yield (
                    f"{name}:crafted-{how}",
                    (
                        lambda r, h=how: (
                            (r / NEWEST / METADATA).write_bytes(_evil_pickle(pwned, h)),
                            _reseal(r / NEWEST),
                        )
                    ),
                )
            elif name.endswith(".distcp"):
                yield (
                    f"{name}:crafted-extra-{how}",
                    (lambda r, h=how: _forge_item(r / NEWEST, EXTRA_KEY, _torch_saved(_evil_pickle(pwned, h)))),
                )
                yield (
                    f"{name}:crafted-rng-{how}",
                    (lambda r, h=how: _forge_item(r / NEWEST, "rank_local.0.rng", _torch_saved(_Evil(pwned, h)))),
                )
            else:
                yield f"{name}:crafted-{how}", (lambda r, p=path, h=how: p(r).write_bytes(_evil_pickle(pwned, h)))


def test_fuzz_damage_to_any_file_never_runs_code_and_restores_the_older_version(versions, tmp_path):
    rng, pwned = random.Random(13), tmp_path / "pwned"
    t0, n = time.perf_counter(), 0
    for name, mutate in _fuzz_cases(versions[0], rng, pwned):
        root = _copy(versions, tmp_path)
        mutate(root)
        intact = DurableTier(str(root)).verify(1) == []
        # Only damage to ``latest`` leaves step 1 good (restore does not need ``latest``).
        assert intact == name.startswith("latest"), name
        result, extra, params = _restore(root)
        assert not pwned.exists(), name
        expected = 1 if intact else 0
        assert result is not None and result.step == expected, name
        assert tuple(result.skipped_steps) == (() if intact else (1,)), name
        assert extra == {"tokens": expected + 1}, name
        assert all(torch.equal(params[k], v) for k, v in versions[1][expected].items()), name
        shutil.rmtree(root)
        n += 1
    took = time.perf_counter() - t0
    print(f"\nfuzz: {n} durable cases in {took:.1f}s")
    assert n >= 40


def test_fuzz_shard_records_and_plans_held_in_memory(tmp_path):
    """The records and plans a memory tier keeps as bytes (as host stores do): truncations,
    flips and crafted pickles never run code; a damaged newest one means the older version is
    restored."""
    pwned, rng = tmp_path / "pwned", random.Random(7)
    t, extra, state = _state(0)
    tier = _EncodedTier()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", keep_in_memory=5), store=tier)
    for step in range(2):
        lm_loss(t.model, next(t.batches())).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        extra["tokens"] = step + 1
        ckpt.save(step)
    ckpt.close()
    cases = []
    for kind in ("record", "plan"):
        good = tier.encoded[(1, kind)]
        offsets = sorted({0, 5, 16, 20, len(good) - 1, *(rng.randrange(len(good)) for _ in range(10))})
        cases += [(kind, f"truncate@{k}", good[:k]) for k in (0, 10, 30, len(good) - 1)]
        cases += [(kind, f"flip@{o}", good[:o] + bytes([good[o] ^ 0x10]) + good[o + 1 :]) for o in offsets]
        cases += [(kind, "pickled", _evil_pickle(pwned))]
    plan = ShardPlan.decode(tier.encoded[(1, "plan")])
    cases.append(("plan", "crafted-metadata", replace(plan, metadata=_evil_pickle(pwned)).encode()))
    t0 = time.perf_counter()
    for kind, name, blob in cases:
        good = tier.encoded[(1, kind)]
        tier.encoded[(1, kind)] = blob
        t2, extra2, state2 = _state(9)
        reader = Checkpointer(state2, CheckpointConfig(store="local"), store=tier.reader())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = reader.restore()
        reader.close()
        tier.encoded[(1, kind)] = good
        assert not pwned.exists(), name
        assert result.step == 0 and tuple(result.skipped_steps) == (1,) and extra2 == {"tokens": 1}, (kind, name)
    print(f"\nfuzz: {len(cases)} memory-tier record/plan cases in {time.perf_counter() - t0:.1f}s")
    assert len(cases) >= 40


class _EncodedTier(LocalTier):
    """A memory tier that keeps each version's plan and record as bytes (as host stores do)
    and decodes them, checked, whenever a version is opened."""

    def __init__(self, base=None, encoded=None):
        base = base or local_tier(keep=5)
        super().__init__(base.store, base.epoch, base.keep)
        self.encoded: dict = encoded if encoded is not None else {}

    def _commit(self, step, plan, segment, blobs, persist):
        outcome = super()._commit(step, plan, segment, blobs, persist)
        view = super().open(step)
        self.encoded[(step, "plan")] = view.plans[0].encode()
        self.encoded[(step, "record")] = view.records[0].encode()
        return outcome

    def open(self, step, *, key=None):
        view = super().open(step)
        plan = ShardPlan.decode(self.encoded[(step, "plan")], key)
        record = ShardRecord.decode(self.encoded[(step, "record")], key)
        return MemoryVersion(step, {0: plan}, {0: record}, view.copies)

    def reader(self):
        """Another Checkpointer's view of the same versions (a new job, the same host)."""
        return _EncodedTier(self, self.encoded)


# --- 5. every rank takes the same decision ---------------------------------------------------------
def _two_rank_worker(rank, world_size, port, roots, out):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    join_group(port, rank, world_size)
    try:
        t, extra, state = _state(9)
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
                "params": _params(t.model),
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_ranks_agree_to_skip_a_version_only_one_rank_finds_damaged(versions, tmp_path):
    """Rank 1 reads a truncated ``.metadata`` for step 1, rank 0 an intact copy: both skip it
    and load step 0 (no hang, no mix of steps)."""
    intact, damaged = _copy(versions, tmp_path), _copy(versions, tmp_path)
    _truncate(damaged / NEWEST / METADATA)
    store = master_store(2)
    mp.spawn(_two_rank_worker, args=(2, store.port, [str(intact), str(damaged)], str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["step"] == 0 and got["skipped"] == (1,) and got["extra"] == {"tokens": 1}
        assert all(torch.equal(got["params"][k], v) for k, v in versions[1][0].items())


def test_a_signing_key_needs_an_explicit_namespace(monkeypatch):
    """A signature binds the namespace: two jobs left on the default one would accept each
    other's signed versions (issue 40, 9). A key, from the config or the environment, without a
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
