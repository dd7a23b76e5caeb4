"""Staging: copy the live state into CPU buffers that are allocated once and reused.

``save()`` blocks only for this copy. Buffers are keyed by the path of each tensor in the
state tree; a later save with the same structure reuses every buffer and allocates nothing.
When a source tensor lives on an accelerator the buffers are pinned and the copies run on a
side stream, synchronised before ``save`` returns, so the snapshot never aliases live memory.
"""

from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Optional

import numpy as np
import torch
from torch.distributed.tensor import DTensor


class StagingBuffers:
    """One set of reusable CPU buffers for one in-flight version."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # buffers created over the life of this set (not re-created ones)
        self.reallocations = 0  # buffers re-created because a tensor changed shape or dtype
        self._stream = None  # side stream for device-to-host copies, created on first GPU save
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # host copies, run together

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def stage(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors are these buffers, filled from the live tensors."""
        device = _first_device(tree)
        stream = None
        if device is not None and device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        self._pending = []
        with ctx:
            staged = self._stage(tree, "")
        pending, self._pending = self._pending, []
        copy_parallel(pending)
        if stream is not None:
            stream.synchronize()
        return staged

    def _stage(self, obj: Any, path: str) -> Any:
        if isinstance(obj, DTensor):
            local = self._copy(obj._local_tensor, path)
            return DTensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.size(), stride=obj.stride()
            )
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path)
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and any(_has_tensor(v) for v in obj):
            staged = [self._stage(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return staged if isinstance(obj, list) else type(obj)(staged)
        # Small non-tensor values (param_groups, counters): a deep copy is the snapshot.
        return copy.deepcopy(obj)

    def _copy(self, src: torch.Tensor, path: str) -> torch.Tensor:
        src = src.detach()
        if any(stride == 0 and size > 1 for stride, size in zip(src.stride(), src.shape)):
            # Loading writes into the live tensor, and a tensor whose elements share memory
            # cannot be written (torch refuses it in load_state_dict too): refuse it now.
            raise ValueError(
                f"tensor {path.strip('/').replace('/', '.')!r} (shape {tuple(src.shape)}, stride "
                f"{tuple(src.stride())}) is an expand()ed view whose elements share memory: it can be saved but "
                f"never restored in place. Register it as a real tensor (.clone() or .contiguous()), or as a "
                f"non-persistent buffer (register_buffer(..., persistent=False)) if it is derived")
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            if buf is not None:
                self.reallocations += 1
            else:
                self.allocations += 1
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.device.type == "cuda")
            self._buffers[path] = buf
        if src.device.type == "cpu":
            if _raw_copyable(buf, src):
                self._pending.append((_bytes_of(buf), _bytes_of(src)))
            else:
                buf.copy_(src)
        else:
            buf.copy_(src, non_blocking=True)
        return buf


COPY_CHUNK_BYTES = 8 << 20
_copy_pool: Optional[ThreadPoolExecutor] = None
_copy_pool_lock = threading.Lock()


def copy_parallel(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each ``(dst, src)`` pair of byte arrays, split into 8 MiB chunks over this
    process's intra-op threads (``torch.get_num_threads()``; the caller's thread is one).

    Why not ``Tensor.copy_``: it is as fast on an idle machine (it parallelises too), but its
    OpenMP workers spin-wait, and when other processes hold the cores a copy of a few MB can
    take 10x longer (measured on a 2-core VM shared with test runs: 32 copies of 8 MB, 0.26 s
    with 2 threads vs 0.025 s with 1). These are plain memcpys in Python threads that sleep
    while they wait (numpy releases the GIL while copying)."""
    workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    total = sum(d.nbytes for d, _ in pairs)
    if workers == 1 or total < 2 * COPY_CHUNK_BYTES:
        for d, s in pairs:
            np.copyto(d, s)
        return
    lanes: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(workers)]
    done = 0
    for d, s in pairs:
        for off in range(0, d.nbytes, COPY_CHUNK_BYTES):
            piece = (d[off : off + COPY_CHUNK_BYTES], s[off : off + COPY_CHUNK_BYTES])
            lanes[min(workers - 1, done * workers // total)].append(piece)
            done += piece[0].nbytes
    futures = [_pool(workers - 1).submit(_copy_lane, lane) for lane in lanes[1:] if lane]
    try:
        _copy_lane(lanes[0])
    finally:
        for f in futures:
            f.result()


def _copy_lane(lane: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in lane:
        np.copyto(d, s)


def _pool(size: int) -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool._max_workers < size:
            _copy_pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="gemini-ckpt-copy")
        return _copy_pool


def _raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    # Conjugate and negative views hold other bytes than they read as: Tensor.copy_ resolves them.
    return (src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous() and src.numel() > 0
            and not src.is_conj() and not src.is_neg())


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, DTensor):
        return obj._local_tensor.device
    if isinstance(obj, torch.Tensor):
        return obj.device
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        d = _first_device(v)
        if d is not None and d.type != "cpu":
            return d
    return None


class StagingPool:
    """``max_inflight`` buffer sets; a set is busy from staging until its bytes are serialized."""

    def __init__(self, size: int) -> None:
        self._free = [StagingBuffers() for _ in range(size)]
        self.sets = list(self._free)

    def acquire(self) -> StagingBuffers:
        return self._free.pop(0)

    def release(self, buffers: StagingBuffers) -> None:
        self._free.append(buffers)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)

    @property
    def allocations(self) -> int:
        return sum(s.allocations + s.reallocations for s in self.sets)
