"""The durable tier: every Nth committed version written through ``pyarrow.fs`` as a
standard DCP checkpoint, with an atomic commit, retention and checksums.

Commit protocol (one version)::

    1. data files      step_000000123/__{rank}_0.distcp   (each host writes its own ranks')
    2. DCP metadata    step_000000123/.metadata           (temp name, then renamed; on object
                                                           stores without rename, written last)
    3. marker          step_000000123/.gemini_complete    (JSON: checksums, job description)
    4. pointer         latest                             (temp name, then renamed)

Readers trust only directories with the marker. Retention deletes a version only after a
newer one is complete, and never the one ``latest`` names. Directories without a marker are
left-overs of a crash; they are deleted when the next job opens the tier.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

from ._checksum import checksum
from ._fs_store import FsStore, step_dir_name
from ._store import VersionManifest

log = logging.getLogger("gemini_ckpt")
LATEST_FILE = "latest"


class PersistPolicy(Protocol):
    """Decides which committed versions also go to the durable tier."""

    def should_persist(self, step: int) -> bool: ...


@dataclass(frozen=True)
class EveryNSteps:
    """Persist step ``s`` when ``(s + 1) % n == 0``: steps n-1, 2n-1, ... (with n=3: 2, 5, 8).
    Tied to the step number, not to a count of saves, so a restarted job keeps the rhythm."""

    n: int

    def should_persist(self, step: int) -> bool:
        return (step + 1) % self.n == 0


@dataclass(frozen=True)
class NeverPersist:
    def should_persist(self, step: int) -> bool:
        return False


def persist_policy(persist_every: int, durable_uri: Optional[str]) -> PersistPolicy:
    """The one place where convenience settings become a policy."""
    if persist_every <= 0 or not durable_uri:
        return NeverPersist()
    return EveryNSteps(persist_every)


class DurableTier:
    """A durable location (any ``pyarrow.fs`` URI or local path) holding complete versions."""

    def __init__(self, uri: Optional[str] = None, *, keep: int = 3, filesystem=None, root: str = "") -> None:
        """``uri``: a local path, ``file://`` or any ``pyarrow.fs`` URI (``s3://bucket/run?...``).
        Or pass a ready ``pyarrow.fs`` ``filesystem`` and a ``root`` inside it."""
        self.keep = keep
        self.store = FsStore(uri, filesystem=filesystem, root=root) if filesystem is not None else FsStore(uri)
        self.uri = uri if uri is not None else f"{type(filesystem).__name__}:{root}"
        # Host stores open the location themselves from the URI; a filesystem object handed
        # to us in-process cannot travel to them, so then the coordinator writes instead.
        self.uri_resolvable = filesystem is None

    # --- writing ------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step 0, by the coordinator: remove any earlier copy of this step (a step saved again
        after restoring an older version), so no reader can mix the two."""
        if step == self.latest():
            # ``latest`` must never name a directory that is about to change.
            older = [s for s in self.complete_steps() if s != step]
            if older:
                self._write_latest(older[-1])
            else:
                self.store.fs.delete_file(posixpath.join(self.store.root, LATEST_FILE))
        self.store.drop(step)

    def write_files(self, step: int, files: Mapping[str, object]) -> int:
        """Step 1 for one host: write these data files; returns bytes written."""
        written = 0
        for name, data in files.items():
            self.store.put_file(step, name, data)
            written += memoryview(data).nbytes
        return written

    def commit(self, step: int, manifest: VersionManifest) -> str:
        """Steps 2-4, by the coordinator after every host's ``write_files`` returned; then retention."""
        self.store.commit(step, manifest)
        self._write_latest(step)
        self.apply_retention()
        return self.location(step)

    def location(self, step: int) -> str:
        return posixpath.join(self.store.root, step_dir_name(step))

    def _write_latest(self, step: int) -> None:
        fs, root = self.store.fs, self.store.root
        tmp = posixpath.join(root, LATEST_FILE + ".tmp")
        with fs.open_output_stream(tmp) as out:
            out.write((step_dir_name(step) + "\n").encode())
        try:
            fs.move(tmp, posixpath.join(root, LATEST_FILE))
        except (NotImplementedError, OSError):
            with fs.open_output_stream(posixpath.join(root, LATEST_FILE)) as out:
                out.write((step_dir_name(step) + "\n").encode())
            fs.delete_file(tmp)

    # --- reading ------------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        try:
            with self.store.fs.open_input_file(posixpath.join(self.store.root, LATEST_FILE)) as f:
                name = f.read().decode().strip()
        except (FileNotFoundError, OSError):
            return None
        return int(name.split("_")[-1]) if name.startswith("step_") else None

    def complete_steps(self) -> list[int]:
        return self.store.committed_steps()

    # --- housekeeping -------------------------------------------------------------------------
    def apply_retention(self) -> list[int]:
        """Keep the newest ``keep`` complete versions (and whatever ``latest`` names)."""
        complete = self.complete_steps()
        latest = self.latest()
        doomed = [s for s in complete[: -self.keep] if s != latest]
        for step in doomed:
            self.store.drop(step)
        return doomed

    def cleanup_incomplete(self) -> list[int]:
        """Delete version directories without a completion marker (crash left-overs)."""
        doomed = [s for s, complete in self.store.list_versions().items() if not complete]
        for step in doomed:
            log.warning("durable tier %s: removing incomplete version step %d (no completion marker)",
                        self.uri, step)
            self.store.drop(step)
        return doomed

    def verify(self, step: int) -> list[str]:
        """Re-read every byte of a complete version; return the problems found (empty = good)."""
        manifest = self.store.manifest(step)
        problems = []
        for name, size in manifest.file_sizes.items():
            try:
                data = self.store.read_range(step, name, 0, size)
            except (OSError, ValueError) as exc:
                problems.append(f"{name}: unreadable ({exc})")
                continue
            if len(data) != size:
                problems.append(f"{name}: {len(data)} bytes, expected {size}")
                continue
            for c in manifest.checksums:
                if c.file == name and checksum(data[c.offset : c.offset + c.length]) != c.crc:
                    problems.append(f"{name}: checksum mismatch at offset {c.offset} ({c.length} bytes)")
        return problems
