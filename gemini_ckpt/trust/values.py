"""The allow-list for our own pickled values (``value_loads``: RNG streams, data-loader,
scheduler, scaler, ``extra``), and ``check_torch_bytes``, which checks a torch.save archive
before ``torch.load`` sees it. One module because each needs the other: a pickled tensor's
storage is a torch.save archive, and an archive's plain parts are values."""

from __future__ import annotations

import importlib
import io
from typing import Any, Optional

from ..errors import VerificationError
from ..unpickle import AllowList, Budget, safe_load, no_gc
from .common import BUILTINS, torch_constant
from .viewfile import ViewFile


def _safe_storage_from_bytes(b: bytes) -> Any:
    # Plain pickle stores a tensor's storage as ``torch.save`` bytes loaded by
    # ``torch.storage._load_from_bytes`` with weights_only=False; ours loads them safely.
    import torch

    check_torch_bytes(b, "a tensor's storage")
    return torch.load(io.BytesIO(b), weights_only=True)


_NUMPY = {
    "dtype": "numpy",
    "ndarray": "numpy",
    "_reconstruct": "numpy._core.multiarray",
    "scalar": "numpy._core.multiarray",
    "_frombuffer": "numpy._core.numeric",
}
_NUMPY_MODULES = {
    "numpy",
    "numpy._core.multiarray",
    "numpy.core.multiarray",
    "numpy._core.numeric",
    "numpy.core.numeric",
}
_TORCH_VALUE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
}
_STDLIB_VALUE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("collections", "deque"),
    ("collections", "Counter"),
    ("datetime", "date"),
    ("datetime", "datetime"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
}


def _value_global(module: str, name: str) -> Any:
    """Globals our own opaque state needs: RNG states (Python tuples, NumPy arrays, torch
    ByteTensors), data-loader, scheduler and scaler state dicts, plain ``extra`` values."""
    if module == "builtins" and name in BUILTINS:
        import builtins

        return getattr(builtins, name)
    if (module, name) in _STDLIB_VALUE_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module in _NUMPY_MODULES and name in _NUMPY and module.split(".")[-1] == _NUMPY[name].split(".")[-1]:
        return getattr(importlib.import_module(_NUMPY[name]), name)
    if module == "numpy.dtypes" and name.endswith("DType") and name not in ("ObjectDType", "StringDType"):
        import numpy as np  # (arrays of objects or variable-width strings: see _by_dtype)

        obj = getattr(importlib.import_module(module), name, None)
        return obj if isinstance(obj, type) and issubclass(obj, np.dtype) else None
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _safe_storage_from_bytes
    if (module, name) in _TORCH_VALUE_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == "torch":
        return torch_constant(name)
    return _user_safe_global(module, name)


def _user_safe_global(module: str, name: str) -> Any:
    """What the user registered with ``torch.serialization.add_safe_globals``."""
    import torch

    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            obj, path = entry
            if path == f"{module}.{name}":
                return obj
        elif getattr(entry, "__module__", None) == module and getattr(entry, "__qualname__", None) == name:
            return entry
    return None


def value_loads(data: bytes, what: str = "a saved value") -> Any:
    """A pickled opaque value (RNG, data loader, scheduler, scaler, ``extra``) through the
    value allow-list."""
    return safe_load(bytes(data), _value_global, what)


# --- torch.save archives: checked before torch.load sees them ----------------------------------------
_MAX_RECORDS = 4096
_ZIP_MAGIC = b"PK\x03\x04"


def check_torch_bytes(data: Any, what: str, storage_bytes: Optional[int] = None) -> None:
    """Raise VerificationError unless ``torch.load`` of ``data`` allocates no more than ``data``
    holds: every zip record stored (never deflated: a small record could inflate to gigabytes)
    and inside the bytes, each storage record exactly the size its pickle names (and, with
    ``storage_bytes``, all of them together exactly that), and the pickle itself decoded once
    through a budgeted allow-list with stand-ins for storages and tensors (torch's own
    weights-only unpickler lets ``bytearray(10**9)`` through)."""
    view = memoryview(data).cast("B")
    with no_gc():
        try:
            if view[:4] == _ZIP_MAGIC:
                _check_zip(view, what, storage_bytes)
            else:
                _check_legacy(view, what, storage_bytes)
        except VerificationError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything failing on hostile bytes means "refused"
            raise VerificationError(
                f"{what} is not a torch.save archive that loads safely ({type(exc).__name__}: {exc})"
            ) from None


def _check_zip(view: memoryview, what: str, storage_bytes: Optional[int]) -> None:
    import zipfile

    archive = zipfile.ZipFile(ViewFile(view))
    infos = archive.infolist()
    if len(infos) > _MAX_RECORDS:
        raise VerificationError(f"{what}: an archive of {len(infos)} records; refused")
    pickled, records, total = None, {}, 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size or info.flag_bits & 1:
            raise VerificationError(
                f"{what}: record {info.filename!r} is compressed or encrypted ({info.file_size} "
                f"bytes unpacked from {info.compress_size}); torch.save never writes one, refused"
            )
        if info.header_offset + info.file_size > len(view):
            raise VerificationError(f"{what}: record {info.filename!r} lies outside the item")
        total += info.file_size
        rest = info.filename.partition("/")[2]
        if rest == "data.pkl":
            pickled = info
        elif rest.startswith("data/"):
            records[rest[len("data/") :]] = info.file_size
    if total > len(view):
        raise VerificationError(f"{what}: its records claim {total} bytes in an item of {len(view)}")
    if pickled is None:
        raise VerificationError(f"{what}: no data.pkl record (not a torch.save archive)")
    if storage_bytes is not None and sum(records.values()) != storage_bytes:
        raise VerificationError(
            f"{what}: holds {sum(records.values())} bytes of tensor data, its metadata says {storage_bytes}; refused"
        )
    raw = archive.read(pickled)

    def storage(pid: Any) -> Any:
        typ, key, numel = _storage_pid(pid, 5, what)
        if records.get(key) != numel * typ.itemsize:
            raise VerificationError(
                f"{what}: storage {key!r} holds {records.get(key)} bytes, its pickle says "
                f"{numel * typ.itemsize}; refused"
            )
        return _DryStorage(numel * typ.itemsize, typ.itemsize)

    AllowList(io.BytesIO(raw), _archive_global, what, Budget(len(view), what), storage).load()


def _check_legacy(view: memoryview, what: str, storage_bytes: Optional[int]) -> None:
    """``torch.save(..., _use_new_zipfile_serialization=False)`` (how plain pickle stores a tensor's
    storage): magic, protocol, system info, the object, the storage keys, then raw storages."""
    f = ViewFile(view)
    budget = Budget(len(view), what)
    claimed = [0]

    def storage(pid: Any) -> Any:
        typ, _, numel = _storage_pid(pid, 6, what)
        claimed[0] += numel * typ.itemsize
        if claimed[0] > len(view):
            raise VerificationError(f"{what}: its storages claim {claimed[0]} bytes in an item of {len(view)}; refused")
        return _DryStorage(numel * typ.itemsize, typ.itemsize)

    for _ in range(3):  # magic number, protocol version, system info: plain values
        AllowList(f, _value_global, what, budget).load()
    AllowList(f, _archive_global, what, budget, storage).load()
    AllowList(f, _value_global, what, budget).load()
    if storage_bytes is not None and claimed[0] != storage_bytes:
        raise VerificationError(
            f"{what}: holds {claimed[0]} bytes of tensor data, its metadata says {storage_bytes}; refused"
        )


class _StorageType:
    """Stands in for ``torch.FloatStorage`` & co. in a checked pickle: named, never called."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise VerificationError("a torch.save archive that constructs a storage itself; refused")


class _DryStorage:
    def __init__(self, nbytes: int, itemsize: int) -> None:
        self.nbytes, self.itemsize = nbytes, itemsize


class _DryTensor:
    pass


def _storage_pid(pid: Any, arity: int, what: str) -> tuple[_StorageType, str, int]:
    if not (isinstance(pid, tuple) and len(pid) == arity and pid[0] == "storage"):
        raise VerificationError(f"{what}: a persistent reference that is not a storage; refused")
    typ, key, numel = pid[1], pid[2], pid[4]
    if not isinstance(typ, _StorageType) or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise VerificationError(f"{what}: a malformed storage reference; refused")
    return typ, key, numel


def _dry_rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _DryTensor:
    """``torch._utils._rebuild_tensor{,_v2,_v3}`` in a checked pickle: the view must fit its storage."""
    import torch

    dims = (size, stride)
    if (
        not isinstance(storage, _DryStorage)
        or not isinstance(offset, int)
        or offset < 0
        or not all(isinstance(t, tuple) and all(isinstance(d, int) and d >= 0 for d in t) for t in dims)
        or len(size) != len(stride)
    ):
        raise VerificationError("a tensor whose storage, offset, size or stride is malformed")
    itemsize = storage.itemsize
    if len(rest) >= 3 and isinstance(rest[2], torch.dtype):  # _rebuild_tensor_v3: an untyped storage and a dtype
        itemsize = rest[2].itemsize
    elements = storage.nbytes // max(itemsize, 1)
    extent = 0 if 0 in size else offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    if extent > elements:
        raise VerificationError(f"a tensor view of {extent} elements on a storage of {elements}")
    return _DryTensor()


def _dry_first(data: Any, *rest: Any) -> Any:
    return data


def _archive_global(module: str, name: str) -> Any:
    """What a ``torch.save`` archive's pickle may name, with stand-ins for storages and tensors."""
    import torch

    if module == "torch._utils" and name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"):
        return _dry_rebuild_tensor
    if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        return _dry_first
    if (module, name) == ("torch.storage", "UntypedStorage"):
        return _StorageType(1)
    if module == "torch" and name.endswith("Storage") and not name.startswith("_"):
        cls = getattr(torch, name, None)
        dtype = getattr(cls, "_dtype", None)  # (``cls.dtype`` warns that TypedStorage is deprecated)
        if isinstance(cls, type) and issubclass(cls, torch.storage._LegacyStorage) and isinstance(dtype, torch.dtype):
            return _StorageType(dtype.itemsize)
        return None
    if (module, name) == ("_codecs", "encode"):
        import codecs

        return codecs.encode
    if (module, name) in (
        ("torch.storage", "_load_from_bytes"),
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
    ):
        return None
    return _value_global(module, name)
