"""Templates of ``torch.save``'s bytes for each tensor signature, made and verified at plan time.

See :mod:`gemini_ckpt.format.framing` for what a :class:`~gemini_ckpt.format.framing.Template`
is. Here, with torch at hand: a template is cut from ``torch.save`` of a tensor of the
signature, and used only after an archive built from it for *other* bytes equals what
``torch.save`` writes for those bytes. A signature whose archive does not have the layout we
know (records compressed, a CRC that also appears elsewhere in the trailer by chance) is
tried again with other bytes; one that never fits is a clear error at plan time, never a
wrong file later.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from typing import Optional

import numpy as np
import torch

from ..errors import TemplateError
from ..format.framing import SID_DIGITS, Template, hash_combine

_DATA_RECORD = "data/0"
_SID_RECORD = ".data/serialization_id"
_TRIES = 4

_cache: dict[tuple, Template] = {}


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


class _Archive:
    """What ``torch.save`` wrote: every byte (``data_at`` None), or every write but the one
    of the tensor's data, which the sink recognised as the sample's own memory and never
    copied (``data_at``: where it went, ``data``: the sample's bytes)."""

    def __init__(self, head: bytes, *, data_at: Optional[int] = None, data=None, tail: bytes = b"") -> None:
        self.head, self.data_at, self.data, self.tail = head, data_at, data, tail
        self.size = len(head) if data_at is None else data_at + data.nbytes + len(tail)

    def read(self, a: int, b: int) -> bytes:
        a, b = max(0, a), min(b, self.size)
        if a >= b:
            return b""
        if self.data_at is None:
            return self.head[a:b]
        d0, d1 = self.data_at, self.data_at + self.data.nbytes
        out = b""
        if a < d0:
            out += self.head[a : min(b, d0)]
        if a < d1 and b > d0:
            out += bytes(self.data[max(a, d0) - d0 : min(b, d1) - d0])
        if b > d1:
            out += self.tail[max(a, d1) - d1 : b - d1]
        return out


class _Sink:
    """A file for ``torch.save`` that keeps every write except the one that is ``data``'s
    own memory (torch writes a storage's bytes straight from the tensor, as one memoryview):
    a template of a large tensor is cut without copying or comparing its bytes."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.address = np.frombuffer(data, np.uint8).ctypes.data if data.nbytes else None
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.data_at: Optional[int] = None
        self.pos = 0

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        if (
            self.data_at is None
            and n == self.data.nbytes
            and n
            and np.frombuffer(view, np.uint8).ctypes.data == self.address
        ):
            self.data_at = self.pos
        else:
            (self.before if self.data_at is None else self.after).append(bytes(view))
        self.pos += n
        return n

    def flush(self) -> None:
        pass

    def archive(self) -> _Archive:
        if self.data_at is None:
            return _Archive(b"".join(self.before))
        return _Archive(b"".join(self.before), data_at=self.data_at, data=self.data, tail=b"".join(self.after))


def _saved(sample: torch.Tensor, data: memoryview) -> _Archive:
    sink = _Sink(data)
    torch.save(sample, sink)
    return sink.archive()


class _Reader(io.RawIOBase):
    """An :class:`_Archive` as a seekable file (for ``zipfile``)."""

    def __init__(self, archive: _Archive) -> None:
        self.archive, self.pos = archive, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.archive.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        chunk = self.archive.read(self.pos, self.pos + len(b))
        b[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of the signature: zeros (cheap: calloc'd pages, never touched), with a few
    bytes set to a value derived from ``seed`` so two samples differ in their bytes and CRCs
    (a CRC32 changes with any one byte)."""
    numel = math.prod(shape)
    if not numel:
        return torch.zeros(shape, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    t = torch.from_numpy(np.zeros(size, np.uint8)).view(dtype).reshape(shape)  # numpy's zeros: calloc
    if seed:
        raw = t.reshape(-1).view(torch.uint8)
        n = raw.numel()
        raw[[seed % n, n // 2, n - 1 - seed % n]] = (0x5A + 37 * seed) % 256
    return t


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _make(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    what = f"a {dtype} tensor of shape {list(shape)}"
    first = _sample(dtype, shape, 0)
    if first.numel() == 0:
        raw = torch_save_bytes(first)
        return Template(prefix=raw, suffix=b"", nbytes=0)
    for attempt in range(_TRIES):
        sample = first if attempt == 0 else _sample(dtype, shape, 2 * attempt)
        data = _bytes_of(sample)
        template = cut(_saved(sample, data), data)
        if template is None:
            continue
        other = _sample(dtype, shape, 2 * attempt + 1)
        if _frames_as_torch_saves(template, other):
            return template
    raise TemplateError(
        f"torch.save of {what} does not have a layout gemini_ckpt can lay out without torch "
        f"(its archive records are not what this version knows); please report it with your "
        f"torch version ({torch.__version__})"
    )


def _frames_as_torch_saves(template: Template, other: torch.Tensor) -> bool:
    """Whether the template frames ``other``'s bytes exactly as ``torch.save(other)`` writes them."""
    data = _bytes_of(other)
    saved = _saved(other, data)
    if saved.data_at is None:  # the sink did not see the data as one write: compare every byte
        return template.frame(data) == saved.head
    return (
        saved.data_at == len(template.prefix)
        and saved.head == template.prefix
        and saved.tail == template.suffix_for(zlib.crc32(data))
    )


def cut(raw, data: memoryview) -> Optional[Template]:
    """Locate the tensor's bytes and everything derived from them in one archive (``bytes``
    torch.save wrote, or an :class:`_Archive`); None when the archive is not laid out as expected."""
    arch = raw if isinstance(raw, _Archive) else _Archive(bytes(raw))
    try:
        zf = zipfile.ZipFile(_Reader(arch))
        infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        return None
    names = [i.filename.split("/", 1)[-1] for i in infos]
    if names.count(_DATA_RECORD) != 1 or names.count(_SID_RECORD) != 1:
        return None
    d, s = names.index(_DATA_RECORD), names.index(_SID_RECORD)
    if not d < s == len(infos) - 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return None
    info = infos[d]
    start = _data_offset(arch, info.header_offset)
    n = data.nbytes
    if start is None or info.file_size != n:
        return None
    if arch.data_at is not None:  # the sink saw the sample's own memory written here
        if start != arch.data_at or arch.data.nbytes != n:
            return None
    elif arch.read(start, start + n) != data:
        return None
    sid = zf.read(infos[s].filename)
    sid_start = _data_offset(arch, infos[s].header_offset)
    if sid_start is None or len(sid) != 2 * SID_DIGITS or arch.read(sid_start, sid_start + len(sid)) != sid:
        return None
    suffix_start = start + n
    suffix = arch.read(suffix_start, arch.size)
    exclude = (sid_start - suffix_start, sid_start - suffix_start + len(sid))
    crc_at = _positions(suffix, info.CRC, 0, exclude)
    sid_crc_at = _positions(suffix, infos[s].CRC, 0, exclude)
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
    return Template(
        prefix=arch.read(0, start),
        suffix=suffix,
        nbytes=n,
        crc_at=tuple(crc_at),
        sid_at=sid_start + SID_DIGITS - suffix_start,
        sid_prefix=sid[:SID_DIGITS],
        sid_crc_at=tuple(sid_crc_at),
        crcs_before=tuple(crcs[:d]),
        crcs_after=tuple(crcs[d + 1 :]),
    )


def _data_offset(arch: _Archive, header_offset: int) -> Optional[int]:
    """Where a record's data starts, from its local file header."""
    header = arch.read(header_offset, header_offset + 30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return header_offset + 30 + name_len + extra_len


def _positions(raw: bytes, crc: int, start: int, exclude: tuple[int, int]) -> list[int]:
    needle = crc.to_bytes(4, "little")
    out, at = [], raw.find(needle, start)
    while at != -1:
        if not exclude[0] - 4 < at < exclude[1]:
            out.append(at)
        at = raw.find(needle, at + 1)
    return out
