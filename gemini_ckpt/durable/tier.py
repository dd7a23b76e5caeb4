"""The durable tier: every Nth committed version written through ``pyarrow.fs`` as a
standard DCP checkpoint, with an atomic commit, retention and checksums.

Commit protocol (one version)::

    1. data files      step_000000123/__{rank}_0.distcp   (each host writes its own ranks')
    2. DCP metadata    step_000000123/.metadata           (temp name, then renamed; on object
                                                           stores without rename, written last)
    3. marker          step_000000123/.gemini_complete    (JSON: checksums, job description)
    4. pointer         latest                             (temp name, then renamed)

Step 0 writes ``step_000000123/.gemini_inprogress`` before anything else: it says "this
directory is ours and not complete yet". Readers trust only directories with the completion
marker. Retention deletes a version only after a newer one is complete, and never the one
``latest`` names. A failed persist removes its own directory at once; directories with the
in-progress marker and no completion marker (a crash mid-write) are deleted when the next job
opens the tier. A directory with neither marker was not written by us (a stock ``dcp.save``,
say): it is never deleted, only reported.

Every file is created exclusively and the ones readers trust (``.metadata``, the marker,
``latest``) renamed into place (:class:`~gemini_ckpt.durable.layout.Files`), so a crash or a full
disk never leaves a torn marker. A marker that is torn or unreadable anyway (damage, an older
version of this library) means "not complete": such a version never counts for retention, and
is removed when it carries our in-progress marker (else reported: it cannot be shown to be ours).
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
import time
from dataclasses import dataclass
from typing import Optional, Protocol

from ..checksum import checksum
from ..errors import CheckpointError, DamagedFileError, VerificationError
from ..retention import Retention, as_retention
from ..trust.items import item_nbytes, safe_opaque, torch_load_value
from ..signing import resolve_key
from ..trust.metadata import load_metadata
from ..trust.values import check_torch_bytes
from ..stores.base import Tier
from .fs import FsStore
from .backends import opener_for
from .layout import IN_PROGRESS_FILE, LATEST_FILE, MARKER_FILE, read_latest, step_dir_name, write_latest
from ..format.manifest import VersionManifest

log = logging.getLogger("gemini_ckpt")


__all__ = ["DurableTier", "EveryNSteps", "NeverPersist", "PersistPolicy"]  # the extension points; the rest is internal


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


class DurableTier(Tier):
    """A durable location (any ``pyarrow.fs`` URI or local path) holding complete versions."""

    def __init__(
        self, uri: Optional[str] = None, *, keep: "int | Retention" = 3, filesystem=None, root: str = ""
    ) -> None:
        """``uri``: a local path, ``file://`` or any ``pyarrow.fs`` URI (``s3://bucket/run?...``).
        Or pass a ready ``pyarrow.fs`` ``filesystem`` and a ``root`` inside it. ``keep``: how many
        complete versions :meth:`apply_retention` keeps, or a :mod:`~gemini_ckpt.retention` policy."""
        self.retention: Retention = as_retention(keep)
        self.store = FsStore(uri, filesystem=filesystem, root=root) if filesystem is not None else FsStore(uri)
        self.uri = uri if uri is not None else f"{type(filesystem).__name__}:{root}"
        # Host stores open the location themselves from the URI, with the opener of its
        # scheme's backend that the persister sends them (None: pyarrow's own); a filesystem
        # object handed to us in-process is not sent, so then the coordinator writes instead.
        self.uri_resolvable = filesystem is None
        self.opener = opener_for(uri) if filesystem is None and uri is not None else None

    # --- writing ------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step 0, by the coordinator: remove any earlier copy of this step (a step saved again
        after restoring an older version), so no reader can mix the two."""
        files = self.store.files
        if step == self.latest():
            # ``latest`` must never name a directory that is about to change.
            older = [s for s in self.intact_steps() if s != step]
            if older:
                self._write_latest(older[-1])
            else:
                files.delete_file(LATEST_FILE)
        existing = self.store.list_versions().get(step)
        if existing is not None and not existing and not self._ours(step):
            raise FileExistsError(
                f"durable tier {self.uri}: {step_dir_name(step)} exists but was not written by gemini_ckpt "
                f"(no {MARKER_FILE} or {IN_PROGRESS_FILE}); it is left alone. Move it away, or load it "
                f"with CheckpointConfig(init_from=...) in a job that saves elsewhere"
            )
        self.store.drop(step)
        files.make_dir(self.store.rel(step))
        with files.create(self.store.rel(step, IN_PROGRESS_FILE)) as out:
            out.write(json.dumps({"step": step, "started_unix": time.time()}).encode())

    def abandon(self, step: int) -> bool:
        """A persist of ``step`` failed: remove its partial directory now (only if it carries
        our in-progress marker and no intact completion marker). Returns whether it was removed."""
        if not self._unfinished(step):
            return False
        self.store.drop(step)
        return True

    def _ours(self, step: int) -> bool:
        entry = self.store.files.entry(self.store.rel(step, IN_PROGRESS_FILE))
        return entry is not None and entry.kind == "file"

    def _unfinished(self, step: int) -> bool:
        """Ours (in-progress marker) and not complete (no marker, or a torn one)."""
        complete = self.store.list_versions().get(step)
        if complete is None or not self._ours(step):
            return False
        return not complete or self.store.marker_problem(step) is not None

    def open_output(self, step: int, name: str):
        """Step 1, when the persister writes a data file itself: a binary output stream (a new
        file, created exclusively)."""
        return self.store.files.create(self.store.rel(step, name))

    def directory(self, step: int) -> str:
        """The version's directory name under the tier's root (what host stores write into)."""
        return step_dir_name(step)

    def commit(self, step: int, manifest: VersionManifest) -> str:
        """Steps 2-4, by the coordinator after every host's ``write_files`` returned. Retention is
        the coordinator's next call (:meth:`apply_retention`)."""
        self.store.commit(step, manifest)
        try:
            self.store.files.delete_file(self.store.rel(step, IN_PROGRESS_FILE))
        except (OSError, DamagedFileError):
            pass  # the completion marker is what readers trust; the leftover is harmless
        self._write_latest(step)
        return self.location(step)

    def location(self, step: int) -> str:
        return posixpath.join(self.store.root, step_dir_name(step))

    def _write_latest(self, step: int) -> None:
        write_latest(self.store.files, step)

    # --- reading ------------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The step ``latest`` names; None when it is absent, unreadable or not exactly a step
        directory name we write (then with a warning: it is ignored, and the next persist
        rewrites it)."""
        step, problem = self.read_latest()
        if problem is not None:
            log.warning("durable tier %s: %s; ignored (the next persist rewrites it)", self.uri, problem)
        return step

    def read_latest(self) -> tuple[Optional[int], Optional[str]]:
        """``(step latest names or None, what is wrong with the file or None)``."""
        return read_latest(self.store.files)

    def complete_steps(self) -> list[int]:
        return self.store.committed_steps()

    def intact_steps(self) -> list[int]:
        """The complete versions whose marker is intact: what retention counts and ``latest``
        may name (a version with a torn marker is not complete, whatever else it holds)."""
        return [s for s in self.complete_steps() if self.store.marker_problem(s) is None]

    # --- as a tier restore reads (gemini_ckpt.stores.base.Tier) --------------------------------
    name = "durable"

    def committed_steps(self) -> list[int]:
        return self.complete_steps()

    def open(self, step: int, *, key: Optional[bytes] = None):
        """A verified view of a complete version (marker, ``.metadata`` checksum, signature
        with ``key``, ``.metadata`` through the allow-list)."""
        from ..stores.views import DurableVersion  # torch: only a reader needs it (status, retention do not)

        manifest = self.store.manifest(step, key=key)
        metadata = load_metadata(manifest, key)
        return DurableVersion(step, manifest, metadata, functools.partial(self._read, manifest))

    def _read(self, manifest: VersionManifest, name: str, offset: int, length: int):
        size = manifest.file_sizes.get(name)
        if size is None:
            raise VerificationError(f"step {manifest.step}: {name} is not a data file its manifest records; refused")
        return self.store.read_range(manifest.step, name, offset, length, size=size)

    def close(self) -> None:
        pass

    # --- housekeeping -------------------------------------------------------------------------
    def apply_retention(self) -> list[int]:
        """Let go of the complete versions the retention policy dooms (never the one ``latest``
        names); returns their steps."""
        latest = self.latest()
        doomed = self.retention.doomed(self.intact_steps(), protected=() if latest is None else (latest,))
        for step in doomed:
            self.store.drop(step)
        return doomed

    def cleanup_incomplete(self) -> list[int]:
        """Delete our own unfinished version directories (in-progress marker, no completion
        marker: a crash mid-write). Directories we did not write are reported, never deleted."""
        doomed = []
        for step, complete in sorted(self.store.list_versions().items()):
            torn = self.store.marker_problem(step) if complete else None
            if complete and torn is None:
                continue
            if not self._ours(step):
                if torn is None:
                    log.warning(
                        "durable tier %s: %s has no gemini_ckpt marker (a stock DCP checkpoint?); it is "
                        "not restored and not deleted (CheckpointConfig.init_from can start a job from it)",
                        self.uri,
                        step_dir_name(step),
                    )
                else:
                    log.warning(
                        "durable tier %s: %s has a damaged marker (%s); it is not complete, never counted "
                        "by retention, and not deleted (nothing shows it is ours)",
                        self.uri,
                        step_dir_name(step),
                        torn,
                    )
                continue
            log.warning(
                "durable tier %s: removing incomplete version step %d (a persist that never finished%s)",
                self.uri,
                step,
                "" if torn is None else f"; its marker is damaged: {torn}",
            )
            self.store.drop(step)
            doomed.append(step)
        return doomed

    def discard(self, steps) -> None:
        """Remove complete versions of ours (abandoned by a restore of an older one, or
        ``overwrite=True``), fixing ``latest`` first so it never names a missing version."""
        doomed = set(steps)
        if not doomed:
            return
        if self.latest() in doomed:
            keep = [s for s in self.intact_steps() if s not in doomed]
            if keep:
                self._write_latest(keep[-1])
            else:
                self.store.files.delete_file(LATEST_FILE)
        for step in sorted(doomed):
            self.store.drop(step)

    def verify(self, step: int, *, signing_key: bytes | str | None = None) -> list[str]:
        """Check a version the way restore would, re-reading every byte: the marker's and
        ``.metadata``'s checksums, the signature when a key is given (or
        ``$GEMINI_CKPT_SIGNING_KEY`` is set), ``.metadata`` through the allow-list, a checksum
        for every item it names, every item's CRC32C, and that every non-tensor item loads
        through the allow-lists. Returns the problems found (empty = good); a damaged version
        is reported, never raised."""
        key = resolve_key(signing_key)
        try:
            manifest = self.store.manifest(step, key=key)
            metadata = load_metadata(manifest, key)
        except (CheckpointError, OSError, LookupError, ValueError) as exc:
            return [f"{type(exc).__name__}: {exc}"]
        problems: list[str] = []
        try:
            byte_items, tensor_items = _items(manifest, metadata, problems)
        except (AttributeError, TypeError, ValueError) as exc:
            return [f".metadata does not have DCP's structure ({type(exc).__name__}: {exc})"]
        for name, size in manifest.file_sizes.items():
            try:
                data = self.store.read_range(step, name, 0, size, size=size)
            except (OSError, ValueError, LookupError) as exc:  # unreadable, truncated, missing, not a file
                problems.append(f"{name}: unreadable ({exc})")
                continue
            if len(data) != size:
                problems.append(f"{name}: {len(data)} bytes, expected {size}")
                continue
            for c in manifest.checksums:
                if c.file != name:
                    continue
                item = data[c.offset : c.offset + c.length]
                if checksum(item) != c.crc:
                    problems.append(f"{name}: checksum mismatch at offset {c.offset} ({c.length} bytes)")
                elif (name, c.offset) in byte_items:
                    fqn = byte_items[(name, c.offset)]
                    try:
                        safe_opaque(fqn, torch_load_value(item, fqn))
                    except VerificationError as exc:
                        problems.append(f"{name}@{c.offset}: {exc}")
                elif (name, c.offset) in tensor_items:
                    index = tensor_items[(name, c.offset)]
                    try:  # not decoded, but its archive must be one torch.load can read within its size
                        check_torch_bytes(item, index.fqn, item_nbytes(metadata, index))
                    except VerificationError as exc:
                        problems.append(f"{name}@{c.offset}: {exc}")
        return problems


def _items(manifest: VersionManifest, metadata, problems: list[str]) -> tuple[dict, dict]:
    """``({(file, offset): key}`` of the non-tensor items, ``{(file, offset): MetadataIndex}`` of
    the tensor items); notes items without a checksum."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    recorded = manifest.checksum_index()
    values, tensors = {}, {}
    for index, info in metadata.storage_data.items():
        c = recorded.get((info.relative_path, info.offset))
        if c is None or c.length != info.length:
            problems.append(f"{index.fqn}: no checksum recorded for {info.relative_path}@{info.offset}")
        elif isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            values[(info.relative_path, info.offset)] = index.fqn
        else:
            tensors[(info.relative_path, info.offset)] = index
    return values, tensors
