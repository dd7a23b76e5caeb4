"""The durable layout without torch: a template of torch.save's bytes per tensor signature, and
a shard written as DCP's FileSystemWriter writes it, from its raw bytes."""

from __future__ import annotations

import io

import crc32c
import numpy as np
import pytest
import torch

from gemini_ckpt.format.framing import Template, value_section, write_tensors
from gemini_ckpt.save.templates import cut, template_for, torch_save_bytes

SIGNATURES = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (7,)),
    (torch.float16, (2, 3, 4)),
    (torch.int64, (9,)),
    (torch.bool, (11,)),
    (torch.complex64, (2, 2)),
    (torch.uint8, (4096,)),
    (torch.float32, ()),
    (torch.float64, (0, 4)),
    (torch.int32, (1,)),
]


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


@pytest.mark.parametrize("dtype,shape", SIGNATURES, ids=lambda v: str(v))
def test_a_template_frames_any_tensor_of_its_signature_exactly_as_torch_save(dtype, shape):
    template = template_for(dtype, shape)
    for seed in range(3):
        t = _tensor(dtype, shape, seed)
        assert template.frame(_raw(t)) == torch_save_bytes(t.contiguous())
    assert Template.from_json(template.to_json()) == template


def test_shard_file_is_the_value_section_then_every_tensor_framed():
    tensors = [_tensor(dtype, shape, i) for i, (dtype, shape) in enumerate(SIGNATURES)]
    region = np.zeros(sum(t.nbytes for t in tensors) + 64 * len(tensors), np.uint8)
    items, at = [], 0
    for t in tensors:
        region[at : at + t.nbytes] = _raw(t)
        items.append((at, t.nbytes, template_for(t.dtype, tuple(t.shape))))
        at += (t.nbytes + 63) // 64 * 64
    values = [torch_save_bytes({"lr": 0.1}), torch_save_bytes(b"opaque")]
    section, placed_values = value_section(values)
    out = io.BytesIO()
    out.write(section)
    placed = write_tensors(out, region, items, start=len(section), chunk_bytes=1000)
    data = out.getvalue()
    assert data == b"".join(values) + b"".join(torch_save_bytes(t.contiguous()) for t in tensors)
    for item, expected in zip(placed_values + placed, values + [torch_save_bytes(t.contiguous()) for t in tensors]):
        chunk = data[item.offset : item.offset + item.length]
        assert chunk == expected and item.crc == crc32c.crc32c(chunk)


def test_an_archive_of_an_unknown_layout_gives_no_template_and_a_bad_template_is_refused():
    t = _tensor(torch.float32, (8,), 0)
    raw = torch_save_bytes(t)
    assert cut(raw[:-10], memoryview(_raw(t))) is None  # truncated: not an archive we know
    assert cut(raw, memoryview(_raw(t) + 1)) is None  # the bytes are not where the template says
    doc = template_for(torch.float32, (8,)).to_json()
    doc["crc_at"] = [10**6]
    with pytest.raises(ValueError, match="outside"):
        Template.from_json(doc)
    with pytest.raises(ValueError, match="template for"):
        write_tensors(io.BytesIO(), np.zeros(64, np.uint8), [(0, 16, template_for(torch.float32, (8,)))], start=0)
