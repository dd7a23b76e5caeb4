"""Allow-listed, budgeted unpickling: the decoder every pickle from storage or a peer goes through.

:func:`safe_load` (used by :mod:`gemini_ckpt.trust` for DCP ``.metadata``, our opaque values
and the pickle inside a ``torch.save`` archive) resolves only the globals its caller allows, and
charges every allow-listed call whose result grows with its arguments (``bytearray(n)``,
containers, ``range``, ``torch.Size``, tensors, NumPy arrays) to a budget from the bytes
decoded: a 48-byte pickle calling ``bytearray(10**9)`` is refused before the call, not after
the allocation. NumPy object arrays are refused outright (NumPy crashes on crafted ones).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import pickle
from collections.abc import Callable
from typing import Any, Optional

from .errors import VerificationError

_RECONSTRUCT_MODULE = "numpy._core.multiarray"  # where ``numpy`` keeps ``_reconstruct`` (array pickles)

# --- allow-listed unpickling -------------------------------------------------------------------
_GROWTH, _FLOOR = 16, 1 << 20
"""What decoding ``n`` recorded bytes may allocate through allow-listed calls: ``16 n + 1 MiB``.
A legitimate pickle's calls build objects from what the pickle itself holds (a few bytes per
element at the least), so they stay far below; ``bytearray(10**9)`` in 48 bytes does not."""


class Budget:
    """What one decode may still allocate through calls (see ``_GROWTH``)."""

    def __init__(self, nbytes: int, what: str) -> None:
        self.nbytes, self.what = nbytes, what
        self.limit, self.used = _GROWTH * nbytes + _FLOOR, 0

    def charge(self, n: int, fn: Any) -> None:
        self.used += n
        if self.used > self.limit:
            raise VerificationError(
                f"{self.what} would allocate about {self.used} bytes (calling {getattr(fn, '__qualname__', fn)}), "
                f"far more than its {self.nbytes} recorded bytes can hold ({self.limit} allowed); refused "
                f"(a crafted file?)"
            )


class _Counted:
    """An allow-listed callable whose result grows with its arguments (``bytearray(n)``,
    ``tuple(range(n))``, ``numpy.ndarray(shape)``): charged to the budget before it runs. Not a
    type, so NEWOBJ on it (never in a legitimate pickle of these) is refused too."""

    __slots__ = ("fn", "estimate", "budget", "by_length")

    def __init__(self, fn: Any, estimate: Callable, budget: Budget) -> None:
        self.fn, self.estimate, self.budget = fn, estimate, budget
        self.by_length = estimate is _by_length

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.by_length and not kwargs and len(args) == 1 and type(args[0]) in (tuple, list):
            # the common case, kept cheap (``torch.Size((512, 512))`` for every chunk of a metadata)
            budget = self.budget
            budget.used += 8 * len(args[0])
            if budget.used > budget.limit:
                budget.charge(0, self.fn)
            return self.fn(args[0])
        args = tuple(a.fn if isinstance(a, _Counted) else a for a in args)
        kwargs = {k: v.fn if isinstance(v, _Counted) else v for k, v in kwargs.items()}
        try:
            cost = self.estimate(self.fn, args, kwargs)
        except VerificationError as exc:
            raise VerificationError(f"{self.budget.what}: {exc}") from None
        self.budget.charge(cost, self.fn)
        return self.fn(*args, **kwargs)


def _length(a: Any) -> int:
    try:
        return len(a)
    except (TypeError, OverflowError):  # unsized, or a range too long to count
        return 0 if not isinstance(a, range) else 1 << 62


def _by_length(fn: Any, args: tuple, kwargs: dict) -> int:
    n = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, bool):
            continue
        if isinstance(a, int):
            n += max(a, 0) if fn in (bytes, bytearray) else 0  # bytes(n); a deque's maxlen allocates nothing
        elif isinstance(a, range):
            n += 48 * _length(a)  # every element becomes an int object
        else:
            n += (1 if fn in (bytes, bytearray) else 8) * _length(a)
    return n


def _elements(shape: Any) -> int:
    dims = (shape,) if isinstance(shape, int) else shape if isinstance(shape, (tuple, list)) else ()
    total = 1
    for d in dims:
        if isinstance(d, int) and not isinstance(d, bool):
            total *= max(d, 0)
            total = min(total, 1 << 62)
    return total


def _by_shape(position: int) -> Callable:
    def estimate(fn: Any, args: tuple, kwargs: dict) -> int:
        shape = args[position] if len(args) > position else kwargs.get("shape", ())
        return 16 * _elements(shape)

    return estimate


def _by_sizes(fn: Any, args: tuple, kwargs: dict) -> int:
    """``torch.Tensor(*sizes)`` or ``torch.Tensor(sequence)``."""
    if args and all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        return 16 * _elements(args)
    return 16 * sum(_length(a) for a in args)


def _by_dtype(fn: Any, args: tuple, kwargs: dict) -> int:
    """A numpy dtype costs its item size (a subarray dtype can be gigabytes per element); one
    holding Python objects is refused: numpy crashes the process on a crafted object array."""
    dtype = fn(*args, **kwargs)  # a dtype is a small descriptor: building it to look is cheap
    if dtype.hasobject:
        raise VerificationError(
            "a numpy array of Python objects (dtype 'O'), which numpy cannot decode safely "
            "from crafted bytes; refused (keep such values as lists in TrainState.extra)"
        )
    return dtype.itemsize


_counted: Optional[dict] = None


def _counted_calls() -> dict:
    """Allow-listed callables that allocate in proportion to their arguments, and how much."""
    global _counted
    if _counted is None:
        import codecs
        import collections

        import numpy as np
        import torch

        table: dict = {
            t: _by_length
            for t in (
                bytes,
                bytearray,
                list,
                tuple,
                set,
                frozenset,
                dict,
                str,
                collections.OrderedDict,
                collections.defaultdict,
                collections.deque,
                collections.Counter,
                torch.Size,
                codecs.encode,
            )
        }
        table[np.ndarray] = _by_shape(0)
        table[np.dtype] = _by_dtype
        table[importlib.import_module(_RECONSTRUCT_MODULE)._reconstruct] = _by_shape(1)
        table[torch.Tensor] = _by_sizes
        _counted = table
    return _counted


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """Protocol-2 pickles (``torch.save``'s) name builtins as Python 2 did (``__builtin__``)."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class AllowList(pickle.Unpickler):
    """An unpickler that resolves only the globals ``allowed`` maps (module, name) to, and
    charges what growing calls allocate to ``budget``; persistent ids only through ``persistent``."""

    def __init__(
        self,
        file: Any,
        allowed: Callable[[str, str], Any],
        what: str,
        budget: Budget,
        persistent: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        super().__init__(file)
        self._allowed, self._what, self._budget, self._persistent = allowed, what, budget, persistent

    def find_class(self, module: str, name: str) -> Any:
        module, name = _py3_name(module, name)
        obj = self._allowed(module, name)
        if obj is None:
            raise VerificationError(
                f"{self._what} refers to {module}.{name}, which is not allow-listed; "
                f"refusing to load it (a crafted or foreign file?)"
            )
        try:
            estimate = _counted_calls().get(obj)
        except TypeError:  # unhashable: nothing we count
            estimate = None
        return obj if estimate is None else _Counted(obj, estimate, self._budget)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise VerificationError(f"{self._what} holds a persistent reference; refusing to load it")
        return self._persistent(pid)


def safe_load(data: bytes, allowed: Callable[[str, str], Any], what: str) -> Any:
    with no_gc():
        try:
            return AllowList(io.BytesIO(data), allowed, what, Budget(len(data), what)).load()
        except VerificationError:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure of hostile bytes means "damaged"
            raise VerificationError(f"{what} cannot be decoded ({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector off inside the block (restore, and decoding pickles that
    build thousands of small objects): an allocation burst otherwise triggers a full collection,
    which walks every object of the process and in a Ray Train worker can cost more than the
    whole restore of a small job's state (measured in docs/recovery.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
