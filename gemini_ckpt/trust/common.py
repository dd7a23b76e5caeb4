"""The globals both allow-lists admit (DCP ``.metadata`` in :mod:`.metadata`; our values and
torch.save archives in :mod:`.values`): plain builtins and torch's dtype, layout and memory-format
constants. One home, so the two lists cannot drift apart on what "plain" means."""

from __future__ import annotations

from typing import Any

BUILTINS = {
    "set",
    "frozenset",
    "complex",
    "slice",
    "range",
    "bytearray",
    "int",
    "float",
    "str",
    "bytes",
    "bool",
    "list",
    "dict",
    "tuple",
}


def torch_constant(name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory format (how pickle names them)."""
    import torch

    obj = getattr(torch, name, None) if not name.startswith("_") else None
    return obj if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
