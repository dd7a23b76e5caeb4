"""Opening what is under a durable root on the local filesystem, safely: :class:`LocalFiles`,
the :class:`~gemini_ckpt.durable.layout.Files` that works on file descriptors.

Every file under a durable root is an input boundary (anyone who can write the directory can
plant a link, a FIFO or a sparse giant there): nothing below the root is followed if it is a
link, only regular files are read, reads never go past the size the caller expects, and every
file we write is created exclusively and renamed into place.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
import stat
from typing import Optional

from ..errors import DamagedFileError
from .layout import TMP_SUFFIX, Entry, check_size, path_parts

log = logging.getLogger("gemini_ckpt")


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _file_parts(rel: str) -> list[str]:
    parts = path_parts(rel)
    if not parts:
        raise DamagedFileError(f"{rel!r} names no file inside the directory")
    return parts


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalFiles:
    """:class:`Files` on a local directory, through file descriptors: the root is the path the
    user named (it may be a link); below it every component is opened with ``O_NOFOLLOW``, a
    file only after ``lstat`` says it is a regular file, with ``O_NONBLOCK`` (a FIFO swapped in
    meanwhile cannot block the open) and ``fstat`` checked again on what was opened."""

    def __init__(self, root: str) -> None:
        self.root = root

    # directories
    def _open_dir(self, parts: list[str], *, create_root: bool = False) -> int:
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            if not create_root:
                raise
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(self.root, _DIR_FLAGS)
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = posixpath.join(self.root, *parts[: i + 1])
                    raise DamagedFileError(
                        f"{where} is not a directory (a link or a file put in its place); refused"
                    ) from None
                raise
            os.close(fd)
            fd = nxt
        return fd

    def _where(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def _lstat(self, dirfd: int, name: str) -> Optional[os.stat_result]:
        try:
            return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entry(self, rel: str) -> Optional[Entry]:
        parts = _file_parts(rel)
        try:
            d = self._open_dir(parts[:-1])
        except (FileNotFoundError, DamagedFileError):
            return None
        try:
            st = self._lstat(d, parts[-1])
        finally:
            os.close(d)
        return None if st is None else Entry(_kind(st.st_mode), st.st_size)

    def list_dir(self, rel: str = "") -> list[tuple[str, Entry]]:
        try:
            d = self._open_dir(path_parts(rel))
        except FileNotFoundError:
            return []
        try:
            out = []
            for name in os.listdir(d):
                st = self._lstat(d, name)
                if st is not None:
                    out.append((name, Entry(_kind(st.st_mode), st.st_size)))
            return out
        finally:
            os.close(d)

    # reading
    def _open_file(self, rel: str) -> tuple[int, int]:
        """``(fd, size)`` of the regular file at ``rel``; FileNotFoundError or DamagedFileError."""
        parts = _file_parts(rel)
        where = self._where(rel)
        d = self._open_dir(parts[:-1])
        try:
            st = self._lstat(d, parts[-1])
            if st is None:
                raise FileNotFoundError(errno.ENOENT, "No such file", where)
            if not stat.S_ISREG(st.st_mode):
                raise DamagedFileError(f"{where} is {_describe(st.st_mode)}, not a regular file; refused")
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=d)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise DamagedFileError(f"{where} is a symbolic link, not a regular file; refused") from None
                raise
        finally:
            os.close(d)
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise DamagedFileError(
                f"{where} was replaced while it was opened (now {_describe(opened.st_mode)}); refused"
            )
        return fd, opened.st_size

    def read(self, rel: str, *, size: Optional[int] = None, cap: Optional[int] = None) -> bytes:
        fd, actual = self._open_file(rel)
        try:
            check_size(self._where(rel), actual, size, cap)
            return bytes(_pread(fd, 0, actual, self._where(rel)))
        finally:
            os.close(fd)

    def read_range(self, rel: str, offset: int, length: int, *, size: Optional[int] = None) -> memoryview:
        fd, actual = self._open_file(rel)
        try:
            where = self._where(rel)
            check_size(where, actual, size, None)
            if offset < 0 or length < 0 or offset + length > actual:
                raise ValueError(f"{where}: bytes {offset}..{offset + length} are outside the file ({actual} bytes)")
            return _pread(fd, offset, length, where)
        finally:
            os.close(fd)

    # writing
    def make_dir(self, rel: str) -> None:
        parts = _file_parts(rel)
        d = self._open_dir(parts[:-1], create_root=True)
        try:
            os.mkdir(parts[-1], 0o755, dir_fd=d)
        finally:
            os.close(d)

    def _create(self, d: int, name: str, where: str) -> int:
        """A new file ``name`` in directory ``d``, never opened through anything planted there: an
        existing entry (our leftover, or a link, a FIFO, a file someone put there) is unlinked
        itself, never its target, and the name created again exclusively."""
        for attempt in range(2):
            try:
                return os.open(name, _CREATE_FLAGS, 0o644, dir_fd=d)
            except FileExistsError:
                st = self._lstat(d, name)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    raise DamagedFileError(f"{where} is a directory; it cannot be replaced") from None
                if attempt:
                    raise DamagedFileError(f"{where} was put back while it was being replaced; refused") from None
                if st is not None:
                    if not stat.S_ISREG(st.st_mode):
                        log.warning(
                            "%s is %s; removed it (the link itself, never what it points at)",
                            where,
                            _describe(st.st_mode),
                        )
                    os.unlink(name, dir_fd=d)
        raise AssertionError("unreachable")  # pragma: no cover

    def create(self, rel: str):
        parts = _file_parts(rel)
        d = self._open_dir(parts[:-1])
        try:
            return os.fdopen(self._create(d, parts[-1], self._where(rel)), "wb")
        finally:
            os.close(d)

    def write_atomically(self, rel: str, data) -> None:
        parts = _file_parts(rel)
        name, tmp = parts[-1], parts[-1] + TMP_SUFFIX
        d = self._open_dir(parts[:-1], create_root=True)
        try:
            fd = self._create(d, tmp, self._where(rel) + TMP_SUFFIX)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quietly(d, tmp)
                raise
            os.close(fd)
            try:
                # rename() replaces a link or a FIFO at ``name`` itself; it fails on a directory
                os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            except OSError as exc:
                _unlink_quietly(d, tmp)
                if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise DamagedFileError(f"{self._where(rel)} is a directory; it cannot be replaced") from None
                raise
            try:
                os.fsync(d)
            except OSError:
                pass  # some filesystems cannot sync a directory; the rename is done either way
        finally:
            os.close(d)

    def delete_file(self, rel: str) -> bool:
        parts = _file_parts(rel)
        try:
            d = self._open_dir(parts[:-1])
        except FileNotFoundError:
            return False
        try:
            os.unlink(parts[-1], dir_fd=d)  # a link itself, never its target
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(d)

    def delete_tree(self, rel: str) -> None:
        parts = _file_parts(rel)
        try:
            d = self._open_dir(parts[:-1])
        except FileNotFoundError:
            return
        try:
            st = self._lstat(d, parts[-1])
            if st is None:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=d)  # fd-based: links inside are unlinked, never followed
            else:
                os.unlink(parts[-1], dir_fd=d)
        finally:
            os.close(d)


def _describe(mode: int) -> str:
    kind = _kind(mode)
    return {"file": "a regular file", "dir": "a directory"}.get(kind, kind)


def _unlink_quietly(d: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=d)
    except OSError:
        pass


def _pread(fd: int, offset: int, length: int, where: str) -> memoryview:
    """Exactly ``length`` bytes at ``offset`` (the file's size was checked; a short read means it
    shrank meanwhile)."""
    first = os.pread(fd, length, offset) if length else b""
    if len(first) == length:
        return memoryview(first)
    buf = bytearray(length)
    view = memoryview(buf)
    view[: len(first)] = first
    got = len(first)
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise DamagedFileError(f"{where} ended after {offset + got} bytes while it was read (truncated meanwhile)")
        got += n
    return view
