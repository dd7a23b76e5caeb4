"""Ray's notices about processes we kill on purpose (the demo, the chaos harness).

When a node or worker dies, Ray prints the dead raylet's log tail and "a worker died"
errors to the driver, even with ``log_to_driver=False``. Where the death is the point, that
is noise that buries the report; :func:`expected_deaths_hidden` replaces each kind of notice
by one short line, once.
"""

from __future__ import annotations

import contextlib
import sys

# (marker in Ray's text, what to say instead)
KILLED_HOST = (
    ("Raylet is terminated", "(ray) a killed host's raylet is gone, as intended"),
    ("has been marked dead because the detector has missed too many heartbeats", "(ray) a killed host is marked dead"),
)
KILLED_PROCESS = KILLED_HOST + (
    ("A worker died or was killed while executing a task", "(ray) a killed worker's task failed, as intended"),
    ("[state-dump]", "(ray) a dead raylet's state dump (hidden)"),
)


@contextlib.contextmanager
def expected_deaths_hidden(expected=KILLED_HOST):
    """Within the block, stdout/stderr writes that contain a marker of ``expected`` are
    replaced by its note (each note printed once)."""
    streams = sys.stdout, sys.stderr
    said: set[str] = set()
    sys.stdout, sys.stderr = _Filter(sys.stdout, expected, said), _Filter(sys.stderr, expected, said)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams


class _Filter:
    def __init__(self, stream, expected, said: set[str]) -> None:
        self._stream = stream
        self._expected = expected
        self._said = said
        self._swallow_newline = False

    def write(self, text: str) -> int:
        for marker, note in self._expected:
            if marker in text:
                self._swallow_newline = True
                if note in self._said:
                    return len(text)
                self._said.add(note)
                self._stream.write(note + "\n")
                return len(text)
        if self._swallow_newline and text == "\n":
            self._swallow_newline = False
            return 1
        self._swallow_newline = False
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
