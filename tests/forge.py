"""Forging durable versions as a writer of the directory without the key can: change a file,
then recompute every checksum the marker holds (shared by the trust and hostile-directory tests)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _StorageInfo

from gemini_ckpt.checksum import checksum
from gemini_ckpt.format.manifest import ItemChecksum, VersionManifest
from gemini_ckpt.trust.manifest import canonical_bytes

MARKER, METADATA = ".gemini_complete", ".metadata"


def reseal(vdir: Path, mutate=None, *, unsign: bool = False) -> None:
    """Recompute every checksum in the marker (metadata CRC, manifest CRC) after a change;
    ``unsign``: drop the signature too (a forger cannot recompute it)."""
    marker = json.loads((vdir / MARKER).read_text())
    md = (vdir / METADATA).read_bytes()
    marker["metadata_crc"], marker["metadata_bytes"] = checksum(md), len(md)
    if mutate is not None:
        mutate(marker)
    if unsign:
        marker.pop("signature", None)
    m = VersionManifest(
        step=marker["step"],
        world_size=marker["world_size"],
        metadata=md,
        checksums=tuple(ItemChecksum(*c) for c in marker["checksums"]),
        file_sizes=marker["file_sizes"],
        job=marker["job"],
        metadata_crc=marker["metadata_crc"],
        health=marker.get("health"),
    )
    marker["manifest_crc"] = checksum(canonical_bytes(m))
    (vdir / MARKER).write_text(json.dumps(marker))


def forge_item(vdir: Path, fqn: str, payload: bytes, *, unsign: bool = False) -> None:
    """Point item ``fqn`` at ``payload`` (appended to its data file), every CRC recomputed."""
    md = pickle.loads((vdir / METADATA).read_bytes())  # the test's own file: trusted here
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    data = vdir / info.relative_path
    offset = data.stat().st_size
    data.write_bytes(data.read_bytes() + payload)
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload))
    (vdir / METADATA).write_bytes(pickle.dumps(md))

    def mutate(marker):
        marker["checksums"].append([info.relative_path, offset, len(payload), checksum(payload)])
        marker["file_sizes"][info.relative_path] = offset + len(payload)

    reseal(vdir, mutate, unsign=unsign)
