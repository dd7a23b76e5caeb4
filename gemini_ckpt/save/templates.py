"""Templates of ``torch.save``'s bytes for each tensor signature, made and verified at plan time.

See :mod:`gemini_ckpt.save.framing` for what a :class:`~gemini_ckpt.save.framing.Template`
is. Here, with torch at hand: a template is cut from ``torch.save`` of a tensor of the
signature, and used only after an archive built from it for *other* bytes equals what
``torch.save`` writes for those bytes. A signature whose archive does not have the layout we
know (records compressed, a CRC that also appears elsewhere in the trailer by chance) is
tried again with other bytes; one that never fits is a clear error at plan time, never a
wrong file later.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import Optional

import torch

from .framing import SID_DIGITS, Template, hash_combine

_DATA_RECORD = "data/0"
_SID_RECORD = ".data/serialization_id"
_TRIES = 4

_cache: dict[tuple, Template] = {}


class TemplateError(ValueError):
    """``torch.save`` of this tensor signature does not have a layout a template can capture."""


def template_for(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    """The verified template of a contiguous CPU tensor of ``dtype`` and ``shape``."""
    key = (dtype, tuple(shape))
    found = _cache.get(key)
    if found is not None:
        return found
    template = _make(dtype, tuple(shape))
    if len(_cache) > 4096:
        _cache.clear()
    _cache[key] = template
    return template


def torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of the signature: zeros (cheap: calloc'd pages), with every 4093rd byte set
    to a value derived from ``seed`` so two samples differ in their bytes and CRCs."""
    t = torch.zeros(shape, dtype=dtype)
    if seed and t.numel():
        raw = t.reshape(-1).view(torch.uint8)
        raw[seed % 4093 :: 4093] = (0x5A + 37 * seed) % 256
    return t


def _make(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    what = f"a {dtype} tensor of shape {list(shape)}"
    first = _sample(dtype, shape, 0)
    if first.numel() == 0:
        raw = torch_save_bytes(first)
        return Template(prefix=raw, suffix=b"", nbytes=0)
    for attempt in range(_TRIES):
        sample = first if attempt == 0 else _sample(dtype, shape, 2 * attempt)
        data = memoryview(sample.reshape(-1).view(torch.uint8).numpy())
        template = cut(torch_save_bytes(sample), data)
        if template is None:
            continue
        other = _sample(dtype, shape, 2 * attempt + 1)
        other_data = other.reshape(-1).view(torch.uint8).numpy()
        if template.frame(other_data) == torch_save_bytes(other):
            return template
    raise TemplateError(f"torch.save of {what} does not have a layout gemini_ckpt can lay out without torch "
                        f"(its archive records are not what this version knows); please report it with your "
                        f"torch version ({torch.__version__})")


def cut(raw: bytes, data: memoryview) -> Optional[Template]:
    """Locate the tensor's bytes and everything derived from them in one archive; None when
    the archive is not laid out as expected."""
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
    if sid_start is None or len(sid) != 2 * SID_DIGITS or raw[sid_start : sid_start + len(sid)] != sid:
        return None
    suffix_start = start + n
    exclude = (sid_start, sid_start + len(sid))
    crc_at = _positions(raw, info.CRC, suffix_start, exclude)
    sid_crc_at = _positions(raw, infos[s].CRC, suffix_start, exclude)
    if len(crc_at) != 2 or len(sid_crc_at) != 2:
        return None  # the data descriptor and the central directory, exactly once each
    crcs = [i.CRC for i in infos[:s]]
    if zlib.crc32(data) != info.CRC:
        return None
    combined = 0
    for c in crcs:
        combined = hash_combine(combined, c)
    if sid[SID_DIGITS:] != str(combined).zfill(SID_DIGITS).encode():
        return None  # the serialization id is not what we know how to recompute
    return Template(prefix=raw[:start], suffix=raw[suffix_start:], nbytes=n,
                    crc_at=tuple(p - suffix_start for p in crc_at), sid_at=sid_start + SID_DIGITS - suffix_start,
                    sid_prefix=sid[:SID_DIGITS], sid_crc_at=tuple(p - suffix_start for p in sid_crc_at),
                    crcs_before=tuple(crcs[:d]), crcs_after=tuple(crcs[d + 1 :]))


def _data_offset(raw: bytes, header_offset: int) -> Optional[int]:
    """Where a record's data starts, from its local file header."""
    if raw[header_offset : header_offset + 4] != b"PK\x03\x04":
        return None
    name_len = int.from_bytes(raw[header_offset + 26 : header_offset + 28], "little")
    extra_len = int.from_bytes(raw[header_offset + 28 : header_offset + 30], "little")
    return header_offset + 30 + name_len + extra_len


def _positions(raw: bytes, crc: int, start: int, exclude: tuple[int, int]) -> list[int]:
    needle = crc.to_bytes(4, "little")
    out, at = [], raw.find(needle, start)
    while at != -1:
        if not exclude[0] - 4 < at < exclude[1]:
            out.append(at)
        at = raw.find(needle, at + 1)
    return out
