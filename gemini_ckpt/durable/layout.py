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

Everything under the root is read and written through :class:`Files` (:func:`files_for`): on a
local filesystem nothing below the root is followed if it is a link, only regular files of
the expected size are read (a FIFO, a device, a sparse giant is refused with
:class:`DamagedFileError` before a byte is read), and every file is created exclusively, the
ones readers see (``.metadata``, the marker, ``latest``) under a temp name, then renamed.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import Optional, Protocol


from ..errors import DamagedFileError

log = logging.getLogger("gemini_ckpt")

METADATA_FILE = ".metadata"
MARKER_FILE = ".gemini_complete"
IN_PROGRESS_FILE = ".gemini_inprogress"
LATEST_FILE = "latest"
STEP_PREFIX = "step_"
DATA_SUFFIX = ".distcp"
_STEP_DIR = re.compile(r"step_([0-9]{9,18})", re.ASCII)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def data_file_name(rank: int) -> str:
    """Rank ``rank``'s data file in a version's directory, as DCP's ``FileSystemWriter`` names it."""
    return f"__{rank}_0{DATA_SUFFIX}"


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


def version_dir(root: str, step: int) -> str:
    return posixpath.join(root, step_dir_name(step))


@dataclass(frozen=True)
class Entry:
    """What a name under a root is, without following it: ``kind`` is ``"file"`` (a regular
    file), ``"dir"``, or a description of anything else (``"a symbolic link"``, ``"a FIFO"``)."""

    kind: str
    size: int = 0


def path_parts(rel: str) -> list[str]:
    """The components of a relative path under a root: DamagedFileError for one that could
    leave it (absolute, ``..``, a NUL or a backslash)."""
    parts = [p for p in rel.split("/") if p]
    if rel.startswith("/") or any(p in (".", "..") or "\x00" in p or "\\" in p for p in parts):
        raise DamagedFileError(f"{rel!r} is not a path inside the directory")
    return parts


class Files(Protocol):
    """The files under one root, as the durable layout uses them. ``rel`` is a ``/``-separated
    path below the root. Call order of a write: :meth:`make_dir`, :meth:`create` (data files),
    :meth:`write_atomically` (``.metadata``, the marker, ``latest``)."""

    root: str

    def entry(self, rel: str) -> Optional[Entry]: ...
    def list_dir(self, rel: str = "") -> list[tuple[str, Entry]]: ...
    def read(self, rel: str, *, size: Optional[int] = None, cap: Optional[int] = None) -> bytes: ...
    def read_range(self, rel: str, offset: int, length: int, *, size: Optional[int] = None) -> memoryview: ...
    def make_dir(self, rel: str) -> None: ...
    def create(self, rel: str): ...
    def write_atomically(self, rel: str, data) -> None: ...
    def delete_file(self, rel: str) -> bool: ...
    def delete_tree(self, rel: str) -> None: ...


# --- latest -----------------------------------------------------------------------------------------
MAX_LATEST_BYTES = 256


def write_latest(files: Files, step: int) -> None:
    files.write_atomically(LATEST_FILE, (step_dir_name(step) + "\n").encode())


def read_latest(files: Files) -> tuple[Optional[int], Optional[str]]:
    """``(step that ``latest`` names or None, what is wrong with the file or None)``. Absent is not
    a problem; anything but exactly one of our directory names is (a link, a FIFO, a big file)."""
    try:
        raw = files.read(LATEST_FILE, cap=MAX_LATEST_BYTES)
    except FileNotFoundError:
        return None, None
    except (OSError, DamagedFileError) as exc:
        return None, f"{LATEST_FILE} is unreadable ({exc})"
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    step = parse_step_dir(name) if name else None
    if step is None:
        return None, f"{LATEST_FILE} holds {raw[:64]!r}, not a step directory name"
    return step, None


TMP_SUFFIX = ".tmp"  # a file being written, renamed into place when whole


def check_size(where: str, size: int, expected: Optional[int], cap: Optional[int]) -> None:
    if expected is not None and size != expected:
        raise DamagedFileError(f"{where} holds {size} bytes, {expected} recorded (truncated or replaced)")
    if cap is not None and size > cap:
        raise DamagedFileError(f"{where} holds {size} bytes, more than the {cap} it may hold; refused")
