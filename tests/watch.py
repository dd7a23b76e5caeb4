"""What the test session does when something goes wrong on a busy machine: say which test is
running (``GEMINI_CKPT_TEST_PROGRESS=1``, set by ``.ci/run``), print what Ray is waiting for
when a test runs long (the watchdog, before pytest-timeout stops it), and list the cluster
incidents (hosts that died without a test removing them) at the end of the session.

``describe`` is set by the integration tier's cluster fixture: a function that returns the
cluster's state as text (:meth:`gemini_ckpt.testing.cluster.LocalCluster.describe`).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Optional

describe: Optional[Callable[[], str]] = None
incidents: list[str] = []
capture = None  # pytest's capture manager (set by tests/conftest.py): what we say bypasses it
WATCHDOG_FRACTION = 0.75  # of the test's timeout: the watchdog speaks first, pytest-timeout acts later


def progress_enabled() -> bool:
    return os.environ.get("GEMINI_CKPT_TEST_PROGRESS", "") not in ("", "0")


def say(line: str, *, stacks: bool = False) -> None:
    """A time-stamped line on the terminal, past pytest's output capture (so a CI log shows it
    even when the test never ends); with ``stacks``, every thread's stack after it."""
    with _uncaptured():
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {line}\n")
        sys.stderr.flush()
        if stacks:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _uncaptured():
    import contextlib

    if capture is None:
        return contextlib.nullcontext()
    return capture.global_and_fixture_disabled()


def cluster_state() -> str:
    if describe is None:
        return "no Ray cluster in this session"
    try:
        return describe()
    except Exception as exc:  # noqa: BLE001 - diagnosing must not fail the test
        return f"cluster state unavailable: {type(exc).__name__}: {exc}"


class Watchdog:
    """Prints the cluster's state and every thread's stack once a test has run ``after`` seconds."""

    def __init__(self, nodeid: str, after: float) -> None:
        self.nodeid, self.after = nodeid, after
        self._timer = threading.Timer(after, self._bark)
        self._timer.daemon = True

    def __enter__(self) -> "Watchdog":
        if self.after > 0:
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def _bark(self) -> None:
        say(
            f"WATCHDOG: {self.nodeid} has run {self.after:.0f}s; what Ray has:\n"
            + _indent(cluster_state())
            + "\nWATCHDOG: the stacks of every thread of the test process:",
            stacks=True,
        )


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
