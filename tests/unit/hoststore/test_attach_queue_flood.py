"""A trainer's attach while other local processes connect to the store's socket in a tight loop
(the flood of ``tests/integration/hoststore/test_ray_attach_flood.py``, without Ray): the
trainer waits in the kernel for room in the accept queue, so a slot the store frees goes to it
and not to whichever flooder tries next. With tries of non-blocking connects and sleeps between
them (the code before), two flooders kept a trainer out for 20 s in two tries of four here.
And a signal that interrupts that wait does not leave the trainer with an unconnected socket."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from attach_flood_support import draining, full_queue, kill_flooders, start_flooders, stop_flooders
from gemini_ckpt.hoststore.attach_client import connect_until

FLOODERS = 2
TRIES = 3


def test_a_trainer_gets_into_an_attach_queue_that_local_processes_flood():
    name = f"gemini-ckpt-test-flood-{os.getpid()}-{time.monotonic_ns()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    stop = threading.Event()

    def accept():  # the store's accept thread: a thread per connection, until it proves itself or times out
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: (time.sleep(0.5), c.close()), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    flooders = start_flooders(name, 60, FLOODERS, held=64)
    try:
        time.sleep(0.5)  # the queue full
        took = []
        for _ in range(TRIES):
            t0 = time.monotonic()
            sock = connect_until("\0" + name, t0 + 20)
            took.append(time.monotonic() - t0)
            sock.close()
        stop_flooders(flooders)
        assert max(took) < 5, f"the trainer waited {[round(t, 2) for t in took]} s to get in"
    finally:
        stop.set()
        listener.close()
        kill_flooders(flooders)


def test_a_signal_during_the_wait_for_room_is_not_taken_for_a_connection():
    """CPython takes a connect that a signal interrupted for one in progress (as on TCP) and
    returns a socket that is not connected; the trainer tries again and gets a real one."""
    address = f"\0gemini-ckpt-test-eintr-{os.getpid()}-{time.monotonic_ns()}"
    listener, held = full_queue(address, backlog=0)
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    accepted = []
    try:
        with draining(listener, 0.6) as accepted:
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # while the connect waits for room
            sock = connect_until(address, time.monotonic() + 10)
        assert sock.getpeername() == address.encode()
        sock.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for s in held + accepted:
            s.close()
        listener.close()
