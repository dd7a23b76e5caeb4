"""Shared by both tiers: the support modules in ``tests/`` are importable (``helpers``,
``tier_contract``, ``rendezvous``, ``dir_tier``, ``ray_helpers``), Ray runs without
auth or usage stats, and the toy models come from :mod:`gemini_ckpt.toy`.

- ``tests/unit``: no Ray; each file runs in seconds.
- ``tests/integration``: one Ray cluster of simulated hosts for the whole session
  (``ray_cluster``, see ``tests/integration/conftest.py``).
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture
def namespace() -> str:
    """A namespace of this test's own (versions of two tests never meet)."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def toy_training():
    """The demo's tiny LM training setup (model, AdamW, warmup+cosine, a StatefulDataLoader), seed 0."""
    from gemini_ckpt.toy import build_training

    return build_training(seed=0, dataset_size=32)


# --- a session that says what it is doing (see tests/watch.py) -----------------------------------
def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:
        return 0.0


def pytest_configure(config):
    import watch

    watch.capture = config.pluginmanager.getplugin("capturemanager")


def pytest_collection_finish(session):
    """Two costs of the garbage collector in one long-lived process:

    - The ~700k objects the imports leave (torch, Ray, Lightning, transformers) live for the
      session; every full collection walked them again (14 s of the durable tier's property test).
      Frozen, they are left out of collections.
    - A data loader's worker iterator that dies in a reference cycle (HF's and Lightning's
      trainers make such cycles) is shut down by whichever test's allocation triggers the
      collection: its queues' feeder threads are finalized first, so its workers never get the
      word and each is waited for ``MP_STATUS_CHECK_INTERVAL`` (5 s) before it is terminated
      (20 s inside an unrelated test). Tests wait half a second instead.
    """
    import gc

    from torch.utils.data import _utils as loader_utils

    loader_utils.MP_STATUS_CHECK_INTERVAL = 0.5
    gc.collect()
    gc.freeze()


def pytest_runtest_logstart(nodeid, location):
    import watch

    if watch.progress_enabled():
        watch.say(f"START {nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Before pytest-timeout stops a test that hangs (in its fixtures too), print what Ray is
    waiting for and where every thread is."""
    import watch

    with watch.Watchdog(item.nodeid, watch.WATCHDOG_FRACTION * _timeout_of(item)):
        yield


def pytest_terminal_summary(terminalreporter):
    import watch

    if watch.incidents:
        terminalreporter.section("cluster incidents (hosts that died without a test removing them)")
        for line in watch.incidents:
            terminalreporter.write_line(line)
