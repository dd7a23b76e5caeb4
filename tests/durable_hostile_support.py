"""Shared by the ``test_durable_hostile_*`` files: a writer of the durable directory (or of an
``init_from`` directory) is hostile.

The versions those tests plant things in, the jobs that restore and persist them (:data:`JOBS`,
:func:`continue_job`; the deadline every operation that could hang runs under is
:func:`toy_jobs.within`), the process's memory peak (:class:`PeakMemory`), and the fixtures ``versions``, ``outside`` and ``fifos`` (a test file
takes the ones it uses with ``from durable_hostile_support import versions as versions``).
"""

from __future__ import annotations

import os
import stat
import threading
import time
import warnings
from pathlib import Path

import pytest

from toy_jobs import ToyJobs

MARKER, METADATA, IN_PROGRESS, DATA = ".gemini_complete", ".metadata", ".gemini_inprogress", "__0_0.distcp"
NEWEST, OLDER = "step_000000001", "step_000000000"
DEADLINE_S = 60.0  # far above what any of these takes; only a hang gets there
MiB = 1 << 20
BOMB = 384 * MiB  # what a planted file claims or inflates to: far above the bound on any version here
SLACK = 96 * MiB  # the process's own noise (imports, allocator) on top of 2x the version
# This module's jobs: no data loader in their state; a restore runs under the deadline, with a timeout
JOBS = ToyJobs("hostile-", deadline_s=DEADLINE_S, timeout_s=30)


# --- running hostile operations -------------------------------------------------------------------
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
@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A durable directory with good steps 0 and 1, and the model at each."""
    return JOBS.make_versions(tmp_path_factory.mktemp("hostile") / "d")


def version_bytes(root: Path, step_dir: str = NEWEST) -> int:
    """The bytes of the regular files of version ``step_dir`` under ``root``."""
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


def continue_job(root, steps, **config):
    """A new job restores from ``root`` and saves (and persists) ``steps``: (its restore's result, its Checkpointer)."""
    t, extra, state = JOBS.state(9)
    ckpt = JOBS.checkpointer(state, root, persist_every=1, keep_durable=5, timeout_s=30, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = ckpt.restore()
        for step in steps:
            extra["tokens"] = step + 1
            ckpt.save(step)
        ckpt.close()
    return result, ckpt
