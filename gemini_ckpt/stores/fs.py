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
writes count as versions (``step_`` and ASCII digits, exactly our width for that step).
"""

from __future__ import annotations

import json
import posixpath
from typing import Optional

import pyarrow.fs as pafs

from ..errors import VersionNotFoundError
from ..trust import VerificationError, manifest_from_json, manifest_to_json
from .layout import (
    MARKER_FILE,
    METADATA_FILE,
    looks_like_step,
    parse_step_dir,
    resolve_filesystem,
    step_dir_name,
    write_atomically,
)
from .manifest import VersionManifest

MAX_MARKER_BYTES = 256 << 20  # a marker is JSON of a few hundred bytes per item; refuse absurd ones


class FsStore:
    """Versions as DCP directories on a ``pyarrow.fs`` filesystem (local, S3, ...)."""

    def __init__(self, uri: Optional[str] = None, *, filesystem: Optional[pafs.FileSystem] = None,
                 root: Optional[str] = None) -> None:
        if filesystem is not None:
            self.fs, self.root = filesystem, root or ""
        elif uri is not None:
            self.fs, self.root = resolve_filesystem(uri)
        else:
            raise ValueError("FsStore needs a uri or a filesystem and root")
        # No I/O here: an unreachable location must not stop a job that can restore from
        # memory. Directories are created by the first write
        # (``DurableTier.begin``).

    def _path(self, step: int, name: str = "") -> str:
        base = posixpath.join(self.root, step_dir_name(step))
        return posixpath.join(base, name) if name else base

    def commit(self, step: int, manifest: VersionManifest) -> None:
        for name, size in manifest.file_sizes.items():
            info = self.fs.get_file_info(self._path(step, name))
            if info.type != pafs.FileType.File or info.size != size:
                raise ValueError(f"cannot commit step {step}: {name} is missing or has the wrong size")
        write_atomically(self.fs, self._path(step, METADATA_FILE), manifest.metadata)
        with self.fs.open_output_stream(self._path(step, MARKER_FILE)) as out:
            out.write(json.dumps(manifest_to_json(manifest), indent=1, sort_keys=True).encode())

    def committed_steps(self) -> list[int]:
        return sorted(s for s, complete in self.list_versions().items() if complete)

    def list_versions(self) -> dict[int, bool]:
        """Every version directory and whether it is complete (has the marker)."""
        out: dict[int, bool] = {}
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        for info in self.fs.get_file_info(selector):
            step = parse_step_dir(posixpath.basename(info.path))
            if info.type == pafs.FileType.Directory and step is not None:
                marker = self.fs.get_file_info(posixpath.join(info.path, MARKER_FILE))
                out[step] = marker.type == pafs.FileType.File
        return out

    def stray_entries(self) -> list[str]:
        """Names under the root that look like versions (``step_...``) but are not ours:
        never read, never deleted; tools report them."""
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        names = (posixpath.basename(i.path) for i in self.fs.get_file_info(selector))
        return sorted(n for n in names if looks_like_step(n) and parse_step_dir(n) is None)

    def manifest(self, step: int) -> VersionManifest:
        """The version's manifest, checked (marker and ``.metadata`` checksums) but not
        unpickled. VersionNotFoundError without a marker; VerificationError when damaged."""
        where = f"step {step} under {self.root}"
        try:
            with self.fs.open_input_file(self._path(step, MARKER_FILE)) as f:
                raw = f.read(MAX_MARKER_BYTES + 1)
        except FileNotFoundError as exc:
            raise VersionNotFoundError(f"{where} is not complete (no {MARKER_FILE})") from exc
        if len(raw) > MAX_MARKER_BYTES:
            raise VerificationError(f"{where}: {MARKER_FILE} is over {MAX_MARKER_BYTES} bytes; refused")
        try:
            marker = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise VerificationError(f"{where}: {MARKER_FILE} is damaged ({exc})") from None
        try:
            with self.fs.open_input_file(self._path(step, METADATA_FILE)) as f:
                metadata = f.read()
        except FileNotFoundError:
            raise VerificationError(f"{where}: {METADATA_FILE} is missing although {MARKER_FILE} exists") from None
        try:
            manifest = manifest_from_json(marker, metadata)
        except VerificationError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        if manifest.step != step:
            raise VerificationError(f"{where}: {MARKER_FILE} describes step {manifest.step} (moved or copied "
                                    f"from another version); refused")
        return manifest

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` of data file ``name``: VersionNotFoundError when the file
        is missing, ValueError when the range is not inside it (a truncated file)."""
        path = self._path(step, name)
        try:
            f = self.fs.open_input_file(path)
        except FileNotFoundError:
            raise VersionNotFoundError(f"{path} does not exist") from None
        with f:
            size = f.size()
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"{path}: bytes {offset}..{offset + length} are outside the file ({size} bytes)")
            return memoryview(f.read_at(length, offset))

    def close(self) -> None:
        pass

    def drop(self, step: int) -> None:
        try:
            self.fs.delete_dir(self._path(step))
        except FileNotFoundError:
            pass

