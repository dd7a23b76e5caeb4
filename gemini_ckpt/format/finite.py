"""The tensor health check on raw bytes: is every value of a floating-point item finite? No torch.

Runs where a shard's checksums are computed (the host store, the local tier's thread), on
the bytes of the staged region: NumPy reductions over chunks of :data:`CHUNK` bytes, so no
full-size temporary is ever allocated.

- fp32 and fp64: ``min`` and ``max`` of each chunk (NaN propagates through both; +-Inf shows
  as an extreme), no temporary at all. Fused with the checksum, an fp32 chunk is first read
  once instead, as the dot product with itself (BLAS; a NaN or an Inf makes it NaN or Inf), and
  only a chunk whose sum is not finite (poisoned, or large finite values that overflowed) is
  checked again exactly;
- fp16 and bf16 (NumPy has no bf16, and its fp16 arithmetic is slow): the raw bits, viewed as
  uint16, with the sign cleared into a reused chunk-sized buffer: a magnitude at or above the
  all-ones exponent (``0x7C00``, ``0x7F80``) is an Inf or a NaN.

Two ways to combine it with the checksum (:func:`checksum_items`): **fused** (each chunk
checksummed and checked while it is in the CPU's cache: one read of the region, the least CPU;
for a host store that copies the shard to other holders, which takes longer than both) or
**beside** it (the check on a second thread while the caller checksums: the least latency, where
the record is the version's whole time-to-safe: the local tier, a host store with
``replicas=1``). Beside, the checking thread also reads :data:`CHUNK` at a time, each chunk once
(the dot product; min and max again only for a chunk whose sum is not finite), so the two threads
together read the region from memory about once: whole 16 MiB items reduced by ``max`` then
``min`` were read twice, which on a host with less memory bandwidth made the check cost more
than the checksums. Beside, the checking thread takes the last items' checksums once its check
is done (the check reads faster than CRC32C), so the record is not held up by one thread while
the other idles. What each way costs is measured in docs/health.md
(``benchmarks/bench_health.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..checksum import checksum

CHUNK = 4 << 20
"""Bytes checksummed and checked per step when fused: fits the CPU's cache, so each chunk is read
from memory once, and few enough steps per GiB that the GIL, taken back after each, is rarely
in the way of the store's data-plane threads (1 MiB steps took the same CPU)."""
BESIDE_CHUNK = 16 << 20
"""Bytes of a 16-bit item checked per step beside the checksums (through the scratch buffer): large,
so the checking thread takes the GIL back rarely (each time it does, it can delay the training
thread). fp32/fp64 items go by :data:`CHUNK`, read once each."""

BESIDE_MIN_BYTES = 8 << 20
"""Below this many checked bytes the check is fused even when a thread is offered: handing work
to another thread and back costs more than checking a few MiB."""

_FLOATS = {"float32": np.float32, "float64": np.float64}
_HALVES = {"float16": 0x7C00, "bfloat16": 0x7F80}  # the all-ones exponent of the 16-bit formats
CHECKED_DTYPES = frozenset(_FLOATS) | frozenset(_HALVES)
"""Item dtypes (torch's names) the tensor check reads; other items are skipped."""
NAN_BITS = {
    "float32": np.array([np.nan], np.float32).tobytes(),
    "float64": np.array([np.nan], np.float64).tobytes(),
    "float16": np.array([0x7E00], np.uint16).tobytes(),
    "bfloat16": np.array([0x7FC0], np.uint16).tobytes(),
}
"""The bytes of one quiet NaN in each checked format (little-endian): what a test or the chaos
harness writes to poison a value (``gemini_ckpt.chaos.damage_copy(..., data=NAN_BITS[dtype])``)."""


@dataclass(frozen=True)
class NotFinite:
    """The first item of a shard with a value that is not finite, and how many there are."""

    item: int  # index into the plan's tensor items
    nan: int
    pos_inf: int
    neg_inf: int
    count: int  # values in the item
    first: int  # index of the first one

    @property
    def detail(self) -> str:
        parts = [
            f"{n:,} {what}" for n, what in ((self.nan, "NaN"), (self.pos_inf, "+Inf"), (self.neg_inf, "-Inf")) if n
        ]
        return f"{', '.join(parts)} of {self.count:,} values, the first at flat index {self.first:,}"


class _Scanner:
    """Checks chunks of one dtype, reusing one scratch buffer (16-bit formats)."""

    def __init__(self, dtype: str, chunk: int = CHUNK, *, one_pass: bool = False) -> None:
        self.dtype = dtype
        self._one_pass = one_pass and dtype == "float32"
        self._float = _FLOATS.get(dtype)
        self._exponent = _HALVES.get(dtype)
        self._scratch = np.empty(chunk // 2, np.uint16) if self._exponent is not None else None

    def finite(self, chunk: np.ndarray) -> bool:
        """``chunk``: uint8, a whole number of values, aligned to them."""
        if not chunk.nbytes:
            return True
        if self._float is not None:
            values = chunk.view(self._float)
            # sdot reads the chunk once where min and max read it twice, fused and beside alike
            # (see the module docstring); min and max only for a chunk whose sum is not finite.
            # Not for fp64: BLAS may spread a long ddot over threads of its own.
            if self._one_pass and np.isfinite(np.dot(values, values)):
                return True
            return bool(np.isfinite(values.max()) and np.isfinite(values.min()))
        bits = chunk.view(np.uint16)
        magnitude = self._scratch[: bits.size]
        np.bitwise_and(bits, 0x7FFF, out=magnitude)
        return int(magnitude.max()) < self._exponent


def describe(raw: np.ndarray, dtype: str, item: int) -> NotFinite:
    """Count the NaN and +-Inf values of one item (only for an item already found not finite),
    chunk by chunk like the check."""
    size = np.dtype(_FLOATS.get(dtype, np.uint16)).itemsize
    nan = pos = neg = 0
    first = -1
    for start in range(0, raw.nbytes, CHUNK):
        chunk = raw[start : start + CHUNK]
        if dtype in _FLOATS:
            values = chunk.view(_FLOATS[dtype])
            is_nan, is_inf = np.isnan(values), np.isinf(values)
            positive = values > 0
        else:
            bits = chunk.view(np.uint16)
            magnitude = bits & 0x7FFF
            is_nan, is_inf = magnitude > _HALVES[dtype], magnitude == _HALVES[dtype]
            positive = bits < 0x8000
        bad = is_nan | is_inf
        if first < 0 and bad.any():
            first = start // size + int(np.argmax(bad))
        nan += int(np.count_nonzero(is_nan))
        pos += int(np.count_nonzero(is_inf & positive))
        neg += int(np.count_nonzero(is_inf & ~positive))
    return NotFinite(item, nan, pos, neg, raw.nbytes // size, max(first, 0))


def _fused(raw: np.ndarray, scanner: Optional[_Scanner]) -> tuple[int, bool]:
    crc, finite = 0, True
    for start in range(0, raw.nbytes, CHUNK):
        chunk = raw[start : start + CHUNK]
        crc = checksum(chunk, crc)
        if finite and scanner is not None:
            finite = scanner.finite(chunk)
    return crc, finite


def _scan(region: np.ndarray, items: Sequence[tuple[int, int, int, str]]) -> Optional[int]:
    """The first of ``items`` (index, at, nbytes, dtype) with a value that is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):  # per thread: a NaN or an overflow is an answer here
        return _scan_items(region, items)


def _scan_items(region: np.ndarray, items: Sequence[tuple[int, int, int, str]]) -> Optional[int]:
    scanners: dict[str, _Scanner] = {}
    for index, at, nbytes, dtype in items:
        scanner = scanners.setdefault(dtype, _Scanner(dtype, BESIDE_CHUNK, one_pass=True))
        raw = region[at : at + nbytes]
        step = CHUNK if dtype in _FLOATS else BESIDE_CHUNK
        for start in range(0, nbytes, max(step, 1)):
            if not scanner.finite(raw[start : start + step]):
                return index
    return None


class _Shared:
    """The checksums of one region, shared out item by item between the caller's thread (from the
    front) and the checking thread once its check is done (from the back): the check's thread
    would otherwise sit idle while the checksums finish, and the record waits for both."""

    def __init__(self, region: np.ndarray, items: Sequence[tuple[int, int, str]]) -> None:
        self.region, self.items = region, items
        self.crcs: list[Optional[int]] = [None] * len(items)
        self._lock = threading.Lock()
        self._front, self._back = 0, len(items)  # items [front, back) are nobody's yet

    def _take(self, front: bool) -> Optional[int]:
        with self._lock:
            if self._front >= self._back:
                return None
            if front:
                self._front += 1
                return self._front - 1
            self._back -= 1
            return self._back

    def checksum_from_the_front(self) -> None:
        self._checksum(front=True)

    def checksum_from_the_back(self) -> None:
        self._checksum(front=False)

    def _checksum(self, *, front: bool) -> None:
        while (i := self._take(front)) is not None:
            at, n, _ = self.items[i]
            self.crcs[i] = checksum(self.region[at : at + n])


def _scan_then_help(shared: _Shared, todo: Sequence[tuple[int, int, int, str]]) -> Optional[int]:
    bad = _scan(shared.region, todo)
    shared.checksum_from_the_back()
    return bad


def checksum_items(
    region: np.ndarray,
    items: Sequence[tuple[int, int, str]],
    checked: Sequence[int],
    *,
    beside: Optional[Executor] = None,
) -> tuple[tuple[int, ...], Optional[NotFinite]]:
    """CRC32C of every item ``(at, nbytes, dtype)`` of ``region`` (uint8) and the first item of
    ``checked`` (indices; their dtypes in :data:`CHECKED_DTYPES`) that is not finite.

    ``beside``: run the check there, on another thread, while this one checksums (see the
    module docstring); else the check is fused with the checksum, chunk by chunk."""
    wanted = set(checked)
    if beside is not None and sum(items[i][1] for i in wanted) >= BESIDE_MIN_BYTES:
        todo = [(i, at, n, dtype) for i, (at, n, dtype) in enumerate(items) if i in wanted]
        shared = _Shared(region, items)
        scan = beside.submit(_scan_then_help, shared, todo)
        shared.checksum_from_the_front()
        bad = scan.result()
        crcs = tuple(shared.crcs)
    else:
        crcs_list, bad = [], None
        scanners: dict[str, _Scanner] = {}
        with np.errstate(over="ignore", invalid="ignore"):
            for i, (at, n, dtype) in enumerate(items):
                raw = region[at : at + n]
                if i in wanted and bad is None:
                    crc, finite = _fused(raw, scanners.setdefault(dtype, _Scanner(dtype, one_pass=True)))
                    if not finite:
                        bad = i
                else:
                    crc = checksum(raw)
                crcs_list.append(crc)
        crcs = tuple(crcs_list)
    if bad is None:
        return crcs, None
    at, n, dtype = items[bad]
    return crcs, describe(region[at : at + n], dtype, bad)
