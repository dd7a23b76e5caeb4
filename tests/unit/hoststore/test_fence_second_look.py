"""The fence (gemini_ckpt.hoststore.fence) past its lease: a second look on a
new connection tells a stalled or restarting GCS, whose machine answers, from a machine cut off;
the process serves on through a stall up to Ray's own limit, and a slow second look does not keep
the fence from watching the raylet. Also: Ray still has the one-node question the fence asks."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time

from fence_support import LEASE, FakeGcs, run_steps
from gemini_ckpt.hoststore.fence import (
    ALIVE,
    ASK_EVERY_S,
    CUT_OFF,
    DEAD,
    LEASE_MARGIN_S,
    STALLED,
    TICK_S,
    Fence,
    head_answers,
    limit_s,
    second_look,
)


# --- a silent GCS whose machine answers is a stall, not a partition ----------------
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
        gcs, looks = FakeGcs(), []

        def reach():  # the real second look, but for the GCS client: a stopped one does not answer
            looks.append(STALLED if head_answers(address) == "connected" else CUT_OFF)
            return looks[-1]

        fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=reach, limit=60.0)
        gcs.mode = "unreachable"
        why, now = run_steps(fence, int(LEASE / TICK_S) + 12)
        assert why is None and fence.serving_on and fence.silent_s > LEASE
        assert set(looks) == {STALLED} and 3 <= len(looks) <= 5  # every ASK_EVERY_S past the lease
        gcs.mode = "alive"  # SIGCONT: the next answer renews the lease
        why, now = run_steps(fence, int(ASK_EVERY_S / TICK_S) + 1, start=now)
        assert why is None and not fence.serving_on and fence.silent_s < ASK_EVERY_S
        gcs.mode = "unreachable"
        why, _ = run_steps(fence, 80, start=now)
        assert why is not None and "its machine answers, but Ray's own limit (60s) is past" in why
        assert 60 < fence.silent_s <= 62
    finally:
        child.kill()
        child.wait(10)


def test_past_the_lease_a_machine_that_does_not_answer_means_this_node_is_cut_off():
    gcs = FakeGcs()
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
        why, _ = run_steps(fence, int(LEASE / TICK_S) + 2)
    assert (
        why is not None
        and why.startswith("no answer from the GCS for 2")
        and why.endswith("and its machine does not answer a new connection either: this node is cut off")
    )


def test_past_the_lease_a_gcs_that_answers_a_new_connection_decides():
    """The link came back just as the lease ran out: the old connection still waits out its
    backoff, a new one is answered. Declared dead ends the process at once; alive renews."""
    gcs = FakeGcs()
    gcs.mode = "unreachable"
    fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=lambda: DEAD, limit=60.0)
    why, _ = run_steps(fence, int(LEASE / TICK_S) + 2)
    assert why is not None and why.endswith("asked on a new connection, the cluster declared this node dead")
    looks = [ALIVE]
    fence = Fence("test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=looks.pop, limit=60.0)
    why, _ = run_steps(fence, int(LEASE / TICK_S) + 2)
    assert why is None and not looks and fence.silent_s < 2 * TICK_S and not fence.serving_on


def test_a_stall_that_turns_into_a_partition_ends_the_process_at_the_next_look():
    """The GCS was stalled at first, then the link went down: the next look, ASK_EVERY_S later,
    ends the process."""
    gcs, looks = FakeGcs(), [STALLED, STALLED, CUT_OFF]
    gcs.mode = "unreachable"
    fence = Fence(
        "test", gcs, raylet_pid=None, lease=LEASE, exit=lambda why: None, reach=lambda: looks.pop(0), limit=600.0
    )
    why, now = run_steps(fence, int(LEASE / TICK_S) + 3 * int(ASK_EVERY_S / TICK_S) + 2)
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
        gcs = FakeGcs()
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
