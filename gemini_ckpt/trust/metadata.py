"""The allow-list through which DCP's ``.metadata`` is decoded (``metadata_loads``): only DCP's
metadata classes, ``torch.Size``, dtypes and plain builtins; ``load_metadata`` checks the
manifest first; ``warm_up`` pays the first decode's cost off the restore's critical path."""

from __future__ import annotations

import importlib
import pickle
from typing import Any, Optional

from ..errors import VerificationError
from ..format.manifest import VersionManifest
from ..unpickle import safe_load
from .common import BUILTINS, torch_constant
from .manifest import check_metadata, check_signature

_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
}


def _metadata_global(module: str, name: str) -> Any:
    """What DCP's ``Metadata`` really contains (found by pickling real ones)."""
    if module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES:
        return getattr(importlib.import_module(module), name)
    if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if module == "torch":
        import torch

        return torch.Size if name == "Size" else torch_constant(name)
    if (module, name) == ("torch.serialization", "_get_layout"):
        from torch.serialization import _get_layout

        return _get_layout
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        # Stock dcp.save records its checkpoint_id as a Path; building one only parses a string.
        import pathlib

        return pathlib.PurePosixPath if "Posix" in name else pathlib.PureWindowsPath
    if module == "builtins" and name in BUILTINS:
        import builtins

        return getattr(builtins, name)
    return None


def metadata_loads(data: bytes) -> Any:
    """DCP ``Metadata`` from ``.metadata`` bytes, through the metadata allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata

    obj = safe_load(bytes(data), _metadata_global, ".metadata")
    if not isinstance(obj, Metadata):
        raise VerificationError(f".metadata holds a {type(obj).__name__}, not DCP Metadata")
    return obj


def warm_up() -> None:
    """Decode a small DCP ``Metadata`` through the allow-list once. The first decode in a new
    process costs far more than later ones (docs/recovery.md): a restarted job's ranks pay it
    while they wait for each other at the rendezvous instead of on the restore's critical path
    (:meth:`gemini_ckpt.Checkpointer.start`)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    md = Metadata(
        state_dict_metadata={
            "t": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            ),
            "b": BytesStorageMetadata(),
        }
    )
    metadata_loads(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


def load_metadata(manifest: VersionManifest, key: Optional[bytes] = None) -> Any:
    """Verify a version's manifest (signature when ``key``, metadata checksum), then decode
    its DCP ``Metadata`` through the allow-list."""
    check_signature(manifest, key)
    check_metadata(manifest)
    return metadata_loads(manifest.metadata)
