"""What the data-plane transport tests share (test_transport_streams.py, test_transport_peers.py,
test_transport_interface.py): a sink that records what it is told, and a transport of the
standalone package (see standalone_transport.py) with a generous progress timeout."""

from __future__ import annotations

import threading
import time

import numpy as np

from standalone_transport import NS, SECRET, load_standalone

T = load_standalone()


class RecordingSink:
    """Receives into one numpy buffer (a transfer lands at its header's offset)."""

    def __init__(self, nbytes: int = 0, refuse: Exception | None = None, conn=None) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.refuse = refuse
        self.conn = conn
        self.asked: list = []
        self.events: list = []
        self.cond = threading.Condition()

    def buffer_for(self, header):
        self.asked.append(header)
        if self.conn is not None:
            self.conn.send("started")
        if self.refuse is not None:
            raise self.refuse
        return memoryview(self.buffer)[header.offset : header.offset + header.length]

    def received(self, header) -> None:
        self._event(("received", header, time.monotonic()))

    def failed(self, header, error) -> None:
        self._event(("failed", header, error, time.monotonic()))

    def _event(self, event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait(self, count: int = 1, timeout: float = 10) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= count, timeout), self.events
            return list(self.events)


def make_transport(secret: bytes = SECRET, name: str = "", **config) -> "T.TcpTransport":
    """A transport of the standalone package in the tests' namespace, ``config`` its TcpConfig's settings."""
    config.setdefault("progress_timeout_s", 5.0)  # generous unless a test is about the timeout
    return T.TcpTransport(secret, NS, host_name=name, config=T.TcpConfig(**config))
