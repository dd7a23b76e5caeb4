"""A writer of the durable directory (or of an ``init_from`` directory) is hostile (issue 22).

Symlinks, FIFOs, sparse oversized files and memory bombs planted where the library reads or
writes: nothing is written outside the directory, nothing hangs, memory stays bounded by the
recorded size of the version, a damaged version is skipped with a reason and the older good
one restored. Every operation that could hang runs in a thread with a deadline, so a
regression fails here instead of hanging the suite; planted FIFOs are unblocked afterwards.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from gemini_ckpt.chaos import faulty_filesystem
from forge import forge_item, reseal
from gemini_ckpt import CheckpointConfig, CheckpointError, Checkpointer, TrainState
from gemini_ckpt import faults
from gemini_ckpt.checksum import checksum
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.stores.memory import drop_local_store

NAMESPACE = "hostile-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """This module's jobs share one namespace (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


MARKER, METADATA, IN_PROGRESS, DATA = ".gemini_complete", ".metadata", ".gemini_inprogress", "__0_0.distcp"
NEWEST, OLDER = "step_000000001", "step_000000000"
KEY = "hostile-test-key"
DEADLINE_S = 60.0  # far above what any of these takes; only a hang gets there
MiB = 1 << 20
BOMB = 384 * MiB  # what a planted file claims or inflates to: far above the bound on any version here
SLACK = 96 * MiB  # the process's own noise (imports, allocator) on top of 2x the version


# --- running hostile operations -------------------------------------------------------------------
def within(seconds, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread; fails the test (instead of hanging it) past ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=f"hostile-{getattr(fn, '__name__', 'op')}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds:.0f}s (it hangs)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """How far above its starting point this process's memory went inside the block: an RSS
    sampler (long bursts) and the kernel's lifetime peak (short ones, when it sets a new peak)."""

    def __enter__(self):
        import gc

        gc.collect()
        self.base, self.base_max = _rss(), _maxrss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        top = _maxrss()
        self.rise = self.peak - self.base
        if top > self.base_max:
            self.rise = max(self.rise, top - self.base)
        return False


@pytest.fixture
def fifos():
    """FIFOs a test plants; afterwards anything blocked opening one is released."""
    planted: list[Path] = []
    yield planted
    for _ in range(3):
        for p in planted:
            try:
                if not stat.S_ISFIFO(os.stat(p).st_mode):
                    continue
            except OSError:
                continue
            for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                try:
                    os.close(os.open(p, flags))
                except OSError:
                    pass
        time.sleep(0.05)


# --- versions ------------------------------------------------------------------------------------
def _state(seed):
    t = build_training(seed=seed, dataset_size=32)
    extra = {}
    return t, extra, TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, extra=extra)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _make_versions(root: Path, **config):
    t, extra, state = _state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local", namespace=_job_namespace(), persist_every=1, durable_uri=str(root), keep_durable=5, **config
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


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A durable directory with good steps 0 and 1, and the model at each."""
    return _make_versions(tmp_path_factory.mktemp("hostile") / "d")


@pytest.fixture(scope="module")
def signed_versions(tmp_path_factory):
    return _make_versions(tmp_path_factory.mktemp("hostile-signed") / "d", signing_key=KEY)


def _copy(versions, tmp_path) -> Path:
    dst = tmp_path / f"d{uuid.uuid4().hex[:8]}"
    shutil.copytree(versions[0], dst)
    return dst


def _version_bytes(root: Path, step_dir: str = NEWEST) -> int:
    return sum(p.stat().st_size for p in (root / step_dir).iterdir() if p.is_file() and not p.is_symlink())


@pytest.fixture
def outside(tmp_path):
    """A file outside every durable directory that planted links point at; it must never change."""
    d = tmp_path / "outside"
    d.mkdir()
    target = d / "target"
    target.write_bytes(b"not yours\n")
    yield target
    assert target.read_bytes() == b"not yours\n", "something was written outside the durable directory"
    assert sorted(p.name for p in d.iterdir()) == ["target"], "something was created outside the durable directory"


def _restore(root, **config):
    """A new job (empty memory) restores from ``root``: (result, extra, params)."""
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(store="local", namespace=_job_namespace(), durable_uri=str(root), timeout_s=30, **config),
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = ckpt.restore()
    finally:
        ckpt.close()
    return result, extra, _params(t.model)


def _assert_restored(root, versions, step, **config):
    result, extra, params = within(DEADLINE_S, _restore, root, **config)
    assert result is not None and result.step == step, result
    assert extra == {"tokens": step + 1}
    for name, value in versions[1][step].items():
        assert torch.equal(params[name], value), name
    return result


def _continue(root, steps, **config):
    """A new job restores from ``root`` and saves (and persists) ``steps``; returns the tier."""
    t, extra, state = _state(9)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local",
            namespace=_job_namespace(),
            durable_uri=str(root),
            persist_every=1,
            keep_durable=5,
            timeout_s=30,
            **config,
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = ckpt.restore()
        for step in steps:
            extra["tokens"] = step + 1
            ckpt.save(step)
        ckpt.close()
    return result, ckpt


# --- forging (the test's own files: pickle.loads here is of bytes the test wrote) ----------------
# a writer without the key: every CRC recomputed, the signature dropped
_reseal = functools.partial(reseal, unsign=True)
_forge_item = functools.partial(forge_item, unsign=True)


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _assert_bomb_refused(root, versions) -> None:
    """The newest version holds an allocation bomb: the older one is restored, ``verify`` names
    the allocation, and memory never rose past twice a version."""
    bound = 2 * _version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        _assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "allocat" in " ".join(problems), problems


def _bytearray_bomb(n: int, protocol: int = 4) -> bytes:
    """A pickle of a few dozen bytes that asks the allow-listed ``bytearray`` for ``n`` bytes."""
    return pickle.dumps(_Reduce(bytearray, (n,)), protocol=protocol)


class _Storage:
    pass


class _TensorPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
        return None


def _deflated_tensor_item(numel: int) -> bytes:
    """A ``torch.save``-shaped archive of a float tensor of ``numel`` zeros whose storage record
    is deflated: a few hundred KiB that inflate to ``4 * numel`` bytes in ``torch.load``."""
    storage = _Storage()
    storage.numel = numel
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=2).dump(
        _Reduce(torch._utils._rebuild_tensor_v2, (storage, 0, (numel,), (1,), False, OrderedDict()))
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        chunk = bytes(4 * MiB)
        with z.open(info, "w", force_zip64=True) as rec:
            left = 4 * numel
            while left:
                rec.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
        z.writestr("archive/version", "3\n")
    return out.getvalue()


# === 1. a persist never writes outside the directory ==============================================
def test_a_planted_latest_tmp_symlink_is_never_written_through(versions, tmp_path, outside):
    root = _copy(versions, tmp_path)
    (root / "latest.tmp").symlink_to(outside)
    result, ckpt = within(DEADLINE_S, _continue, root, [2])
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "step_000000002\n"
    assert DurableTier(str(root)).complete_steps() == [0, 1, 2]


@pytest.mark.parametrize("name", [".metadata.tmp", ".gemini_complete.tmp"])
def test_links_planted_in_a_version_being_written_are_never_written_through(versions, tmp_path, outside, name):
    """Planted while the version's data files are written (between begin and commit)."""
    root = _copy(versions, tmp_path)

    def plant(phase, **ctx):
        if phase == "persist_commit" and ctx["step"] == 2:
            (root / "step_000000002" / name).symlink_to(outside)

    faults.set_hook(plant)
    try:
        result, ckpt = within(DEADLINE_S, _continue, root, [2])
    finally:
        faults.set_hook(None)
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    tier = DurableTier(str(root))
    assert tier.complete_steps() == [0, 1, 2] and tier.latest() == 2 and tier.verify(2) == []
    assert not (root / "step_000000002" / name).exists()


def test_a_data_file_is_created_exclusively_never_through_a_planted_link(versions, tmp_path, outside):
    root = _copy(versions, tmp_path)
    tier = DurableTier(str(root))
    tier.begin(2)
    (root / "step_000000002" / DATA).symlink_to(outside)  # planted after begin, before the write
    with tier.open_output(2, DATA) as out:
        out.write(b"ours")
    assert not (root / "step_000000002" / DATA).is_symlink()
    assert (root / "step_000000002" / DATA).read_bytes() == b"ours"
    assert tier.abandon(2) and not (root / "step_000000002").exists()


def test_a_planted_step_directory_symlink_is_never_followed(versions, tmp_path, outside):
    root = _copy(versions, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / NEWEST, elsewhere)
    shutil.rmtree(root / NEWEST)
    (root / NEWEST).symlink_to(elsewhere)  # a complete version, but not inside the directory
    tier = DurableTier(str(root))
    assert tier.complete_steps() == [0]
    _assert_restored(root, versions, 0)
    result, ckpt = within(DEADLINE_S, _continue, root, [1])
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([DATA, METADATA, MARKER])
    assert not (root / NEWEST).is_symlink() and tier.verify(1) == []


# === 2. no FIFO hangs anything =====================================================================
@pytest.mark.parametrize("name", [DATA, METADATA, MARKER])
@pytest.mark.parametrize("how", ["fifo", "link-to-fifo"])
def test_a_fifo_in_a_version_is_refused_not_waited_for(versions, tmp_path, fifos, name, how):
    root = _copy(versions, tmp_path)
    path = root / NEWEST / name
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "fifo")
        fifos.append(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    fifos.append(path)
    _assert_restored(root, versions, 0)
    problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert problems and any("regular file" in p or "link" in p for p in problems), problems


@pytest.mark.parametrize("how", ["fifo", "link-to-fifo"])
def test_a_fifo_as_latest_neither_blocks_the_persist_nor_close(versions, tmp_path, fifos, how):
    root = _copy(versions, tmp_path)
    (root / "latest").unlink()
    if how == "fifo":
        os.mkfifo(root / "latest")
    else:
        os.mkfifo(tmp_path / "fifo")
        fifos.append(tmp_path / "fifo")
        (root / "latest").symlink_to(tmp_path / "fifo")
    fifos.append(root / "latest")
    assert within(DEADLINE_S, DurableTier(str(root)).latest) is None
    result, ckpt = within(DEADLINE_S, _continue, root, [2])
    assert result.step == 1 and ckpt.stats.persist_failed == 0, ckpt.stats.last_persist_error
    assert (root / "latest").is_file() and not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step_000000002\n"


# === 3. nothing is read before its size is checked against the signed marker ======================
def test_a_sparse_oversized_metadata_is_refused_before_it_is_read(signed_versions, tmp_path):
    root = _copy(signed_versions, tmp_path)
    os.truncate(root / NEWEST / METADATA, 2 * BOMB)  # 4 KiB on disk
    bound = 2 * _version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        _assert_restored(root, signed_versions, 0, signing_key=KEY)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1, signing_key=KEY)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "bytes" in problems[0], problems


def test_a_sparse_oversized_metadata_with_a_forged_size_is_refused_by_the_signature_first(signed_versions, tmp_path):
    root = _copy(signed_versions, tmp_path)
    os.truncate(root / NEWEST / METADATA, 2 * BOMB)
    marker = json.loads((root / NEWEST / MARKER).read_text())
    marker["metadata_bytes"] = 2 * BOMB  # checksum recomputed, as anyone can; the signature no longer matches
    fields = {k: v for k, v in marker.items() if k not in ("manifest_crc", "signature")}
    marker["manifest_crc"] = checksum(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    (root / NEWEST / MARKER).write_text(json.dumps(marker))
    bound = 2 * _version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        _assert_restored(root, signed_versions, 0, signing_key=KEY)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1, signing_key=KEY)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "signature" in problems[0], problems


def test_a_sparse_oversized_data_file_is_refused(versions, tmp_path):
    root = _copy(versions, tmp_path)
    os.truncate(root / NEWEST / DATA, BOMB)
    _assert_restored(root, versions, 0)
    problems = DurableTier(str(root)).verify(1)
    assert problems and "size" in problems[0] or "bytes" in problems[0], problems


# === 4. allocation is bounded by what was recorded ================================================
def test_a_48_byte_metadata_cannot_allocate_a_gigabyte(versions, tmp_path):
    root = _copy(versions, tmp_path)
    (root / NEWEST / METADATA).write_bytes(_bytearray_bomb(BOMB))
    _reseal(root / NEWEST)  # no key: every checksum recomputed
    assert len((root / NEWEST / METADATA).read_bytes()) < 64
    bound = 2 * _version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        _assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "allocat" in problems[0], problems


def test_an_opaque_value_cannot_allocate_beyond_its_size(versions, tmp_path):
    """The ``extra`` item: ``torch.save`` of bytes that unpickle (through the value allow-list)
    to a huge bytearray."""
    root = _copy(versions, tmp_path)
    buf = io.BytesIO()
    torch.save(_bytearray_bomb(BOMB), buf)
    _forge_item(root / NEWEST, "rank_local.0.extra", buf.getvalue())
    _assert_bomb_refused(root, versions)


def test_a_non_tensor_item_cannot_allocate_in_torch_load(versions, tmp_path):
    """torch's own weights-only unpickler allows ``bytearray(n)`` too."""
    root = _copy(versions, tmp_path)
    src = io.BytesIO()
    torch.save({"x": 1}, src)
    with zipfile.ZipFile(io.BytesIO(src.getvalue())) as z, zipfile.ZipFile(out := io.BytesIO(), "w") as o:
        for info in z.infolist():
            data = z.read(info.filename)
            o.writestr(info.filename, _bytearray_bomb(BOMB, 2) if info.filename.endswith("data.pkl") else data)
    _forge_item(root / NEWEST, "rank_local.0.extra", out.getvalue())
    _assert_bomb_refused(root, versions)


def test_a_crafted_numpy_object_array_is_refused_not_a_crash(tmp_path):
    """numpy's own ``ndarray.__setstate__`` crashes the process on an object array whose list is
    short; the value allow-list refuses object dtypes (in a child process: on failure it dies)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import pickle, numpy as np\n"
        "from numpy._core.multiarray import _reconstruct\n"
        "from gemini_ckpt.errors import VerificationError\n"
        "from gemini_ckpt.trust.values import value_loads\n"
        "class C:\n"
        "    def __reduce__(self):\n"
        "        return (_reconstruct, (np.ndarray, (0,), b'b'), (1, (10**6,), np.dtype('O'), False, []))\n"
        "try:\n"
        "    value_loads(pickle.dumps(C()), 'rank_local.0.extra')\n"
        "except VerificationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    repo = str(Path(__file__).resolve().parents[2])  # this checkout's gemini_ckpt, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=DEADLINE_S, env=env)
    assert child.returncode == 0, f"the decoder died (status {child.returncode}): {child.stderr[-500:]}"
    assert "refused:" in child.stdout and "objects" in child.stdout, child.stdout


def test_a_deflated_tensor_item_is_refused_before_it_inflates(versions, tmp_path):
    root = _copy(versions, tmp_path)
    item = _deflated_tensor_item(BOMB // 4)
    assert len(item) < BOMB // 100
    _forge_item(root / NEWEST, "model.pos", item)
    bound = 2 * _version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        _assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "compressed" in " ".join(problems), problems


# === 5. init_from ==================================================================================
def _stock_checkpoint(path: Path, *, seed: int, with_optim: bool, fill=None):
    t = build_training(seed=seed, dataset_size=32)
    if fill is not None:
        with torch.no_grad():
            for p in t.model.parameters():
                p.fill_(fill)
    if with_optim:
        lm_loss(t.model, next(t.batches())).backward()
        t.optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(t.model, t.optimizer)
    dcp.save({"model": msd, "optim": osd} if with_optim else {"model": msd}, checkpoint_id=str(path))
    return _params(t.model)


def _init(path, **config):
    t, _, state = _state(11)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=_job_namespace(), init_from=str(path), timeout_s=30, **config)
    )
    try:
        return ckpt.restore(), t
    finally:
        ckpt.close()


def test_init_from_never_reads_outside_its_directory(tmp_path):
    stock, secret = tmp_path / "stock", tmp_path / "secret"
    _stock_checkpoint(stock, seed=1, with_optim=False)
    _stock_checkpoint(secret, seed=2, with_optim=False, fill=7.0)
    md = pickle.loads((stock / METADATA).read_bytes())  # the test's own file
    md.storage_data = {
        i: _StorageInfo(f"../secret/{s.relative_path}", s.offset, s.length) for i, s in md.storage_data.items()
    }
    (stock / METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside") as info:
        within(DEADLINE_S, _init, stock)
    assert "../secret/" in str(info.value)


@pytest.mark.parametrize("name", [DATA, METADATA])
def test_init_from_refuses_a_fifo_instead_of_hanging(tmp_path, fifos, name):
    stock = tmp_path / "stock"
    _stock_checkpoint(stock, seed=1, with_optim=False)
    (stock / name).unlink()
    os.mkfifo(stock / name)
    fifos.append(stock / name)
    with pytest.raises(CheckpointError, match="regular file"):
        within(DEADLINE_S, _init, stock)


def test_init_from_a_model_only_checkpoint_loads_the_model_and_leaves_the_optimizer(tmp_path, caplog):
    stock = tmp_path / "stock"
    saved = _stock_checkpoint(stock, seed=1, with_optim=False)
    with caplog.at_level(logging.INFO, logger="gemini_ckpt"):
        result, t = within(DEADLINE_S, _init, stock)
    assert result is not None and result.source == "init"
    for name, value in saved.items():
        assert torch.equal(_params(t.model)[name], value), name
    assert t.optimizer.state_dict()["state"] == {}
    assert "holds no optimizer state" in caplog.text


def test_init_from_a_damaged_checkpoint_raises_our_error_not_a_base_exception(tmp_path):
    stock = tmp_path / "stock"
    _stock_checkpoint(stock, seed=1, with_optim=True)
    data = stock / DATA
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    try:
        within(DEADLINE_S, _init, stock)
    except CheckpointError as exc:
        assert "init_from" in str(exc)
    except BaseException as exc:  # noqa: BLE001 - exactly what must not escape
        pytest.fail(f"init_from raised {type(exc).__module__}.{type(exc).__name__}, not a CheckpointError")
    else:
        pytest.fail("a damaged init_from checkpoint loaded")


# === 8. a torn marker never counts =================================================================
def test_a_persist_failing_at_the_marker_leaves_no_complete_version_and_retention_keeps_the_good_ones(tmp_path):
    fs, handler = faulty_filesystem(torn_on=MARKER)
    root = str(tmp_path / "d")
    durable = DurableTier(filesystem=fs, root=root, keep=2)
    t, extra, state = _state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local",
            namespace=_job_namespace(),
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
    t, extra, state = _state(0)
    ckpt = Checkpointer(
        state,
        CheckpointConfig(
            store="local",
            namespace=_job_namespace(),
            persist_every=3,
            durable_uri=str(root),
            keep_durable=5,
            persist_on_close=False,
        ),
    )
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
    bound = 2 * _version_bytes(versions[0]) + SLACK
    t0 = time.perf_counter()
    for where, kind, expected in cases:
        case = f"{kind} at {where}"
        root = _copy(versions, tmp_path)
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
                result, ckpt = within(DEADLINE_S, _continue, root, [2])
            finally:
                faults.set_hook(None)
        assert result is not None and result.step == expected, (case, result)
        assert mem.rise < bound, f"{case}: memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
        assert outside.read_bytes() == b"not yours\n", f"{case}: written outside the durable directory"
        # the older good version is what the next job gets (or the step persisted on top of it)
        final, extra, params = within(DEADLINE_S, _restore, root)
        assert final is not None and final.step in (expected, 2), (case, final)
        assert all(torch.equal(params[k], v) for k, v in versions[1][expected].items()), case
        if final.step == 2:
            assert DurableTier(str(root)).verify(2) == [], case
        shutil.rmtree(root)
    print(f"\nproperty: {len(cases)} plants in {time.perf_counter() - t0:.1f}s")
