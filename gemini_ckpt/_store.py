"""The store protocol and the process-local store (``CheckpointConfig(store="local")``).

A store keeps whole versions: one data file per rank (bytes laid out as DCP's
``FileSystemWriter`` lays out ``__{rank}_0.distcp``) and a :class:`VersionManifest` holding
the DCP ``.metadata`` bytes and a checksum for every item. Call order for one version:

1. every rank: ``put_file(step, name, data)`` for its data file(s);
2. the coordinator, after every rank's ``put_file`` returned: ``commit(step, manifest)``;
   only now does ``committed_steps()`` list the step;
3. any reader: ``committed_steps()``, ``manifest(step)``, ``read_range(...)``;
4. retention: ``drop(step)`` (idempotent), issued only for versions older than a newer
   committed one.

Saving a step that is already committed replaces it: the first ``put_file`` of the new
version uncommits the old one, so a reader never sees a mix of the two.

A store never interprets the bytes; checksums are verified by the reader, end to end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from ._errors import FencedError, VersionNotFoundError

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class ItemChecksum:
    """Checksum of one DCP item: ``length`` bytes at ``offset`` of data file ``file``."""

    file: str
    offset: int
    length: int
    crc: int


@dataclass(frozen=True)
class VersionManifest:
    """Everything about a version except the data files' bytes.

    ``metadata`` is exactly the pickled DCP ``Metadata`` that ``FileSystemWriter`` writes as
    ``.metadata``, so dumping a version as files gives a stock DCP checkpoint.
    ``metadata_crc`` is its CRC32C, recorded at commit and checked before it is unpickled;
    ``signature`` the HMAC-SHA256 of the manifest when a signing key is set (see ``_trust``).
    """

    step: int
    world_size: int
    metadata: bytes
    checksums: tuple[ItemChecksum, ...]
    file_sizes: dict[str, int]
    job: dict = field(default_factory=dict)
    metadata_crc: Optional[int] = None
    signature: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return sum(self.file_sizes.values()) + len(self.metadata)

    def checksum_index(self) -> dict[tuple[str, int], ItemChecksum]:
        return {(c.file, c.offset): c for c in self.checksums}


@runtime_checkable
class Store(Protocol):
    """Where versions live. See the module docstring for the call order.

    A store whose ``put_file`` copies the bytes out before returning may say so with a class
    attribute ``copies_on_put = True``: writers then reuse one serialization buffer for every
    version. Without it, every version is serialized into fresh memory the store may keep."""

    def put_file(self, step: int, name: str, data: np.ndarray) -> None: ...

    def commit(self, step: int, manifest: VersionManifest) -> None: ...

    def committed_steps(self) -> list[int]: ...

    def manifest(self, step: int) -> VersionManifest: ...

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview: ...

    def drop(self, step: int) -> None: ...

    def close(self) -> None:
        """Release this client's connections (versions stay where they are); idempotent."""


def as_uint8(data) -> np.ndarray:
    """A flat uint8 view (no copy) of a bytes-like object."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


@dataclass
class _Version:
    files: dict[str, np.ndarray] = field(default_factory=dict)
    manifest: VersionManifest | None = None


class MemoryStore:
    """Versions kept in this process's heap; the reference implementation of :class:`Store`.

    Shared by every ``Checkpointer`` of a process with the same namespace (see
    :func:`local_store`), so rebuilt training objects find earlier versions.
    """

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._versions: dict[int, _Version] = {}
        self._epoch = 0  # fencing: bumped by every Checkpointer that opens this store

    def fence(self) -> "FencedStore":
        """Take this store over: a view whose writes succeed until the next ``fence()``;
        after that they raise :class:`FencedError` (see ``FencedStore``)."""
        with self._lock:
            self._epoch += 1
            return FencedStore(self, self._epoch)

    def _check(self, epoch: int | None) -> None:
        if epoch is not None and epoch != self._epoch:
            raise FencedError(
                f"a newer Checkpointer opened namespace {self.namespace!r} in this process (epoch {self._epoch}, "
                f"this one has {epoch}); this one's writes are refused. Two Checkpointers that live at the "
                f"same time (a GAN's G and D) need their own CheckpointConfig.namespace")

    def put_file(self, step: int, name: str, data, *, epoch: int | None = None) -> None:
        arr = as_uint8(data)
        with self._lock:
            self._check(epoch)
            version = self._versions.get(step)
            if version is None or version.manifest is not None:
                # Saving a step again (e.g. after restoring an older version) replaces the old
                # version: it stops being committed now, before any of its bytes change.
                version = self._versions[step] = _Version()
            version.files[name] = arr

    def commit(self, step: int, manifest: VersionManifest, *, epoch: int | None = None) -> None:
        with self._lock:
            self._check(epoch)
            version = self._versions.get(step)
            missing = sorted(set(manifest.file_sizes) - set(version.files if version else ()))
            if missing:
                raise ValueError(f"cannot commit step {step}: data files {missing} were never put")
            for name, size in manifest.file_sizes.items():
                if version.files[name].nbytes != size:
                    raise ValueError(
                        f"cannot commit step {step}: {name} holds {version.files[name].nbytes} bytes, "
                        f"manifest says {size}"
                    )
            version.manifest = manifest

    def committed_steps(self) -> list[int]:
        with self._lock:
            return sorted(s for s, v in self._versions.items() if v.manifest is not None)

    def manifest(self, step: int) -> VersionManifest:
        with self._lock:
            version = self._versions.get(step)
            if version is None or version.manifest is None:
                raise VersionNotFoundError(f"step {step} is not committed in this store")
            return version.manifest

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        with self._lock:
            version = self._versions.get(step)
            if version is None or name not in version.files:
                raise VersionNotFoundError(f"step {step} has no data file {name!r} in this store")
            arr = version.files[name]
        if offset < 0 or offset + length > arr.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside {name} ({arr.nbytes} bytes)")
        return memoryview(arr[offset : offset + length])

    def drop(self, step: int, *, epoch: int | None = None) -> None:
        with self._lock:
            self._check(epoch)
            self._versions.pop(step, None)

    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for v in self._versions.values() for a in v.files.values())

    def close(self) -> None:
        pass

    def corrupt_for_test(self, step: int, name: str, offset: int) -> None:
        """Flip one byte of a kept file: lets tests (and the chaos harness) prove checksums bite."""
        with self._lock:
            version = self._versions[step]
            damaged = version.files[name].copy()
            damaged[offset] ^= 0xFF
            version.files[name] = damaged


class FencedStore:
    """One ``Checkpointer``'s view of a shared :class:`MemoryStore`: reads pass through,
    writes carry the epoch the view was opened with and are refused once a newer view exists."""

    def __init__(self, store: MemoryStore, epoch: int) -> None:
        self.inner, self.epoch = store, epoch

    def put_file(self, step: int, name: str, data) -> None:
        self.inner.put_file(step, name, data, epoch=self.epoch)

    def commit(self, step: int, manifest: VersionManifest) -> None:
        self.inner.commit(step, manifest, epoch=self.epoch)

    def drop(self, step: int) -> None:
        self.inner.drop(step, epoch=self.epoch)

    def committed_steps(self) -> list[int]:
        return self.inner.committed_steps()

    def manifest(self, step: int) -> VersionManifest:
        return self.inner.manifest(step)

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        return self.inner.read_range(step, name, offset, length)

    def corrupt_for_test(self, step: int, name: str, offset: int) -> None:
        self.inner.corrupt_for_test(step, name, offset)

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def close(self) -> None:
        pass


_registry_lock = threading.Lock()
_registry: dict[str, MemoryStore] = {}


def local_store(namespace: str) -> MemoryStore:
    """The process-wide :class:`MemoryStore` of ``namespace`` (created on first use)."""
    with _registry_lock:
        store = _registry.get(namespace)
        if store is None:
            store = _registry[namespace] = MemoryStore(namespace)
        return store
