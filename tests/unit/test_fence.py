"""The fence of a host store or rank process whose node is lost (gemini_ckpt.hoststore.fence), one step
at a time: a real process stands in for the raylet (killed with a real signal, left a zombie,
then reaped); the GCS's answers are a callable that answers, raises (unreachable) or hangs."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time


from gemini_ckpt.hoststore.fence import (
    ALIVE,
    ASK_EVERY_S,
    CUT_OFF,
    DEAD,
    LEASE_MARGIN_S,
    STALLED,
    TICK_S,
    Fence,
    declared_dead,
    head_answers,
    limit_s,
    process_identity,
    second_look,
)

LEASE = 20.0


class _Gcs:
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


def _fence(gcs, raylet_pid=None):
    return Fence("test", gcs, raylet_pid=raylet_pid, lease=LEASE, exit=lambda why: None)


def _steps(fence, n, *, elapsed=TICK_S, start=0.0):
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


def test_a_node_the_gcs_lists_dead_is_fenced_at_the_next_answer():
    gcs = _Gcs()
    fence = _fence(gcs)
    why, now = _steps(fence, 10)
    assert why is None and gcs.calls >= 3  # alive: asked every ASK_EVERY_S
    gcs.mode = "dead"
    why, _ = _steps(fence, 10, start=now)
    assert why == "the cluster declared this node dead"


def test_the_lease_runs_out_only_while_the_gcs_is_silent_and_the_process_runs():
    gcs = _Gcs()
    fence = _fence(gcs)
    _, now = _steps(fence, 5)
    gcs.mode = "unreachable"
    why, now = _steps(fence, int(LEASE / TICK_S) - 4, start=now)
    assert why is None and 0 < fence.silent_s <= LEASE
    gcs.mode = "alive"  # the link comes back: the next answer renews the lease
    _, now = _steps(fence, int(ASK_EVERY_S / TICK_S) + 1, start=now)
    assert fence.silent_s < ASK_EVERY_S
    # a process stopped (SIGSTOP) or starved for minutes spends at most two ticks of its lease per step
    gcs.mode = "unreachable"
    why, now = _steps(fence, 5, elapsed=120.0, start=now)
    assert why is None and fence.silent_s <= ASK_EVERY_S + 5 * 2 * TICK_S
    why, _ = _steps(fence, int(LEASE / TICK_S) + 1, start=now)
    assert why is not None and why.startswith("no answer from the GCS for 2") and "(the lease: 20s)" in why


def test_a_hung_question_does_not_stop_the_fence():
    gcs = _Gcs()
    gcs.mode = "hung"
    fence = _fence(gcs)
    try:
        why, _ = _steps(fence, int(LEASE / TICK_S) + 2)
        assert why is not None and why.startswith("no answer from the GCS")
        assert gcs.calls == 1  # one question at a time: the hung one is not asked again on top
    finally:
        gcs.release.set()


def test_a_raylet_that_exits_fences_its_workers_at_once_zombie_or_reaped():
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gcs = _Gcs()
        fence = _fence(gcs, raylet_pid=raylet.pid)
        assert fence.raylet_identity is not None and _steps(fence, 3)[0] is None
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
    fence = _fence(_Gcs(), raylet_pid=None)
    assert not fence.raylet_gone() and _steps(fence, 3)[0] is None


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
    gcs = _Gcs()
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


# --- issue 40, finding 5: a silent GCS whose machine answers is a stall, not a partition ----------------
def _listener_stopped():
    """A real process that listens on a TCP port and is then stopped (SIGSTOP), as a stalled GCS
    is: its kernel still completes new connections into the listen backlog."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(64)\n"
            "print(s.getsockname()[1], flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGSTOP)
    return child, f"127.0.0.1:{port}"


@contextlib.contextmanager
def _black_hole():
    """An address whose SYNs go unanswered, as a machine cut off sees the GCS's: a listener whose
    accept queue is full (Linux drops further SYNs; the sandbox's firewall answers outside
    addresses with a reset, so TEST-NET addresses would be "refused" here)."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port, fill = listener.getsockname()[1], []
        try:
            for _ in range(3):
                c = socket.socket()
                c.setblocking(False)
                fill.append(c)
                try:
                    c.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
            time.sleep(0.2)
            yield f"127.0.0.1:{port}"
        finally:
            for c in fill:
                c.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_new_connection_tells_a_stalled_or_restarting_gcs_from_a_machine_cut_off():
    child, address = _listener_stopped()
    try:
        assert head_answers(address) == "connected"  # stopped, yet the kernel answers
    finally:
        child.kill()
        child.wait(10)
    assert head_answers(f"127.0.0.1:{_free_port()}") == "refused"  # nothing listens: a GCS restarting
    with _black_hole() as address:
        t0 = time.monotonic()
        assert head_answers(address, timeout=0.5) is None  # no answer at all: cut off
        assert time.monotonic() - t0 < 5
    assert head_answers("not an address") is None


def test_past_the_lease_the_process_serves_on_while_the_gcs_is_stalled_until_rays_own_limit():
    """A GCS stopped (SIGSTOP) for longer than the lease: every node's question goes unanswered,
    and so does the second look's question, but its machine answers a new connection. The
    process serves on (on main it ended at the lease), looks again every ASK_EVERY_S, and the
    GCS's return renews the lease; a silence past Ray's own limit ends it even so."""
    child, address = _listener_stopped()
    try:
        gcs, looks = _Gcs(), []

        def reach():  # the real second look, but for the GCS client: a stopped one does not answer
            looks.append(STALLED if head_answers(address) == "connected" else CUT_OFF)
            return looks[-1]

        fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=reach, limit=60.0)
        gcs.mode = "unreachable"
        why, now = _steps(fence, int(LEASE / TICK_S) + 12)
        assert why is None and fence.serving_on and fence.silent_s > LEASE
        assert set(looks) == {STALLED} and 3 <= len(looks) <= 5  # every ASK_EVERY_S past the lease
        gcs.mode = "alive"  # SIGCONT: the next answer renews the lease
        why, now = _steps(fence, int(ASK_EVERY_S / TICK_S) + 1, start=now)
        assert why is None and not fence.serving_on and fence.silent_s < ASK_EVERY_S
        gcs.mode = "unreachable"
        why, _ = _steps(fence, 80, start=now)
        assert why is not None and "its machine answers, but Ray's own limit (60s) is past" in why
        assert 60 < fence.silent_s <= 62
    finally:
        child.kill()
        child.wait(10)


def test_past_the_lease_a_machine_that_does_not_answer_means_this_node_is_cut_off():
    gcs = _Gcs()
    gcs.mode = "unreachable"
    with _black_hole() as address:
        fence = Fence(
            "test",
            gcs,
            raylet_pid=None,
            lease=LEASE,
            exit=lambda why: None,
            reach=lambda: second_look(address, "00" * 28, "ab" * 28, timeout=0.3),
            limit=60.0,
        )
        why, _ = _steps(fence, int(LEASE / TICK_S) + 2)
    assert (
        why is not None
        and why.startswith("no answer from the GCS for 2")
        and why.endswith("and its machine does not answer a new connection either: this node is cut off")
    )


def test_past_the_lease_a_gcs_that_answers_a_new_connection_decides():
    """The link came back just as the lease ran out: the old connection still waits out its
    backoff, a new one is answered. Declared dead ends the process at once; alive renews."""
    gcs = _Gcs()
    gcs.mode = "unreachable"
    fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=lambda: DEAD, limit=60.0)
    why, _ = _steps(fence, int(LEASE / TICK_S) + 2)
    assert why is not None and why.endswith("asked on a new connection, the cluster declared this node dead")
    looks = [ALIVE]
    fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=looks.pop, limit=60.0)
    why, _ = _steps(fence, int(LEASE / TICK_S) + 2)
    assert why is None and not looks and fence.silent_s < 2 * TICK_S and not fence.serving_on


def test_a_stall_that_turns_into_a_partition_ends_the_process_at_the_next_look():
    """The GCS was stalled at first, then the link went down: the next look, ASK_EVERY_S later,
    ends the process."""
    gcs, looks = _Gcs(), [STALLED, STALLED, CUT_OFF]
    gcs.mode = "unreachable"
    fence = Fence(
        "test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=lambda: looks.pop(0), limit=600.0
    )
    why, now = _steps(fence, int(LEASE / TICK_S) + 3 * int(ASK_EVERY_S / TICK_S) + 2)
    assert why is not None and why.endswith("this node is cut off") and not looks


def test_limit_is_rays_reconnect_timeout_or_the_lease_plus_the_margin(monkeypatch):
    monkeypatch.delenv("RAY_gcs_rpc_server_reconnect_timeout_s", raising=False)
    assert limit_s(22.0) == 60.0 + LEASE_MARGIN_S
    assert limit_s(77.0) == 77.0 + LEASE_MARGIN_S
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "120")
    assert limit_s(22.0) == 120.0 + LEASE_MARGIN_S
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "soon")
    assert limit_s(22.0) == 60.0 + LEASE_MARGIN_S


def test_ray_still_has_the_one_node_question_the_fence_asks():
    """The fence asks the GCS about its own node (``GcsClient.check_alive``); if a Ray drops it,
    the fence falls back to the whole node table with a warning, and this test says so first."""
    import ray
    from ray._raylet import GcsClient, InnerGcsClient, NodeID

    assert "__getattr__" in vars(GcsClient)  # GcsClient hands what it lacks to its InnerGcsClient
    assert "check_alive(self, list node_ids: List[NodeID]" in InnerGcsClient.check_alive.__doc__
    assert (
        "standalone(unicode gcs_address: str, cluster_id: Optional[str], int timeout_ms"
        in InnerGcsClient.standalone.__doc__
    )  # the second look's new client
    assert "address" in vars(InnerGcsClient)
    assert "worker.gcs_client = " in inspect.getsource(ray._private.worker.connect)
    assert NodeID.from_hex("ab" * 28).hex() == "ab" * 28


def test_a_slow_second_look_does_not_keep_the_fence_from_watching_the_raylet():
    """The second look takes seconds (a connect, then a question with its own deadline); it runs
    on its own thread, so a raylet that exits meanwhile still ends the process at the next tick."""
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    release = threading.Event()
    try:
        gcs = _Gcs()
        gcs.mode = "unreachable"

        def slow_look():
            release.wait(30)
            return STALLED

        fence = Fence(
            "test", gcs, raylet_pid=raylet.pid, lease=LEASE, exit=lambda why: None, reach=slow_look, limit=60.0
        )
        now = 0.0
        for _ in range(int(LEASE / TICK_S) + 1):  # past the lease: the look begins, and hangs
            now += TICK_S
            assert fence.step(now, TICK_S) is None
        assert not fence.idle()
        raylet.kill()
        raylet.wait(10)
        assert fence.step(now + TICK_S, TICK_S) == f"its raylet (pid {raylet.pid}) is gone"
    finally:
        release.set()
        raylet.kill()
        raylet.wait(10)
