"""A shard as DCP's ``FileSystemWriter`` lays it out, built from its raw bytes. No torch.

In memory a shard is raw: every tensor item's bytes at a fixed offset of one region, every
non-tensor item a small blob (see :mod:`gemini_ckpt.format.shards`). Only a version that is
persisted is laid out as a DCP data file, byte for byte what ``FileSystemWriter`` writes for
the same state: the non-tensor items first (each a ``torch.save`` archive, built by the
trainer, which has torch), then every tensor item as ``torch.save`` writes it.

A ``torch.save`` archive of a plain tensor differs from one of another tensor of the same
dtype and shape only in the tensor's bytes and in values derived from them: the data
record's CRC-32 (in its data descriptor and in the central directory) and the archive's
serialization id, whose last 20 digits hash every record's CRC-32, plus that record's own
CRC-32. A :class:`Template` records everything else (made and verified by the trainer at
plan time, :mod:`gemini_ckpt.save.templates`), so a host store frames a tensor with one
CRC-32 pass over its bytes and a few patched bytes.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass
from typing import Any, Iterable

from ..checksum import checksum


_MASK = (1 << 64) - 1
SID_DIGITS = 20


def hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t (how the archive folds record CRCs together)."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


@dataclass(frozen=True)
class Template:
    """``torch.save`` of one tensor signature (dtype, shape; contiguous, exact storage) with
    the tensor's bytes cut out. ``crc_at``/``sid_at``/``sid_crc_at`` are positions in
    ``suffix``; an empty tensor has no positions (its archive is constant)."""

    prefix: bytes
    suffix: bytes
    nbytes: int
    crc_at: tuple[int, ...] = ()
    sid_at: int = -1
    sid_prefix: bytes = b""
    sid_crc_at: tuple[int, ...] = ()
    crcs_before: tuple[int, ...] = ()
    crcs_after: tuple[int, ...] = ()

    @property
    def framed_size(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)

    def suffix_for(self, data_crc32: int) -> bytes:
        """The suffix of the archive whose tensor bytes have this CRC-32."""
        if not self.crc_at:
            return self.suffix
        combined = 0
        for c in (*self.crcs_before, data_crc32, *self.crcs_after):
            combined = hash_combine(combined, c)
        sid = self.sid_prefix + str(combined).zfill(SID_DIGITS).encode()
        sid_crc = zlib.crc32(sid).to_bytes(4, "little")
        out = bytearray(self.suffix)
        for at in self.crc_at:
            out[at : at + 4] = data_crc32.to_bytes(4, "little")
        out[self.sid_at : self.sid_at + SID_DIGITS] = sid[-SID_DIGITS:]
        for at in self.sid_crc_at:
            out[at : at + 4] = sid_crc
        return bytes(out)

    def frame(self, data) -> bytes:
        """The whole archive (tests and small tensors; files are written piecewise)."""
        return self.prefix + bytes(data) + self.suffix_for(zlib.crc32(data))

    # --- JSON (plans travel as JSON, never as pickles) -----------------------------------
    def to_json(self) -> dict:
        return {
            "prefix": _b64(self.prefix),
            "suffix": _b64(self.suffix),
            "nbytes": self.nbytes,
            "crc_at": list(self.crc_at),
            "sid_at": self.sid_at,
            "sid_prefix": _b64(self.sid_prefix),
            "sid_crc_at": list(self.sid_crc_at),
            "crcs_before": list(self.crcs_before),
            "crcs_after": list(self.crcs_after),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Template":
        t = cls(
            prefix=_unb64(d["prefix"]),
            suffix=_unb64(d["suffix"]),
            nbytes=_nat(d["nbytes"]),
            crc_at=tuple(_nat(x) for x in d["crc_at"]),
            sid_at=int(d["sid_at"]),
            sid_prefix=_unb64(d["sid_prefix"]),
            sid_crc_at=tuple(_nat(x) for x in d["sid_crc_at"]),
            crcs_before=tuple(_nat(x) for x in d["crcs_before"]),
            crcs_after=tuple(_nat(x) for x in d["crcs_after"]),
        )
        for at in (*t.crc_at, *t.sid_crc_at):
            if at + 4 > len(t.suffix):
                raise ValueError("template position outside its suffix")
        if t.crc_at and not 0 <= t.sid_at <= len(t.suffix) - SID_DIGITS:
            raise ValueError("template serialization id outside its suffix")
        return t


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError("expected base64 text")
    return base64.b64decode(text.encode("ascii"), validate=True)


def _nat(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected an int >= 0, got {v!r}")
    return v


@dataclass(frozen=True)
class FileItem:
    """Where one item lies in the data file: ``length`` bytes at ``offset``; ``crc`` is the
    CRC32C of exactly those bytes (what the durable marker records)."""

    offset: int
    length: int
    crc: int


def value_section(archives: Iterable[bytes]) -> tuple[bytes, list[FileItem]]:
    """The non-tensor items (``torch.save`` archives, in plan order) as the file's first bytes."""
    out, items, at = [], [], 0
    for blob in archives:
        items.append(FileItem(at, len(blob), checksum(blob)))
        out.append(blob)
        at += len(blob)
    return b"".join(out), items


def write_tensors(
    out, region, items: Iterable[tuple[int, int, Template]], *, start: int, chunk_bytes: int = 8 << 20
) -> list[FileItem]:
    """Append every tensor item to ``out`` (a writable binary stream that is ``start`` bytes
    in): ``items`` are ``(offset in region, nbytes, template)`` in plan order. Returns where
    each landed, with its CRC32C."""
    view = memoryview(region).cast("B")
    placed, at = [], start
    for offset, nbytes, template in items:
        if nbytes != template.nbytes:
            raise ValueError(f"a tensor item of {nbytes} bytes has a template for {template.nbytes}")
        data = view[offset : offset + nbytes]
        if len(data) != nbytes:
            raise ValueError(f"tensor item [{offset}, {offset + nbytes}) is outside the shard's region")
        crc_c = checksum(template.prefix)
        crc_z = 0
        out.write(template.prefix)
        for lo in range(0, nbytes, chunk_bytes):
            piece = data[lo : lo + chunk_bytes]
            crc_z = zlib.crc32(piece, crc_z)
            crc_c = checksum(piece, crc_c)
            out.write(piece)
        suffix = template.suffix_for(crc_z)
        out.write(suffix)
        crc_c = checksum(suffix, crc_c)
        placed.append(FileItem(at, template.framed_size, crc_c))
        at += template.framed_size
    return placed
