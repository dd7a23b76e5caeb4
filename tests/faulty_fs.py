"""A real local filesystem, behind ``pyarrow.fs.PyFileSystem``, that fails or stalls the way
storage does: writes raise while ``failing`` is set (a full disk, a bucket refusing uploads),
every operation raises while ``unreachable`` is set (the network to the bucket is down),
and writes to paths containing ``stall_on`` block (a hung upload) so a test can kill the
writer mid-persist, and deletes raise while ``failing_deletes`` is set. While ``tearing`` is
set, a write to a file whose name contains ``torn_on`` lands half its bytes and then fails
with ENOSPC (a disk filling up in the middle of a file)."""

from __future__ import annotations

import errno
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs


class FaultyHandler(pafs.FileSystemHandler):
    def __init__(self, *, stall_on: str | None = None, torn_on: str | None = None) -> None:
        self.base = pafs.LocalFileSystem()
        self.failing = threading.Event()
        self.unreachable = threading.Event()
        self.failing_deletes = threading.Event()  # deletes raise (a bucket policy without delete)
        self.stall_on = stall_on
        self.torn_on = torn_on
        self.tearing = threading.Event()
        self.writes = 0

    def _check_read(self, path) -> None:
        if self.unreachable.is_set():
            raise OSError(f"injected: storage unreachable ({path})")

    def _check_write(self, path: str) -> None:
        self._check_read(path)
        if self.failing.is_set():
            raise OSError(f"injected storage failure writing {path}")
        if self.stall_on and self.stall_on in path:
            time.sleep(3600)
        self.writes += 1

    # writes
    def open_output_stream(self, path, metadata):
        self._check_write(path)
        stream = self.base.open_output_stream(path)
        if self.torn_on and self.tearing.is_set() and self.torn_on in path.rsplit("/", 1)[-1]:
            return pa.PythonFile(_Torn(stream), mode="w")
        return stream

    def open_append_stream(self, path, metadata):
        self._check_write(path)
        return self.base.open_append_stream(path)

    def create_dir(self, path, recursive):
        self._check_read(path)
        if self.failing.is_set():
            raise OSError(f"injected storage failure creating {path}")
        self.base.create_dir(path, recursive=recursive)

    def move(self, src, dest):
        self._check_write(dest)
        self.base.move(src, dest)

    # everything else: the real thing
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

    def _check_delete(self, path) -> None:
        self._check_read(path)
        if self.failing_deletes.is_set() and self.base.get_file_info(path).type != pafs.FileType.NotFound:
            raise OSError(f"injected: deleting {path} is not allowed")

    def delete_dir(self, path):
        self._check_delete(path)
        self.base.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._check_read(path)
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root")

    def delete_file(self, path):
        self._check_delete(path)
        self.base.delete_file(path)

    def copy_file(self, src, dest):
        self.base.copy_file(src, dest)

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


def faulty_filesystem(**kwargs) -> tuple[pafs.PyFileSystem, FaultyHandler]:
    handler = FaultyHandler(**kwargs)
    return pafs.PyFileSystem(handler), handler
