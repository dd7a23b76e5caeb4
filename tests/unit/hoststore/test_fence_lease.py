"""The fence of a host store or rank process whose node is lost (gemini_ckpt.hoststore.fence), one step
at a time, up to the end of its lease: a node the GCS declares dead, a lease that runs out only while the
GCS is silent (its length: Ray's time to declare a node dead plus a margin), a hung question, a step that
fails, and a raylet that exits (a real process, killed with a real signal, left a zombie, then reaped);
the GCS's answers are a callable that answers, raises (unreachable) or hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from fence_support import LEASE, FakeGcs, run_steps
from gemini_ckpt.hoststore.fence import (
    ASK_EVERY_S,
    LEASE_MARGIN_S,
    TICK_S,
    Fence,
    declared_dead,
    process_identity,
)


def _fence(gcs, raylet_pid=None):
    return Fence("test", gcs, raylet_pid=raylet_pid, lease=LEASE, exit=lambda why: None)


def test_a_node_the_gcs_lists_dead_is_fenced_at_the_next_answer():
    gcs = FakeGcs()
    fence = _fence(gcs)
    why, now = run_steps(fence, 10)
    assert why is None and gcs.calls >= 3  # alive: asked every ASK_EVERY_S
    gcs.mode = "dead"
    why, _ = run_steps(fence, 10, start=now)
    assert why == "the cluster declared this node dead"


def test_the_lease_runs_out_only_while_the_gcs_is_silent_and_the_process_runs():
    gcs = FakeGcs()
    fence = _fence(gcs)
    _, now = run_steps(fence, 5)
    gcs.mode = "unreachable"
    why, now = run_steps(fence, int(LEASE / TICK_S) - 4, start=now)
    assert why is None and 0 < fence.silent_s <= LEASE
    gcs.mode = "alive"  # the link comes back: the next answer renews the lease
    _, now = run_steps(fence, int(ASK_EVERY_S / TICK_S) + 1, start=now)
    assert fence.silent_s < ASK_EVERY_S
    # a process stopped (SIGSTOP) or starved for minutes spends at most two ticks of its lease per step
    gcs.mode = "unreachable"
    why, now = run_steps(fence, 5, elapsed=120.0, start=now)
    assert why is None and fence.silent_s <= ASK_EVERY_S + 5 * 2 * TICK_S
    why, _ = run_steps(fence, int(LEASE / TICK_S) + 1, start=now)
    assert why is not None and why.startswith("no answer from the GCS for 2") and "(the lease: 20s)" in why


def test_a_hung_question_does_not_stop_the_fence():
    gcs = FakeGcs()
    gcs.mode = "hung"
    fence = _fence(gcs)
    try:
        why, _ = run_steps(fence, int(LEASE / TICK_S) + 2)
        assert why is not None and why.startswith("no answer from the GCS")
        assert gcs.calls == 1  # one question at a time: the hung one is not asked again on top
    finally:
        gcs.release.set()


def test_a_raylet_that_exits_fences_its_workers_at_once_zombie_or_reaped():
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gcs = FakeGcs()
        fence = _fence(gcs, raylet_pid=raylet.pid)
        assert fence.raylet_identity is not None and run_steps(fence, 3)[0] is None
        raylet.kill()
        deadline = time.monotonic() + 10
        while process_identity(raylet.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # not reaped yet: a zombie still has a pid, and it counts as gone
        assert process_identity(raylet.pid) is None
        assert fence.step(100.0, TICK_S) == f"its raylet (pid {raylet.pid}) is gone"
        raylet.wait(10)  # reaped: the pid is free
        assert fence.step(101.0, TICK_S) == f"its raylet (pid {raylet.pid}) is gone"
    finally:
        raylet.kill()
        raylet.wait(10)


def test_without_a_raylet_pid_only_the_gcs_decides():
    fence = _fence(FakeGcs(), raylet_pid=None)
    assert not fence.raylet_gone() and run_steps(fence, 3)[0] is None


def _lease_in_a_process(env):
    out = subprocess.run(
        [sys.executable, "-c", "from gemini_ckpt.hoststore.fence import lease_s; print(lease_s())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_the_lease_is_the_time_ray_takes_to_declare_a_node_dead_plus_a_margin():
    fast = {
        "RAY_health_check_initial_delay_ms": "0",
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "2000",
        "RAY_health_check_failure_threshold": "6",
    }  # LocalCluster's
    assert LEASE_MARGIN_S == 7.0
    assert _lease_in_a_process(fast) == 0 + 6 * (0.5 + 2.0) + 7.0
    # Ray's defaults: 5 s + 5 x (3 s + 10 s), longer than Ray lets a worker go without the GCS (60 s)
    assert _lease_in_a_process({}) == 5.0 + 5 * (3.0 + 10.0) + 7.0


def test_a_node_missing_from_a_nonempty_table_is_dead_and_an_empty_answer_says_nothing():
    table = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": False}]
    assert not declared_dead(table, "a")
    assert declared_dead(table, "b")
    assert declared_dead(table, "c")  # dropped from the GCS's table of dead nodes
    assert not declared_dead([], "a")


def test_a_check_that_fails_does_not_end_the_fence_and_the_lease_still_ends_the_process():
    """The thread survives an error in a step (no thread to spare for the question, say) and
    still ends the process when the lease runs out; ``run`` is the real loop, on a short lease."""
    ended = []
    gcs = FakeGcs()
    gcs.mode = "unreachable"
    fence = Fence("test", gcs, raylet_pid=None, lease=2.0, exit=ended.append)
    real_step, failures = fence.step, []

    def step(now, elapsed):
        if not failures:
            failures.append(now)
            raise RuntimeError("can't start new thread")
        return real_step(now, elapsed)

    fence.step = step
    thread = threading.Thread(target=fence.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and failures
    assert (
        len(ended) == 1 and ended[0].startswith("no answer from the GCS for ") and ended[0].endswith("(the lease: 2s)")
    )


def test_a_worker_whose_raylet_is_killed_knows_it_at_the_next_check(tmp_path):
    """A real raylet stand-in (a parent process) with a real worker (its child, running the
    fence's check against its parent, as a Ray worker's parent is its raylet): the parent is
    killed with SIGKILL, and the orphaned child sees its raylet gone."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        "from gemini_ckpt.hoststore.fence import Fence\n"
        "f = Fence('child', lambda: False, raylet_pid=os.getppid(), lease=1e9, exit=print)\n"
        "assert f.child_of_raylet and not f.raylet_gone()\n"
        "print('ready', flush=True)\n"
        "deadline = time.monotonic() + 20\n"
        "while not f.raylet_gone() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('gone' if f.raylet_gone() else 'alive', flush=True)\n"
    )
    out = tmp_path / "out"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(script)!r}], "
            f"stdout=open({str(out)!r}, 'w')); time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while "ready" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "ready" in out.read_text()
        parent.kill()
        parent.wait(10)
        while "\n" not in out.read_text().split("ready", 1)[1][1:] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text().split() == ["ready", "gone"]
    finally:
        parent.kill()
        parent.wait(10)
