"""One fingerprint of a training state, for "bit-identical" checks (demo, chaos harness, tests)."""

from __future__ import annotations

import hashlib
from typing import Any


def digest(tree: Any) -> str:
    """SHA-256 over every tensor (dtype, shape, bytes; a DTensor's local shard) and every other
    value (its ``repr``) of a nested dict/list tree, by key path."""
    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        else:
            h.update(f"{path}={obj!r}".encode())

    walk(tree, "")
    return h.hexdigest()
