"""Flooding a unix socket's accept queue, as another local process's connect loop does: for the
attach tests (``tests/unit/hoststore/test_attach_queue_flood.py``,
``tests/unit/hoststore/test_attach_hostile.py``, ``tests/integration/hoststore/test_ray_attach_flood.py``)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager

FLOODER = r"""
import socket, sys, time
address = "\0" + sys.argv[1]
most = int(sys.argv[3])
held, tries, full, end = [], 0, False, time.monotonic() + float(sys.argv[2])
try:
    print("flooding", flush=True)
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        tries += 1
        try:
            s.connect(address)
            held.append(s)
        except BlockingIOError:  # EAGAIN: the listen queue is full, as a trainer's try would find it
            s.close()
            full = True
        except OSError:
            s.close()
        if len(held) > most:
            held.pop(0).close()
except KeyboardInterrupt:  # the test is done with the flood (SIGINT): say what it saw
    pass
print(tries, "full" if full else "never-full", flush=True)
"""
"""A process that connects to the abstract unix socket ``argv[1]`` (no leading NUL) in a tight
loop for ``argv[2]`` seconds, holding at most ``argv[3]`` of the connections it got."""


def start_flooders(name: str, seconds: float, count: int, *, held: int) -> list[subprocess.Popen]:
    """``count`` :data:`FLOODER` processes on the abstract socket ``name``, each flooding once
    this returns."""
    flooders = [
        subprocess.Popen(
            [sys.executable, "-c", FLOODER, name, str(seconds), str(held)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    try:
        for f in flooders:
            assert f.stdout.readline().strip() == "flooding"
    except BaseException:
        kill_flooders(flooders)
        raise
    return flooders


def stop_flooders(flooders: list[subprocess.Popen]) -> None:
    """Stop the flood and check that it flooded: some flooder found the queue full. What each saw
    comes from its last line (a select on the buffered pipe missed a "full" that had arrived with
    "flooding" in one read: CI, stop 50)."""
    for f in flooders:
        f.send_signal(signal.SIGINT)
    seen = [f.communicate(timeout=30)[0].split() for f in flooders]
    assert any(s[-1:] == ["full"] for s in seen), f"no flooder ever found the queue full: nothing was flooded: {seen}"


def kill_flooders(flooders: list[subprocess.Popen]) -> None:
    for f in flooders:
        f.kill()
        f.wait(10)


def full_queue(address: str, backlog: int = 1) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on ``address`` whose accept queue is full, as a flood of connects leaves it
    (the listener, and the queued connections to close)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(backlog)
    fillers = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(address)
        except BlockingIOError:
            s.close()
            return listener, fillers
        fillers.append(s)


@contextmanager
def draining(listener: socket.socket, after_s: float):
    """Accept connections on ``listener`` from ``after_s`` seconds on, on a thread, until the
    block ends (yields the list they go to; closing them is the caller's). The thread has its own
    reference to the listener and is joined before the block ends: one that read the listener
    from the test's variable went on accepting from the next listener the test put there (a
    fresh-clone CI run on 2026-12-07: a queue "nobody drains" drained, and a connect that should
    have timed out got in)."""
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def run() -> None:
        if stop.wait(after_s):
            return
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=run, name="test-drain", daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the draining thread did not stop"
