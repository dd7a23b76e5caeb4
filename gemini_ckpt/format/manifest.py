"""The manifest of a persisted version: what the durable tier's completion marker records.

A persisted version is a DCP directory (one data file per rank, laid out as DCP's
``FileSystemWriter`` lays out ``__{rank}_0.distcp``, and ``.metadata``); its
:class:`VersionManifest` holds the ``.metadata`` bytes and a checksum of every item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


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
    ``signature`` the HMAC-SHA256 of the manifest when a signing key is set (see :mod:`gemini_ckpt.trust`).
    ``health`` is the version's health verdict (:meth:`gemini_ckpt.health.Health.to_json`;
    None: recorded before versions had one), inside what the checksum and signature cover.
    """

    step: int
    world_size: int
    metadata: bytes
    checksums: tuple[ItemChecksum, ...]
    file_sizes: dict[str, int]
    job: dict = field(default_factory=dict)
    metadata_crc: Optional[int] = None
    signature: Optional[str] = None
    health: Optional[dict] = None

    @property
    def nbytes(self) -> int:
        return sum(self.file_sizes.values()) + len(self.metadata)

    def checksum_index(self) -> dict[tuple[str, int], ItemChecksum]:
        return {(c.file, c.offset): c for c in self.checksums}


def as_uint8(data) -> np.ndarray:
    """A flat uint8 view (no copy) of a bytes-like object."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
