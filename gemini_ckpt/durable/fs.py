"""A :class:`Store` over any ``pyarrow.fs`` filesystem: one standard DCP directory per version.

Layout under the root::

    step_000000123/__0_0.distcp ...   data files, exactly as DCP's FileSystemWriter writes them
    step_000000123/.metadata          the pickled DCP Metadata (written last, via a temp name)
    step_000000123/.gemini_complete   completion marker: JSON with checksums and job description

A directory without the marker is an incomplete version: never listed, never read. So each
version directory is a stock DCP checkpoint that ``torch.distributed.checkpoint.load`` with a
``FileSystemReader`` loads, and the marker is our atomic commit point. The marker records the
CRC32C of ``.metadata`` and of itself (and an HMAC when signing), checked by ``manifest``
before anything is unpickled (see :mod:`gemini_ckpt.trust`). Only directory names that ``step_dir_name``
writes count as versions (``step_`` and ASCII digits, exactly our width for that step), and only
real directories (a link planted under a version's name is never followed).

Every read goes through :mod:`gemini_ckpt.durable.layout`'s :class:`~gemini_ckpt.durable.layout.Files`:
the marker is read with a cap and checked (with a key, its signature too) before ``.metadata``,
which is then read only if it has exactly the size the marker records; a data file only if it has
exactly its recorded size. Links, FIFOs and devices are refused before they are opened.
"""

from __future__ import annotations

import json
import posixpath
from typing import Optional

import pyarrow.fs as pafs

from ..errors import DamagedFileError, VerificationError, VersionNotFoundError
from ..trust.manifest import check_marker, manifest_from_json, manifest_to_json
from .backends import open_uri
from .layout import MARKER_FILE, METADATA_FILE, looks_like_step, parse_step_dir, step_dir_name
from .files import files_for
from ..format.manifest import VersionManifest

MAX_MARKER_BYTES = 256 << 20  # a marker is JSON of a few hundred bytes per item; refuse absurd ones
MAX_UNRECORDED_METADATA_BYTES = 1 << 30  # legacy markers record no .metadata size


class FsStore:
    """Versions as DCP directories on a ``pyarrow.fs`` filesystem (local, S3, ...)."""

    def __init__(
        self, uri: Optional[str] = None, *, filesystem: Optional[pafs.FileSystem] = None, root: Optional[str] = None
    ) -> None:
        if filesystem is not None:
            self.fs, self.root = filesystem, root or ""
        elif uri is not None:
            self.fs, self.root = open_uri(uri)
        else:
            raise ValueError("FsStore needs a uri or a filesystem and root")
        self.files = files_for(self.fs, self.root)
        # No I/O here: an unreachable location must not stop a job that can restore from
        # memory. Directories are created by the first write
        # (``DurableTier.begin``).

    def _path(self, step: int, name: str = "") -> str:
        base = posixpath.join(self.root, step_dir_name(step))
        return posixpath.join(base, name) if name else base

    @staticmethod
    def rel(step: int, name: str = "") -> str:
        """``name`` in the version's directory, relative to the root (as :attr:`files` takes it)."""
        return posixpath.join(step_dir_name(step), name) if name else step_dir_name(step)

    def commit(self, step: int, manifest: VersionManifest) -> None:
        for name, size in manifest.file_sizes.items():
            entry = self.files.entry(self.rel(step, name))
            if entry is None or entry.kind != "file" or entry.size != size:
                found = "missing" if entry is None else entry.kind if entry.kind != "file" else f"{entry.size} bytes"
                raise ValueError(
                    f"cannot commit step {step}: {name} is missing, not a regular file or has the "
                    f"wrong size ({found}; {size} bytes expected)"
                )
        self.files.write_atomically(self.rel(step, METADATA_FILE), manifest.metadata)
        marker = json.dumps(manifest_to_json(manifest), indent=1, sort_keys=True).encode()
        self.files.write_atomically(self.rel(step, MARKER_FILE), marker)

    def committed_steps(self) -> list[int]:
        return sorted(s for s, complete in self.list_versions().items() if complete)

    def list_versions(self) -> dict[int, bool]:
        """Every version directory and whether it has a marker (whether that marker is intact
        is :meth:`marker_problem`'s question; restore and ``verify`` report a damaged one)."""
        out: dict[int, bool] = {}
        for name, entry in self.files.list_dir():
            step = parse_step_dir(name)
            if entry.kind == "dir" and step is not None:
                out[step] = self.files.entry(self.rel(step, MARKER_FILE)) is not None
        return out

    def stray_entries(self) -> list[str]:
        """Names under the root that look like versions (``step_...``) but are not ours (or
        not directories: a link planted under a version's name): never read, never deleted
        by retention; tools report them."""
        return sorted(
            n for n, e in self.files.list_dir() if looks_like_step(n) and (parse_step_dir(n) is None or e.kind != "dir")
        )

    def _marker(self, step: int, where: str) -> dict:
        try:
            raw = self.files.read(self.rel(step, MARKER_FILE), cap=MAX_MARKER_BYTES)
        except FileNotFoundError as exc:
            raise VersionNotFoundError(f"{where} is not complete (no {MARKER_FILE})") from exc
        except DamagedFileError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise VerificationError(f"{where}: {MARKER_FILE} is damaged ({exc})") from None

    def marker_problem(self, step: int) -> Optional[str]:
        """None when the version's marker is intact (decodes, passes its checksum); else why not.
        A torn or unreadable marker means the version is not complete."""
        where = f"step {step} under {self.root}"
        try:
            check_marker(self._marker(step, where))
        except VerificationError as exc:
            return str(exc) if str(exc).startswith(where) else f"{where}: {MARKER_FILE}: {exc}"
        except (VersionNotFoundError, OSError) as exc:
            return f"{where}: {exc}"
        return None

    def manifest(self, step: int, *, key: Optional[bytes] = None) -> VersionManifest:
        """The version's manifest, checked (marker and ``.metadata`` checksums; with ``key`` the
        signature, before ``.metadata`` is read) but not unpickled. VersionNotFoundError without a
        marker; VerificationError when damaged."""
        where = f"step {step} under {self.root}"
        marker = self._marker(step, where)
        try:
            recorded = check_marker(marker, key)
        except VerificationError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        try:
            metadata = self.files.read(self.rel(step, METADATA_FILE), size=recorded, cap=MAX_UNRECORDED_METADATA_BYTES)
        except FileNotFoundError:
            raise VerificationError(f"{where}: {METADATA_FILE} is missing although {MARKER_FILE} exists") from None
        except DamagedFileError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        try:
            manifest = manifest_from_json(marker, metadata)
        except VerificationError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        if manifest.step != step:
            raise VerificationError(
                f"{where}: {MARKER_FILE} describes step {manifest.step} (moved or copied from another version); refused"
            )
        return manifest

    def read_range(self, step: int, name: str, offset: int, length: int, *, size: Optional[int] = None) -> memoryview:
        """``length`` bytes at ``offset`` of data file ``name`` (which must hold exactly ``size``
        bytes when given: the manifest's record): VersionNotFoundError when the file is missing,
        DamagedFileError (a ValueError) when it is not a regular file of that size, ValueError
        when the range is not inside it (a truncated file)."""
        try:
            return self.files.read_range(self.rel(step, name), offset, length, size=size)
        except FileNotFoundError:
            raise VersionNotFoundError(f"{self._path(step, name)} does not exist") from None

    def close(self) -> None:
        pass

    def drop(self, step: int) -> None:
        """Remove the version's directory (or whatever was planted under its name: a link is
        removed itself, never what it points at)."""
        self.files.delete_tree(self.rel(step))
