"""Opening what is under a durable root, safely: :class:`~gemini_ckpt.durable.local_files.LocalFiles`
(file descriptors, on the local filesystem) and :class:`ArrowFiles` (any other ``pyarrow.fs``
filesystem), both the :class:`~gemini_ckpt.durable.layout.Files` the durable layout reads and
writes through (:func:`files_for` picks one)."""

from __future__ import annotations

import posixpath
from typing import Optional

import pyarrow.fs as pafs

from ..errors import DamagedFileError
from .layout import TMP_SUFFIX, Entry, Files, check_size, path_parts
from .local_files import LocalFiles


class ArrowFiles:
    """:class:`Files` on any other ``pyarrow.fs`` filesystem (an object store has no links or
    FIFOs): sizes are checked before anything is read, and reads are capped."""

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs, self.root = fs, root

    def _path(self, rel: str) -> str:
        path_parts(rel)
        return posixpath.join(self.root, rel) if rel else self.root

    def entry(self, rel: str) -> Optional[Entry]:
        info = self.fs.get_file_info(self._path(rel))
        return _arrow_entry(info)

    def list_dir(self, rel: str = "") -> list[tuple[str, Entry]]:
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True, recursive=False)
        out = []
        for info in self.fs.get_file_info(selector):
            e = _arrow_entry(info)
            if e is not None:
                out.append((posixpath.basename(info.path), e))
        return out

    def read(self, rel: str, *, size: Optional[int] = None, cap: Optional[int] = None) -> bytes:
        path = self._path(rel)
        with self.fs.open_input_file(path) as f:
            actual = f.size()
            check_size(path, actual, size, cap)
            data = f.read(actual)
        if len(data) != actual:
            raise DamagedFileError(f"{path} ended after {len(data)} of {actual} bytes (truncated meanwhile)")
        return data

    def read_range(self, rel: str, offset: int, length: int, *, size: Optional[int] = None) -> memoryview:
        path = self._path(rel)
        with self.fs.open_input_file(path) as f:
            actual = f.size()
            check_size(path, actual, size, None)
            if offset < 0 or length < 0 or offset + length > actual:
                raise ValueError(f"{path}: bytes {offset}..{offset + length} are outside the file ({actual} bytes)")
            return memoryview(f.read_at(length, offset))

    def make_dir(self, rel: str) -> None:
        self.fs.create_dir(self._path(rel), recursive=True)

    def create(self, rel: str):
        return self.fs.open_output_stream(self._path(rel))

    def write_atomically(self, rel: str, data) -> None:
        """A temp name, then a rename; object stores without rename get a direct write (their
        single PUT is atomic already)."""
        path = self._path(rel)
        tmp = path + TMP_SUFFIX
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        try:
            self.fs.move(tmp, path)
        except (NotImplementedError, OSError):
            with self.fs.open_output_stream(path) as out:
                out.write(data)
            self.fs.delete_file(tmp)

    def delete_file(self, rel: str) -> bool:
        try:
            self.fs.delete_file(self._path(rel))
            return True
        except FileNotFoundError:
            return False

    def delete_tree(self, rel: str) -> None:
        try:
            self.fs.delete_dir(self._path(rel))
        except FileNotFoundError:
            pass


def _arrow_entry(info) -> Optional[Entry]:
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type == pafs.FileType.File:
        return Entry("file", info.size or 0)
    if info.type == pafs.FileType.Directory:
        return Entry("dir")
    return Entry("not a regular file")


def files_for(fs: pafs.FileSystem, root: str) -> Files:
    """The :class:`Files` of ``root`` on ``fs``: file-descriptor based on the local filesystem."""
    if isinstance(fs, pafs.LocalFileSystem):
        return LocalFiles(root)
    return ArrowFiles(fs, root)
