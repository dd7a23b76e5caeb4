"""The manifest as JSON, and its signature: ``sign`` and
``check_signature`` (HMAC-SHA256 over the canonical encoding), ``manifest_to_json`` and
``manifest_from_json`` for the durable marker, ``check_marker`` for a marker read before its
``.metadata``, and ``check_metadata`` (the ``.metadata`` checksum). Nothing here unpickles
anything, and nothing here imports torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from ..checksum import checksum
from ..errors import VerificationError
from ..signing import ENV_KEY, canonical, mac, mac_matches
from ..health import Health
from ..format.manifest import ItemChecksum, VersionManifest

FORMAT = "gemini_ckpt/2"
LEGACY_FORMATS = ("gemini_ckpt/1",)  # markers without metadata/manifest checksums
_SIGN_CONTEXT = b"gemini_ckpt manifest hmac-sha256 v1\x00"


# --- signatures ------------------------------------------------------------------------------
def sign(manifest: VersionManifest, key: Optional[bytes]) -> VersionManifest:
    """``manifest`` with its HMAC-SHA256 signature (unchanged when ``key`` is None)."""
    if key is None:
        return manifest
    if manifest.metadata_crc is None:
        manifest = replace(manifest, metadata_crc=checksum(manifest.metadata))
    return replace(manifest, signature=mac(key, _SIGN_CONTEXT, canonical_bytes(manifest)))


def check_signature(manifest: VersionManifest, key: Optional[bytes], metadata_bytes: Optional[int] = None) -> None:
    """With a key: raise VerificationError unless ``manifest`` carries its valid signature.
    ``metadata_bytes``: the size of ``.metadata`` the marker records, when the manifest is
    checked before ``.metadata`` is read (so nothing is read on an unsigned size)."""
    if key is None:
        return
    where = f"step {manifest.step}"
    if manifest.signature is None:
        raise VerificationError(
            f"{where} is not signed, and a signing key is set (CheckpointConfig.signing_key "
            f"or ${ENV_KEY}); an unsigned version is refused"
        )
    if manifest.metadata_crc is None or not mac_matches(
        manifest.signature, key, _SIGN_CONTEXT, canonical_bytes(manifest, metadata_bytes)
    ):
        raise VerificationError(
            f"{where} has a signature that does not match this signing key (forged, "
            f"damaged, or written with another key); refused"
        )


# --- manifest encoding -------------------------------------------------------------------------
def manifest_fields(m: VersionManifest, metadata_bytes: Optional[int] = None) -> dict:
    """The fields a checksum and a signature cover (everything but the signature itself).
    ``health`` only when recorded, so markers written before it existed verify as they did.
    ``metadata_bytes``: instead of ``len(m.metadata)`` (a marker checked before ``.metadata``
    is read)."""
    fields = {
        "format": FORMAT,
        "step": m.step,
        "world_size": m.world_size,
        "file_sizes": dict(m.file_sizes),
        "checksum_algorithm": "crc32c",
        "checksums": [[c.file, c.offset, c.length, c.crc] for c in m.checksums],
        "metadata_bytes": len(m.metadata) if metadata_bytes is None else metadata_bytes,
        "metadata_crc": m.metadata_crc,
        "job": m.job,
    }
    if m.health is not None:
        fields["health"] = m.health
    return fields


def canonical_bytes(m: VersionManifest, metadata_bytes: Optional[int] = None) -> bytes:
    return canonical(manifest_fields(m, metadata_bytes))


def manifest_to_json(m: VersionManifest) -> dict:
    """The durable marker's contents: the manifest's fields, their CRC32C, the signature."""
    out = manifest_fields(m)
    out["manifest_crc"] = checksum(canonical_bytes(m))
    if m.signature is not None:
        out["signature"] = m.signature
    return out


_MARKER_KEYS = {
    "format",
    "step",
    "world_size",
    "file_sizes",
    "checksum_algorithm",
    "checksums",
    "metadata_bytes",
    "metadata_crc",
    "job",
    "manifest_crc",
    "signature",
    "health",
}


def manifest_from_json(d: Any, metadata: bytes) -> VersionManifest:
    """Decode and check a marker (and the ``.metadata`` bytes it describes). Any damage raises
    VerificationError; nothing here unpickles anything."""
    try:
        return _from_json(d, metadata)
    except VerificationError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise VerificationError(f"malformed manifest ({type(exc).__name__}: {exc})") from None


def check_marker(d: Any, key: Optional[bytes] = None) -> Optional[int]:
    """Check a marker on its own, before ``.metadata`` is read: its structure, its checksum and,
    with ``key``, its signature, all over the size of ``.metadata`` it records. Returns that size
    (None for a legacy marker, which records none). A torn or forged marker raises
    VerificationError: such a version is not complete."""
    try:
        manifest, fmt = _decode(d, b"")
        if fmt != FORMAT:
            check_signature(manifest, key)
            return None
        size = _int(d["metadata_bytes"], "metadata_bytes")
        if checksum(canonical_bytes(manifest, size)) != _int(d.get("manifest_crc"), "manifest_crc"):
            raise VerificationError("the manifest fails its checksum (damaged)")
        check_signature(manifest, key, size)
        return size
    except VerificationError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise VerificationError(f"malformed manifest ({type(exc).__name__}: {exc})") from None


def _from_json(d: Any, metadata: bytes) -> VersionManifest:
    manifest, fmt = _decode(d, metadata)
    if fmt == FORMAT:
        if _int(d["metadata_bytes"], "metadata_bytes") != len(metadata):
            raise VerificationError(
                f".metadata holds {len(metadata)} bytes, the manifest says "
                f"{d['metadata_bytes']} (truncated or replaced)"
            )
        check_metadata(manifest)  # (a manifest without ``metadata_crc`` is refused when signing)
        if checksum(canonical_bytes(manifest)) != _int(d.get("manifest_crc"), "manifest_crc"):
            raise VerificationError("the manifest fails its checksum (damaged)")
    check_metadata(manifest)
    return manifest


def _decode(d: Any, metadata: bytes) -> tuple[VersionManifest, str]:
    """The marker's manifest (with ``metadata``) and format, structure checked; no checksum."""
    if not isinstance(d, dict):
        raise VerificationError(f"the manifest is a {type(d).__name__}, not a JSON object")
    fmt = d.get("format")
    if fmt != FORMAT and fmt not in LEGACY_FORMATS:
        raise VerificationError(f"unknown manifest format {fmt!r} (this version reads {FORMAT!r})")
    unknown = set(d) - _MARKER_KEYS
    if fmt == FORMAT and unknown:
        raise VerificationError(f"the manifest has unknown fields {sorted(unknown)[:5]} (damaged?)")
    if d.get("checksum_algorithm") != "crc32c":
        raise VerificationError(f"unknown checksum algorithm {d.get('checksum_algorithm')!r}")
    file_sizes = d["file_sizes"]
    if not isinstance(file_sizes, dict):
        raise VerificationError("file_sizes is not an object")
    checksums = d["checksums"]
    if not isinstance(checksums, list) or not all(isinstance(c, list) and len(c) == 4 for c in checksums):
        raise VerificationError("checksums is not a list of [file, offset, length, crc]")
    job = d.get("job", {})
    if not isinstance(job, dict):
        raise VerificationError("job is not an object")
    metadata_crc = d.get("metadata_crc")
    health = d.get("health")
    if health is not None:
        Health.from_json(health)  # ValueError (malformed manifest) unless a well-formed verdict
    manifest = VersionManifest(
        step=_int(d["step"], "step"),
        world_size=_int(d["world_size"], "world_size", low=1),
        metadata=metadata,
        checksums=tuple(
            ItemChecksum(_name(f), _int(o, "offset"), _int(n, "length"), _int(c, "crc")) for f, o, n, c in checksums
        ),
        file_sizes={_name(k): _int(v, "file size") for k, v in file_sizes.items()},
        job=job,
        metadata_crc=None if metadata_crc is None else _int(metadata_crc, "metadata_crc"),
        signature=_signature(d.get("signature")),
        health=health,
    )
    return manifest, fmt


def _int(v: Any, what: str, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise VerificationError(f"{what} is {v!r}, not an integer >= {low}")
    return v


def _name(v: Any) -> str:
    # Data files are plain names inside the version directory: nothing may point elsewhere.
    if not isinstance(v, str) or not v or v in (".", "..") or any(ch in v for ch in "/\\\x00"):
        raise VerificationError(f"data file name {v!r} is not a plain file name")
    return v


def _signature(v: Any) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) != 64 or any(ch not in "0123456789abcdef" for ch in v):
        raise VerificationError("the signature is not a hex HMAC-SHA256")
    return v


def check_metadata(manifest: VersionManifest) -> None:
    """Raise VerificationError when ``.metadata`` does not match its recorded checksum."""
    if manifest.metadata_crc is not None and checksum(manifest.metadata) != manifest.metadata_crc:
        raise VerificationError(
            f"step {manifest.step}: .metadata fails its checksum ({len(manifest.metadata)} bytes; damaged or replaced)"
        )
