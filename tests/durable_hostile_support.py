"""Shared by the ``test_durable_hostile_*`` files: a writer of the durable directory (or of an
``init_from`` directory) is hostile (issue 22).

The versions those tests plant things in, the jobs that restore and persist them, the deadline
every operation that could hang runs under (:func:`within`), the process's memory peak
(:class:`PeakMemory`), and the fixtures ``versions``, ``outside`` and ``fifos`` (a test file
takes the ones it uses with ``from durable_hostile_support import versions as versions``).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss
from gemini_ckpt.stores.memory import drop_local_store

NAMESPACE = "hostile-" + uuid.uuid4().hex


def _job_namespace() -> str:
    """This module's jobs share one namespace (a signed version is bound to it), each starting
    with empty memory, as a restarted job does."""
    drop_local_store(NAMESPACE)
    return NAMESPACE


MARKER, METADATA, IN_PROGRESS, DATA = ".gemini_complete", ".metadata", ".gemini_inprogress", "__0_0.distcp"
NEWEST, OLDER = "step_000000001", "step_000000000"
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
