"""``torch.save`` of one CPU tensor, byte for byte, without its per-call Python work.

DCP's file format stores every tensor as a ``torch.save`` zip archive. Checkpointing every
step means serializing the same tensors (same dtype, shape, stride) again and again, and
``torch.save`` spends ~0.3 ms of Python per tensor (pickler, persistent ids, zip records),
holding the GIL while the training thread needs it. For a signature seen before, the archive
differs only in the tensor's bytes and in values derived from them: the data record's CRC-32
(in its data descriptor and in the central directory), and the archive's serialization id,
which ends with a hash of every record's CRC-32, plus that record's own CRC-32.

So the first tensor of a signature is saved with ``torch.save`` and becomes a template
(its bytes, where the data lies, where those derived values lie); the second is built from the
template **and** saved with ``torch.save``, and the template is used from then on only if
both are identical. Anything unexpected (a record layout we do not recognise, a CRC that
appears at an ambiguous place, a mismatch) sends that signature back to ``torch.save`` for
good. Each template costs one archive's metadata (~1-5 kB).
"""

from __future__ import annotations

import io
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

_MASK = (1 << 64) - 1
_DATA_RECORD = "data/0"
_SID_RECORD = ".data/serialization_id"
_MAX_TEMPLATES = 4096


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t (how the archive folds record CRCs together)."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


@dataclass
class _Template:
    prefix: bytes  # everything before the tensor's bytes
    suffix: bytes  # everything after them, to be patched
    nbytes: int
    crc_at: tuple[int, ...]  # positions (in suffix) of the data record's CRC-32
    sid_at: int  # position (in suffix) of the serialization id's hash part (20 digits)
    sid_prefix: bytes  # the serialization id's first part (constant)
    sid_crc_at: tuple[int, ...]  # positions (in suffix) of the serialization id record's CRC-32
    crcs_before: tuple[int, ...]  # CRC-32s of the records before the data record, in order
    crcs_after: tuple[int, ...]  # ... and between it and the serialization id
    verified: bool = False

    def build(self, data: memoryview, out: io.BytesIO) -> None:
        crc = zlib.crc32(data)
        combined = 0
        for c in (*self.crcs_before, crc, *self.crcs_after):
            combined = _hash_combine(combined, c)
        sid = self.sid_prefix + str(combined).zfill(20).encode()
        sid_crc = zlib.crc32(sid).to_bytes(4, "little")
        suffix = bytearray(self.suffix)
        for at in self.crc_at:
            suffix[at : at + 4] = crc.to_bytes(4, "little")
        suffix[self.sid_at : self.sid_at + 20] = sid[-20:]
        for at in self.sid_crc_at:
            suffix[at : at + 4] = sid_crc
        out.write(self.prefix)
        out.write(data)
        out.write(suffix)


_templates: dict[tuple, Optional[_Template]] = {}  # signature -> template (None: use torch.save)
_NEW = object()  # a signature not seen yet
_lock = threading.Lock()
stats = {"fast": 0, "torch_save": 0}


def save_tensor(tensor: torch.Tensor, out: io.BytesIO) -> None:
    """Append exactly what ``torch.save(tensor, out)`` would append. ``tensor`` must be a
    plain, detached CPU tensor whose storage holds exactly its bytes."""
    if type(tensor) is not torch.Tensor or tensor.requires_grad or tensor.storage_offset() != 0:
        _torch_save(tensor, out)
        return
    key = (torch.Tensor, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), 0)
    with _lock:
        template = _templates.get(key, _NEW)
    if template is None:  # this signature is not ours to speed up
        _torch_save(tensor, out)
        return
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    if template is _NEW:
        raw = _torch_bytes(tensor)
        _remember(key, _make_template(raw, data))
        out.write(raw)
        return
    if template.verified:
        template.build(data, out)
        stats["fast"] += 1
        return
    raw = _torch_bytes(tensor)
    mine = io.BytesIO()
    template.build(data, mine)
    if mine.getbuffer() == memoryview(raw):
        template.verified = True
    else:
        _remember(key, None)
    out.write(raw)


def _torch_save(tensor: torch.Tensor, out: io.BytesIO) -> None:
    torch.save(tensor, out)
    stats["torch_save"] += 1


def _torch_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    _torch_save(tensor, buf)
    return buf.getvalue()


def _remember(key: tuple, template: Optional[_Template]) -> None:
    with _lock:
        if len(_templates) >= _MAX_TEMPLATES and key not in _templates:
            _templates.pop(next(iter(_templates)))
        _templates[key] = template


def _make_template(raw: bytes, data: memoryview) -> Optional[_Template]:
    """Locate the data and everything derived from it in one ``torch.save`` archive."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError):
        return None
    names = [i.filename.split("/", 1)[-1] for i in infos]
    if names.count(_DATA_RECORD) != 1 or names.count(_SID_RECORD) != 1:
        return None
    d, s = names.index(_DATA_RECORD), names.index(_SID_RECORD)
    if not d < s == len(infos) - 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return None
    info = infos[d]
    start = _data_offset(raw, info.header_offset)
    n = data.nbytes
    if start is None or info.file_size != n or raw[start : start + n] != data:
        return None
    sid = zf.read(infos[s].filename)
    sid_start = _data_offset(raw, infos[s].header_offset)
    if sid_start is None or len(sid) != 40 or raw[sid_start : sid_start + 40] != sid:
        return None
    suffix_start = start + n
    crc_at = _positions(raw, info.CRC, suffix_start, exclude=(sid_start, sid_start + 40))
    sid_crc_at = _positions(raw, infos[s].CRC, suffix_start, exclude=(sid_start, sid_start + 40))
    if len(crc_at) != 2 or len(sid_crc_at) != 2:
        return None  # both the data descriptor and the central directory, exactly once each
    crcs = [i.CRC for i in infos[:s]]
    combined = 0
    for c in crcs:
        combined = _hash_combine(combined, c)
    if sid[20:] != str(combined).zfill(20).encode():
        return None  # the serialization id is not what we know how to recompute
    return _Template(prefix=raw[:start], suffix=raw[suffix_start:], nbytes=n,
                     crc_at=tuple(p - suffix_start for p in crc_at), sid_at=sid_start + 20 - suffix_start,
                     sid_prefix=sid[:20], sid_crc_at=tuple(p - suffix_start for p in sid_crc_at),
                     crcs_before=tuple(crcs[:d]), crcs_after=tuple(crcs[d + 1 :]))


def _data_offset(raw: bytes, header_offset: int) -> Optional[int]:
    """Where a record's data starts, from its local file header."""
    if raw[header_offset : header_offset + 4] != b"PK\x03\x04":
        return None
    name_len = int.from_bytes(raw[header_offset + 26 : header_offset + 28], "little")
    extra_len = int.from_bytes(raw[header_offset + 28 : header_offset + 30], "little")
    return header_offset + 30 + name_len + extra_len


def _positions(raw: bytes, crc: int, start: int, *, exclude: tuple[int, int]) -> list[int]:
    needle = crc.to_bytes(4, "little")
    out, at = [], raw.find(needle, start)
    while at != -1:
        if not exclude[0] - 4 < at < exclude[1]:
            out.append(at)
        at = raw.find(needle, at + 1)
    return out
