"""One DCP item read back: ``torch_load_value`` (``torch.load`` with ``weights_only=True``
after :func:`~gemini_ckpt.trust.values.check_torch_bytes`), ``item_nbytes`` (what its metadata
says it holds), and our opaque blobs among the items (``is_opaque_key``, ``safe_opaque``)."""

from __future__ import annotations

import pickle
from typing import Any, Optional

from ..errors import VerificationError
from .values import check_torch_bytes, value_loads
from .viewfile import ViewFile


def torch_load_value(data: Any, what: str, *, storage_bytes: Optional[int] = None) -> Any:
    """A ``torch.save``-d item (a tensor, or a non-tensor DCP item) with ``weights_only=True``,
    after :func:`check_torch_bytes` (``storage_bytes``: what the item's metadata says its
    tensor data holds)."""
    import torch

    check_torch_bytes(data, what, storage_bytes)
    try:
        return torch.load(ViewFile(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure decoding hostile bytes means "refused"
        first = str(exc).strip().splitlines()
        reason = next((line for line in first if "Unsupported" in line or "global" in line.lower()), None)
        raise VerificationError(
            f"{what} cannot be loaded safely ({type(exc).__name__}: {reason or (first[0] if first else '')})"
        ) from None


def item_nbytes(metadata: Any, index: Any) -> Optional[int]:
    """The bytes of tensor data the DCP item at ``index`` holds by its metadata (None: not a
    tensor item); VerificationError when the metadata names no such chunk."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offsets = tuple(index.offset) if index.offset is not None else None
    for chunk in md.chunks:
        if offsets is None or tuple(chunk.offsets) == offsets:
            n = 1
            for d in chunk.sizes:
                n *= int(d)
            return n * md.properties.dtype.itemsize
    raise VerificationError(f"{index.fqn}: the metadata has no chunk at offset {offsets}")


def is_opaque_key(fqn: str) -> bool:
    """Whether a flattened state-dict key holds one of TrainState's pickled blobs."""
    from ..state.train_state import RANK_LOCAL, SCALER, SCHEDULER

    return fqn in (SCHEDULER, SCALER) or fqn.startswith(RANK_LOCAL + ".")


def safe_opaque(fqn: str, value: Any) -> Any:
    """A non-tensor item's value made safe for code that ``pickle.loads`` it later: our opaque
    blobs are decoded through the allow-list and pickled again from what came out."""
    if is_opaque_key(fqn) and isinstance(value, (bytes, bytearray)):
        return pickle.dumps(value_loads(value, fqn), protocol=pickle.HIGHEST_PROTOCOL)
    return value
