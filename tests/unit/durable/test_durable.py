"""The durable tier: which versions, stock DCP loads, S3, crash safety, checksums, retention."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gemini_ckpt.chaos import faulty_filesystem
from helpers import corrupt_item
from gemini_ckpt import BackgroundError, CheckpointConfig, CheckpointError, Checkpointer, TrainState
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.toy import TinyLM, build_training, lm_loss
import paths

HERE = paths.TESTS  # the support modules


def _train_and_save(config, steps, *, durable=None, record=()):
    """Train ``steps`` steps saving each; return {step: model+optim tensors} for ``record``."""
    t = build_training(seed=0, dataset_size=32)
    ckpt = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler), config, durable=durable
    )
    batches, kept, handles = t.batches(), {}, {}
    for step in range(steps):
        lm_loss(t.model, next(batches)).backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()
        handles[step] = ckpt.save(step)
        if step in record:
            kept[step] = (
                {k: v.clone() for k, v in t.model.state_dict().items()},
                {k: v["exp_avg"].clone() for k, v in t.optimizer.state_dict()["state"].items()},
            )
    return ckpt, kept, handles


def _stock_load(path: str):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    dcp.load(target, storage_reader=FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    return model, opt


def _assert_matches(model, opt, expected):
    params, exp_avg = expected
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    for i, st in opt.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], exp_avg[i]), i


def test_every_third_version_persisted_and_loadable_with_stock_dcp(tmp_path):
    uri = str(tmp_path / "durable")
    config = CheckpointConfig(
        store="local",
        namespace=uuid.uuid4().hex,
        persist_every=3,
        durable_uri=uri,
        keep_durable=10,
        persist_on_close=False,
    )
    ckpt, kept, handles = _train_and_save(config, 10, record=(2, 5, 8))
    ckpt.close()
    assert ckpt.durable.complete_steps() == [2, 5, 8]
    assert ckpt.durable.latest() == 8
    assert handles[5].persisted.result() == ckpt.durable.location(5)
    assert handles[4].persisted.result() is None
    for step in (2, 5, 8):
        model, opt = _stock_load(os.path.join(uri, f"step_{step:09d}"))
        _assert_matches(model, opt, kept[step])
    marker = (tmp_path / "durable" / "step_000000008" / ".gemini_complete").read_text()
    assert '"world_size": 1' in marker and '"checksums"' in marker


def test_the_durable_tier_passes_the_read_contract_and_refuses_out_of_range_reads(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from gemini_ckpt import VersionNotFoundError
    from tier_contract import check_read_contract

    uri = str(tmp_path / "durable")
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=2, durable_uri=uri, persist_on_close=False
    )
    ckpt, kept, _ = _train_and_save(config, 2, record=(1,))
    ckpt.close()
    params, _ = kept[1]
    tier = DurableTier(uri)
    check_read_contract(tier, 1, {MetadataIndex(f"model.{k}", torch.Size([0] * v.dim())): v for k, v in params.items()})
    store = tier.store
    size = os.path.getsize(os.path.join(uri, "step_000000001", "__0_0.distcp"))
    assert len(store.read_range(1, "__0_0.distcp", size - 4, 4)) == 4
    with pytest.raises(ValueError, match="outside the file"):
        store.read_range(1, "__0_0.distcp", size - 4, 8)
    with pytest.raises(VersionNotFoundError):
        store.read_range(1, "__9_0.distcp", 0, 1)
    with pytest.raises(VersionNotFoundError):
        store.manifest(3)


def test_persist_now_and_persist_on_close(tmp_path):
    uri = str(tmp_path / "d")
    config = CheckpointConfig(store="local", namespace=uuid.uuid4().hex, persist_every=100, durable_uri=uri)
    t = build_training(seed=1, dataset_size=32)
    ckpt = Checkpointer(TrainState(model=t.model, optimizer=t.optimizer), config)
    assert ckpt.save(0, persist=True).persisted.result(timeout=60).endswith("step_000000000")
    ckpt.save(1)
    ckpt.save(2)
    ckpt.close()
    assert ckpt.durable.complete_steps() == [0, 2]


def test_retention_keeps_exactly_keep_durable_versions(tmp_path):
    uri = str(tmp_path / "d")
    config = CheckpointConfig(
        store="local",
        namespace=uuid.uuid4().hex,
        persist_every=1,
        durable_uri=uri,
        keep_durable=2,
        persist_on_close=False,
    )
    ckpt, _, _ = _train_and_save(config, 6)
    ckpt.close()
    assert ckpt.durable.complete_steps() == [4, 5]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["latest", "step_000000004", "step_000000005"]


def test_storage_failure_keeps_training_and_memory_tier_going_and_next_persist_retries(tmp_path):
    fs, handler = faulty_filesystem()
    durable = DurableTier(filesystem=fs, root=str(tmp_path / "d"), keep=5)
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=2, keep_durable=5, persist_on_close=False
    )
    t = build_training(seed=2, dataset_size=32)
    ckpt = Checkpointer(TrainState(model=t.model, optimizer=t.optimizer), config, durable=durable)
    ckpt.save(0)
    h1 = ckpt.save(1)
    assert h1.persisted.result(timeout=60)
    handler.failing.set()
    h3 = [ckpt.save(s) for s in (2, 3)][-1]
    with pytest.raises(BackgroundError, match="not persisted"):
        h3.persisted.result(timeout=60)
    assert h3.committed.result(timeout=60) == 3  # the memory tier is unaffected
    ckpt.save(4)  # no error on the training thread (persist_errors="log")
    handler.failing.clear()
    assert ckpt.save(5).persisted.result(timeout=60)
    assert ckpt.stats.persist_failed == 1 and "injected storage failure" in ckpt.stats.last_persist_error
    with pytest.warns(UserWarning, match=r"1 persist\(s\) to .* failed in this run"):  # said even with "log"
        ckpt.close()
    assert durable.complete_steps() == [1, 5]
    assert durable.latest() == 5


def test_unreachable_storage_restores_from_memory_and_never_starts_fresh_blind(tmp_path):
    fs, handler = faulty_filesystem()
    root = str(tmp_path / "d")
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=2, keep_durable=5, persist_on_close=False
    )
    ckpt, kept, handles = _train_and_save(config, 4, durable=DurableTier(filesystem=fs, root=root), record=(3,))
    assert handles[3].persisted.result(timeout=60)
    handler.unreachable.set()

    # Memory holds everything: the restart neither needs nor waits for the durable tier.
    t = build_training(seed=5, dataset_size=32)
    again = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        config,
        durable=DurableTier(filesystem=fs, root=root),
    )
    result = again.restore()
    assert (result.step, result.source, result.sources) == (3, "memory", {0: "local"})
    _assert_matches(t.model, t.optimizer, kept[3])
    again.abort()

    # Memory is empty (another namespace) and the storage cannot be listed: an error naming the
    # tier, not "no checkpoint" (which would restart training from step 0).
    t = build_training(seed=6, dataset_size=32)
    blind = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        CheckpointConfig(store="local", namespace=uuid.uuid4().hex, persist_every=2),
        durable=DurableTier(filesystem=fs, root=root),
    )
    with pytest.raises(CheckpointError, match="durable tier could not be listed.*injected: storage unreachable"):
        blind.restore()
    handler.unreachable.clear()  # storage back: the same Checkpointer restores from it
    result = blind.restore()
    assert (result.step, result.source) == (3, "durable")
    _assert_matches(t.model, t.optimizer, kept[3])
    blind.abort()
    ckpt.close()


def test_flipped_byte_caught_by_verify_and_restore_falls_back(tmp_path):
    uri = str(tmp_path / "d")
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=3, durable_uri=uri, persist_on_close=False
    )
    ckpt, kept, _ = _train_and_save(config, 6, record=(2,))
    ckpt.close()
    data = tmp_path / "d" / "step_000000005" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert ckpt.durable.verify(2) == []
    problems = ckpt.durable.verify(5)
    assert len(problems) == 1 and "checksum mismatch" in problems[0]
    cli = subprocess.run([sys.executable, "-m", "gemini_ckpt", "verify", uri], capture_output=True, text=True)
    assert cli.returncode == 1 and "step 5" in cli.stdout and "checksum mismatch" in cli.stdout

    # A new job (empty memory) restores: step 5 is refused, step 2 is loaded.
    t = build_training(seed=9, dataset_size=32)
    fresh = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        CheckpointConfig(store="local", namespace=uuid.uuid4().hex, durable_uri=uri),
    )
    with pytest.warns(UserWarning, match=r"step 5 \(durable\) could not be restored"):
        result = fresh.restore()
    assert result.step == 2 and result.source == "durable" and result.skipped_steps == (5,)
    _assert_matches(t.model, t.optimizer, kept[2])
    fresh.close()


def test_crash_mid_persist_leaves_previous_version_and_latest_intact(tmp_path):
    root, refs = tmp_path / "d", tmp_path / "refs"
    refs.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, str(HERE / "durable_child.py"), str(root), str(refs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        partial = root / "step_000000005" / "__0_0.distcp"
        deadline = time.monotonic() + 120
        while not partial.exists():
            assert child.poll() is None, child.stdout.read()
            assert time.monotonic() < deadline, "the child never reached step 5's persist"
            time.sleep(0.05)
        time.sleep(0.2)  # it is now stuck writing step 5's metadata
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    tier = DurableTier(str(root))
    assert tier.complete_steps() == [2]
    assert tier.latest() == 2
    assert tier.store.list_versions() == {2: True, 5: False}

    t = build_training(seed=5, dataset_size=32)
    ckpt = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        CheckpointConfig(store="local", namespace=uuid.uuid4().hex, durable_uri=str(root)),
    )
    result = ckpt.restore()  # opening the tier cleans up the partial directory
    assert result.step == 2 and result.source == "durable"
    reference = torch.load(refs / "step2.pt")
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, reference[k]), k
    assert not (root / "step_000000005").exists()
    ckpt.close()


# --- S3, through pyarrow's S3FileSystem, against a real S3-speaking server on loopback -----


@pytest.fixture(scope="module")
def s3_uri():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import pyarrow.fs as pafs

    base = (
        f"s3://testing:testing@ckpt/run?endpoint_override=127.0.0.1:{port}&scheme=http"
        f"&region=us-east-1&allow_bucket_creation=true"
    )
    fs, _ = pafs.FileSystem.from_uri(base)
    fs.create_dir("ckpt")
    yield base
    server.stop()


def test_persist_to_s3_and_restore_from_it(s3_uri, tmp_path):
    config = CheckpointConfig(
        store="local",
        namespace=uuid.uuid4().hex,
        persist_every=3,
        durable_uri=s3_uri,
        keep_durable=2,
        persist_on_close=False,
    )
    ckpt, kept, _ = _train_and_save(config, 9, record=(5, 8))
    ckpt.close()
    tier = ckpt.durable
    assert tier.complete_steps() == [5, 8] and tier.latest() == 8
    assert tier.verify(8) == []
    # The S3 directory is a stock DCP checkpoint: copy it down and load it with FileSystemReader.
    local = tmp_path / "step8"
    local.mkdir()
    fs, root = tier.store.fs, tier.location(8)
    import pyarrow.fs as pafs

    for info in fs.get_file_info(pafs.FileSelector(root)):
        with fs.open_input_file(info.path) as f:
            (local / os.path.basename(info.path)).write_bytes(f.read())
    model, opt = _stock_load(str(local))
    _assert_matches(model, opt, kept[8])
    # And a new job restores straight from S3.
    t = build_training(seed=3, dataset_size=32)
    fresh = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        CheckpointConfig(store="local", namespace=uuid.uuid4().hex, durable_uri=s3_uri),
    )
    result = fresh.restore()
    assert result.step == 8 and result.source == "durable"
    _assert_matches(t.model, t.optimizer, kept[8])
    fresh.close()


def test_corrupt_memory_copy_is_replaced_by_the_durable_copy_of_the_same_step(tmp_path):
    uri = str(tmp_path / "d")
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=3, durable_uri=uri, persist_on_close=False
    )
    ckpt, kept, handles = _train_and_save(config, 3, record=(2,))
    handles[2].persisted.result(timeout=60)
    fqn = corrupt_item(ckpt.store, 2)
    on_disk = next(
        info.length for index, info in DurableTier(uri).open(2).metadata.storage_data.items() if index.fqn == fqn
    )
    t = build_training(seed=4, dataset_size=32)
    again = Checkpointer(TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler), config)
    result = again.restore()
    assert result.step == 2 and result.source == "memory" and result.skipped_steps == ()
    assert result.bytes_read["durable"] == on_disk  # just the bad item came from disk
    _assert_matches(t.model, t.optimizer, kept[2])
    ckpt.close()
    again.close()
