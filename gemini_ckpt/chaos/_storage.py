"""Durable storage that fails on demand: a real local directory behind ``pyarrow.fs.PyFileSystem``,
failing or stalling the way storage does. The chaos harness and the test suite use this one.

Switches (each a ``threading.Event``, flipped from any thread):

- ``failing``: every write, rename, copy or mkdir raises ``OSError`` (a full disk, a bucket that
  refuses uploads); reads and deletes work;
- ``failing_deletes``: deleting a file or directory that exists raises (a bucket policy without delete);
- ``unreachable``: every operation raises, reads included (the network to the bucket is down);
- ``tearing``: a write to a file whose name contains ``torn_on`` lands half its bytes, then fails
  with ``ENOSPC`` (a disk filling up in the middle of a file).

And ``stall_on``: a write to a path containing it blocks (a hung upload), so a test can kill the
writer mid-persist. The harness sets a whole mode at step boundaries (:meth:`FaultyFsHandler.set_mode`:
``"ok"``, ``"fail_writes"`` (failing, deletes included) or ``"unreachable"``), so which versions
fail is deterministic.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs

MODES = ("ok", "fail_writes", "unreachable")


class FaultyFsHandler(pafs.FileSystemHandler):
    def __init__(self, *, stall_on: Optional[str] = None, torn_on: Optional[str] = None) -> None:
        self.base = pafs.LocalFileSystem()
        self.failing = threading.Event()
        self.failing_deletes = threading.Event()
        self.unreachable = threading.Event()
        self.tearing = threading.Event()
        self.stall_on = stall_on
        self.torn_on = torn_on
        self.writes = 0  # writes let through
        self.refused = 0  # operations refused by a switch

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"storage mode {mode!r}; use one of {MODES}")
        for event, on in (
            (self.failing, mode == "fail_writes"),
            (self.failing_deletes, mode == "fail_writes"),
            (self.unreachable, mode == "unreachable"),
        ):
            event.set() if on else event.clear()

    def _check_read(self, path) -> None:
        if self.unreachable.is_set():
            self.refused += 1
            raise OSError(f"injected: storage unreachable ({path})")

    def _check_write(self, what: str, path: str) -> None:
        self._check_read(path)
        if self.failing.is_set():
            self.refused += 1
            raise OSError(f"injected storage failure {what} {path}")
        if self.stall_on and self.stall_on in path:
            time.sleep(3600)
        self.writes += 1

    def _check_delete(self, path) -> None:
        self._check_read(path)
        if self.failing_deletes.is_set() and self.base.get_file_info(path).type != pafs.FileType.NotFound:
            self.refused += 1
            raise OSError(f"injected: deleting {path} is not allowed")

    # --- writes ---------------------------------------------------------------------------------
    def open_output_stream(self, path, metadata):
        self._check_write("writing", path)
        stream = self.base.open_output_stream(path)
        if self.torn_on and self.tearing.is_set() and self.torn_on in path.rsplit("/", 1)[-1]:
            return pa.PythonFile(_Torn(stream), mode="w")
        return stream

    def open_append_stream(self, path, metadata):
        self._check_write("appending to", path)
        return self.base.open_append_stream(path)

    def create_dir(self, path, recursive):
        self._check_read(path)
        if self.failing.is_set():
            self.refused += 1
            raise OSError(f"injected storage failure creating {path}")
        self.base.create_dir(path, recursive=recursive)

    def move(self, src, dest):
        self._check_write("renaming to", dest)
        self.base.move(src, dest)

    def copy_file(self, src, dest):
        self._check_write("copying to", dest)
        self.base.copy_file(src, dest)

    def delete_dir(self, path):
        self._check_delete(path)
        self.base.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._check_delete(path)
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root")

    def delete_file(self, path):
        self._check_delete(path)
        self.base.delete_file(path)

    # --- reads: the real thing unless unreachable -----------------------------------------------
    def get_type_name(self):
        return "faulty-local"

    def equals(self, other):
        return self is other

    def normalize_path(self, path):
        return self.base.normalize_path(path)

    def get_file_info(self, paths):
        self._check_read(paths)
        return self.base.get_file_info(paths)

    def get_file_info_selector(self, selector):
        self._check_read(selector.base_dir)
        return self.base.get_file_info(selector)

    def open_input_stream(self, path):
        self._check_read(path)
        return self.base.open_input_stream(path)

    def open_input_file(self, path):
        self._check_read(path)
        return self.base.open_input_file(path)


class _Torn:
    """A stream that writes half of what it is given, then fails as a full disk does."""

    closed = False

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, data) -> int:
        data = bytes(data)
        self.stream.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.stream.close()
        self.closed = True


def faulty_filesystem(**kwargs) -> tuple[pafs.PyFileSystem, FaultyFsHandler]:
    """A fresh faulty filesystem over the local one and its handler (the switches)."""
    handler = FaultyFsHandler(**kwargs)
    return pafs.PyFileSystem(handler), handler
