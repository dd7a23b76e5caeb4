"""Durable storage that fails on demand: a local directory behind ``pyarrow.fs.PyFileSystem``.

``mode`` is ``"ok"`` (the real thing), ``"fail_writes"`` (every write, rename or mkdir raises
``OSError``, as with a full disk or a bucket that refuses uploads; reads work) or
``"unreachable"`` (every operation raises, reads included). The harness flips the mode from
inside the rank process at step boundaries, so which versions fail is deterministic.
"""

from __future__ import annotations

import pyarrow.fs as pafs

MODES = ("ok", "fail_writes", "unreachable")


class ChaosFsHandler(pafs.FileSystemHandler):
    def __init__(self) -> None:
        self.base = pafs.LocalFileSystem()
        self.mode = "ok"
        self.refused = 0

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"storage mode {mode!r}; use one of {MODES}")
        self.mode = mode

    def _write(self, what: str, path: str) -> None:
        if self.mode != "ok":
            self.refused += 1
            raise OSError(f"chaos: durable storage refuses to {what} {path} ({self.mode})")

    def _read(self, what: str, path) -> None:
        if self.mode == "unreachable":
            self.refused += 1
            raise OSError(f"chaos: durable storage is unreachable ({what} {path})")

    # --- writes ---------------------------------------------------------------------------------
    def open_output_stream(self, path, metadata):
        self._write("write", path)
        return self.base.open_output_stream(path)

    def open_append_stream(self, path, metadata):
        self._write("append to", path)
        return self.base.open_append_stream(path)

    def create_dir(self, path, recursive):
        self._write("create", path)
        self.base.create_dir(path, recursive=recursive)

    def move(self, src, dest):
        self._write("rename to", dest)
        self.base.move(src, dest)

    def copy_file(self, src, dest):
        self._write("copy to", dest)
        self.base.copy_file(src, dest)

    def delete_dir(self, path):
        self._write("delete", path)
        self.base.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._write("delete the contents of", path)
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("chaos: refusing to delete the root")

    def delete_file(self, path):
        self._write("delete", path)
        self.base.delete_file(path)

    # --- reads ----------------------------------------------------------------------------------
    def get_type_name(self):
        return "chaos-local"

    def equals(self, other):
        return self is other

    def normalize_path(self, path):
        return self.base.normalize_path(path)

    def get_file_info(self, paths):
        self._read("stat", paths)
        return self.base.get_file_info(paths)

    def get_file_info_selector(self, selector):
        self._read("list", selector.base_dir)
        return self.base.get_file_info(selector)

    def open_input_stream(self, path):
        self._read("read", path)
        return self.base.open_input_stream(path)

    def open_input_file(self, path):
        self._read("read", path)
        return self.base.open_input_file(path)


def chaos_filesystem() -> tuple[pafs.PyFileSystem, ChaosFsHandler]:
    handler = ChaosFsHandler()
    return pafs.PyFileSystem(handler), handler
