"""The durable layout: the one place that knows how a version sits on a ``pyarrow.fs`` filesystem.

Under a root::

    latest                              the newest complete version's directory name (atomic)
    step_000000123/                     one version: a standard DCP checkpoint directory
    step_000000123/__0_0.distcp ...     data files, exactly as DCP's FileSystemWriter writes them
    step_000000123/.metadata            the pickled DCP Metadata (written atomically)
    step_000000123/.gemini_inprogress   "we are writing this": present from the first byte on
    step_000000123/.gemini_complete     the commit point: JSON with checksums and job description

Host stores (each writes its own ranks' data files), the durable tier (markers, ``latest``,
retention) and the Ray Train integration (which reports directories to Ray) all name, parse and
commit through this module. It imports neither torch nor Ray.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Optional

import pyarrow.fs as pafs

METADATA_FILE = ".metadata"
MARKER_FILE = ".gemini_complete"
IN_PROGRESS_FILE = ".gemini_inprogress"
LATEST_FILE = "latest"
STEP_PREFIX = "step_"
_STEP_DIR = re.compile(r"step_([0-9]{9,18})", re.ASCII)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step a directory name denotes, or None unless it is exactly ``step_dir_name(step)``
    (so ``step_0000000000009``, other widths, non-ASCII digits and suffixes are not versions)."""
    m = _STEP_DIR.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def looks_like_step(name: str) -> bool:
    """A name that claims to be a version (``step_...``), whether or not we wrote it."""
    return name.startswith(STEP_PREFIX)


def resolve_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, root path)`` for a local path, ``file://`` or any pyarrow.fs URI."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def version_dir(root: str, step: int) -> str:
    return posixpath.join(root, step_dir_name(step))


def write_atomically(fs: pafs.FileSystem, path: str, data) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one: a temp
    name, then a rename. Object stores without rename get a direct write (their single PUT is
    atomic already; the marker written after it is the commit point either way)."""
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    try:
        fs.move(tmp, path)
    except (NotImplementedError, OSError):
        with fs.open_output_stream(path) as out:
            out.write(data)
        fs.delete_file(tmp)


def write_latest(fs: pafs.FileSystem, root: str, step: int) -> None:
    write_atomically(fs, posixpath.join(root, LATEST_FILE), (step_dir_name(step) + "\n").encode())


def read_latest(fs: pafs.FileSystem, root: str) -> tuple[Optional[int], Optional[str]]:
    """``(step that ``latest`` names or None, what is wrong with the file or None)``. Absent is not
    a problem; anything but exactly one of our directory names is."""
    try:
        with fs.open_input_file(posixpath.join(root, LATEST_FILE)) as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{LATEST_FILE} is unreadable ({exc})"
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    step = parse_step_dir(name) if name else None
    if step is None:
        return None, f"{LATEST_FILE} holds {raw[:64]!r}, not a step directory name"
    return step, None
