"""A :class:`Store` over any ``pyarrow.fs`` filesystem: one standard DCP directory per version.

Layout under the root::

    step_000000123/__0_0.distcp ...   data files, exactly as DCP's FileSystemWriter writes them
    step_000000123/.metadata          the pickled DCP Metadata (written last, via a temp name)
    step_000000123/.gemini_complete   completion marker: JSON with checksums and job description

A directory without the marker is an incomplete version: never listed, never read. So each
version directory is a stock DCP checkpoint that ``torch.distributed.checkpoint.load`` with a
``FileSystemReader`` loads, and the marker is our atomic commit point.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Optional

import numpy as np
import pyarrow.fs as pafs

from ._errors import VersionNotFoundError
from ._store import METADATA_FILE, ItemChecksum, VersionManifest, as_uint8

MARKER_FILE = ".gemini_complete"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def resolve_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, root path)`` for a local path, ``file://`` or any pyarrow.fs URI."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    import os

    return pafs.LocalFileSystem(), os.path.abspath(uri)


class FsStore:
    """Versions as DCP directories on a ``pyarrow.fs`` filesystem (local, S3, ...)."""

    copies_on_put = True  # put_file copies the bytes out: a writer may reuse its buffer at once

    def __init__(self, uri: Optional[str] = None, *, filesystem: Optional[pafs.FileSystem] = None,
                 root: Optional[str] = None) -> None:
        if filesystem is not None:
            self.fs, self.root = filesystem, root or ""
        elif uri is not None:
            self.fs, self.root = resolve_filesystem(uri)
        else:
            raise ValueError("FsStore needs a uri or a filesystem and root")
        # No I/O here: an unreachable location must not stop a job that can restore from
        # memory. Directories are created by the first write (``put_file``).

    def _path(self, step: int, name: str = "") -> str:
        base = posixpath.join(self.root, step_dir_name(step))
        return posixpath.join(base, name) if name else base

    def put_file(self, step: int, name: str, data) -> None:
        self.fs.create_dir(self._path(step), recursive=True)
        with self.fs.open_output_stream(self._path(step, name)) as out:
            out.write(as_uint8(data))

    def commit(self, step: int, manifest: VersionManifest) -> None:
        for name, size in manifest.file_sizes.items():
            info = self.fs.get_file_info(self._path(step, name))
            if info.type != pafs.FileType.File or info.size != size:
                raise ValueError(f"cannot commit step {step}: {name} is missing or has the wrong size")
        tmp = self._path(step, METADATA_FILE + ".tmp")
        with self.fs.open_output_stream(tmp) as out:
            out.write(manifest.metadata)
        try:
            self.fs.move(tmp, self._path(step, METADATA_FILE))
        except (NotImplementedError, OSError):
            # Object stores without rename: the marker below is the commit point anyway.
            with self.fs.open_output_stream(self._path(step, METADATA_FILE)) as out:
                out.write(manifest.metadata)
            self.fs.delete_file(tmp)
        with self.fs.open_output_stream(self._path(step, MARKER_FILE)) as out:
            out.write(json.dumps(manifest_to_json(manifest), indent=1).encode())

    def committed_steps(self) -> list[int]:
        return sorted(s for s, complete in self.list_versions().items() if complete)

    def list_versions(self) -> dict[int, bool]:
        """Every version directory and whether it is complete (has the marker)."""
        out: dict[int, bool] = {}
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        for info in self.fs.get_file_info(selector):
            m = _STEP_DIR.match(posixpath.basename(info.path))
            if info.type == pafs.FileType.Directory and m:
                marker = self.fs.get_file_info(posixpath.join(info.path, MARKER_FILE))
                out[int(m.group(1))] = marker.type == pafs.FileType.File
        return out

    def manifest(self, step: int) -> VersionManifest:
        try:
            with self.fs.open_input_file(self._path(step, MARKER_FILE)) as f:
                marker = json.loads(f.read())
            with self.fs.open_input_file(self._path(step, METADATA_FILE)) as f:
                metadata = f.read()
        except FileNotFoundError as exc:
            raise VersionNotFoundError(f"step {step} is not complete under {self.root}") from exc
        return manifest_from_json(marker, metadata)

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        with self.fs.open_input_file(self._path(step, name)) as f:
            return memoryview(f.read_at(length, offset))

    def drop(self, step: int) -> None:
        try:
            self.fs.delete_dir(self._path(step))
        except FileNotFoundError:
            pass


def manifest_to_json(m: VersionManifest) -> dict:
    return {
        "format": "gemini_ckpt/1",
        "step": m.step,
        "world_size": m.world_size,
        "file_sizes": m.file_sizes,
        "checksum_algorithm": "crc32c",
        "checksums": [[c.file, c.offset, c.length, c.crc] for c in m.checksums],
        "job": m.job,
    }


def manifest_from_json(d: dict, metadata: bytes) -> VersionManifest:
    return VersionManifest(
        step=int(d["step"]),
        world_size=int(d["world_size"]),
        metadata=metadata,
        checksums=tuple(ItemChecksum(f, int(o), int(n), int(c)) for f, o, n, c in d["checksums"]),
        file_sizes={k: int(v) for k, v in d["file_sizes"].items()},
        job=d.get("job", {}),
    )


def read_file_bytes(store: FsStore, step: int, name: str) -> np.ndarray:
    with store.fs.open_input_file(store._path(step, name)) as f:
        return np.frombuffer(f.read(), dtype=np.uint8)
