"""What the fence tests share (test_fence_lease.py, test_fence_second_look.py): the lease they
use, the GCS as the fence's ``ask`` sees it, and a driver that runs the fence step by step."""

from __future__ import annotations

import threading
import time

from gemini_ckpt.hoststore.fence import TICK_S

LEASE = 20.0


class FakeGcs:
    """The GCS as the fence's ``ask`` sees it: ``alive``, ``dead``, ``unreachable`` or ``hung``."""

    def __init__(self) -> None:
        self.mode, self.calls, self.release = "alive", 0, threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        if self.mode == "hung":
            self.release.wait(30)
        if self.mode in ("unreachable", "hung"):
            raise ConnectionError("the GCS cannot be reached")
        return self.mode == "dead"


def run_steps(fence, n, *, elapsed=TICK_S, start=0.0):
    """Run ``n`` steps ``elapsed`` apart (letting each asking thread answer); the first reason."""
    gcs, now = fence.ask, start
    for _ in range(n):
        now += elapsed
        why = fence.step(now, elapsed)
        if why is not None:
            return why, now
        deadline = time.monotonic() + 10
        while not fence.idle() and gcs.mode != "hung" and time.monotonic() < deadline:
            time.sleep(0.005)  # the asking thread answers
    return None, now
