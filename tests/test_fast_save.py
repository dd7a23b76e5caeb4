"""The fast path of serialization writes exactly ``torch.save``'s bytes, or steps aside."""

from __future__ import annotations

import io

import pytest
import torch

from gemini_ckpt import _fast_save


def _torch_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype in (torch.int64, torch.int32, torch.uint8):
        return torch.randint(0, 100, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (1,), (1000,), (17, 3), (2, 3, 4), (0,), (1 << 18,)])
def test_bytes_equal_torch_save_for_every_tensor_of_a_signature(dtype, shape):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    probe = _random(shape, dtype, gen)
    _fast_save._templates.pop((torch.Tensor, dtype, tuple(probe.shape), tuple(probe.stride()), 0), None)
    before = _fast_save.stats["fast"]
    for _ in range(4):  # template, verification, then the fast path
        t = _random(shape, dtype, gen)
        out = io.BytesIO()
        out.write(b"preceding items")
        _fast_save.save_tensor(t, out)
        assert out.getvalue()[15:] == _torch_bytes(t)
        loaded = torch.load(io.BytesIO(out.getvalue()[15:]), weights_only=True)
        assert loaded.dtype == t.dtype and torch.equal(loaded, t)
    if shape != (0,):  # an empty tensor's CRC is 0: ambiguous, so it always goes through torch.save
        assert _fast_save.stats["fast"] - before == 2


def test_views_and_tensors_needing_grad_go_through_torch_save():
    base = torch.randn(10, 10)
    fast = _fast_save.stats["fast"]
    for t in (base[2:], base.t(), torch.randn(5, requires_grad=True)):
        for _ in range(3):
            out = io.BytesIO()
            _fast_save.save_tensor(t, out)
            assert out.getvalue() == _torch_bytes(t)
    assert _fast_save.stats["fast"] == fast  # an offset, a transposed layout, autograd: never templated


def test_a_template_that_does_not_reproduce_torch_save_is_dropped(monkeypatch):
    t0, t1, t2 = (torch.randn(33, 7) for _ in range(3))
    key = (torch.Tensor, t0.dtype, tuple(t0.shape), tuple(t0.stride()), 0)
    _fast_save._templates.pop(key, None)
    _fast_save.save_tensor(t0, io.BytesIO())
    template = _fast_save._templates[key]
    template.suffix = template.suffix[:-1] + b"?"  # as if torch's archive layout had changed
    out = io.BytesIO()
    _fast_save.save_tensor(t1, out)  # verification fails: torch.save's bytes are written
    assert out.getvalue() == _torch_bytes(t1)
    assert _fast_save._templates[key] is None
    out = io.BytesIO()
    _fast_save.save_tensor(t2, out)
    assert out.getvalue() == _torch_bytes(t2)
