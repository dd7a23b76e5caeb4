"""Staging: the one copy ``save()`` makes, from the live tensors into a store-owned segment.

Each tensor item of the plan has a fixed place in the segment (see
:mod:`gemini_ckpt.format.shards`); the copy is all the training process does per version.
CPU tensors are copied as 8 MiB memcpys spread over this process's intra-op threads. Tensors
on an accelerator are copied on a side stream into the segment, which is pinned (registered
with CUDA) the first time it is used that way, and the stream is synchronised before
``save`` returns, so the snapshot never aliases live memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from ..format.segments import Segment
from ..format.shards import ShardPlan
from ..state.dcp import torch_dtype

log = logging.getLogger("gemini_ckpt")

COPY_CHUNK_BYTES = 8 << 20


def segment_views(plan: ShardPlan, segment: Segment) -> list[torch.Tensor]:
    """One tensor per tensor item of ``plan``, viewing its place in ``segment``."""
    base = torch.from_numpy(segment.array)
    out = []
    for t in plan.tensors:
        out.append(base[t.at : t.at + t.nbytes].view(torch_dtype(t.dtype)).reshape(t.shape))
    return out


class Stager:
    """Copies a version's tensors into segments, reusing each segment's views."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._pairs: dict[tuple, tuple[list, list]] = {}  # (segment, plan, generation) -> copies
        self._pinned: set[int] = set()
        self._stream = None

    def stage(
        self,
        plan: ShardPlan,
        segment: Segment,
        tensors: list[torch.Tensor],
        *,
        generation: Optional[int] = None,
        volatile: tuple[int, ...] = (),
    ) -> None:
        """Copy ``tensors`` (one per tensor item of ``plan``) into ``segment``. With a
        ``generation`` (the sources' cache generation: the same tensors as last time, except the
        ``volatile`` items), the memcpy pairs of the last version into this segment are reused."""
        key = (segment.id, plan.plan_id)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = segment_views(plan, segment)
        if generation is not None and all(t.device.type == "cpu" for t in tensors[:1]):
            cached = self._pairs.get((segment.id, plan.plan_id, generation))
            if cached is not None:
                pairs, slow = cached
                fresh = [(i, views[i], tensors[i].detach()) for i in volatile]
                extra = [(_bytes_of(d), _bytes_of(t)) for _, d, t in fresh if _raw_copyable(d, t)]
                for _, d, t in fresh:
                    if not _raw_copyable(d, t):
                        d.copy_(t)
                for i in slow:
                    views[i].copy_(tensors[i].detach())
                copy_parallel(pairs + extra)
                return
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        stream = None
        if device is not None and device.type == "cuda":
            self._pin(segment)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(device))
        pairs, cached_pairs, slow = [], [], []
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for i, (dst, src) in enumerate(zip(views, tensors)):
                src = src.detach()
                if src.device.type == "cpu":
                    if _raw_copyable(dst, src):
                        pair = (_bytes_of(dst), _bytes_of(src))
                        pairs.append(pair)
                        if i not in volatile:
                            cached_pairs.append(pair)
                    else:
                        dst.copy_(src)
                        if i not in volatile:
                            slow.append(i)
                else:
                    dst.copy_(src, non_blocking=stream is not None and segment.id in self._pinned)
        copy_parallel(pairs)
        if stream is not None:
            stream.synchronize()
        elif generation is not None:
            for k in [k for k in self._pairs if k[0] == segment.id or k[2] != generation]:
                del self._pairs[k]
            self._pairs[(segment.id, plan.plan_id, generation)] = (cached_pairs, slow)

    def copy_items(
        self, plan: ShardPlan, segment: Segment, tensors: list[torch.Tensor], items: list[int], *, after=None
    ) -> None:
        """Copy only the tensor items ``items`` into ``segment``, uncached (the overlapped
        staging: part now, the rest on the copying thread). ``after``: a CUDA event recorded on
        the training stream when the sources were final; the device copies wait for it."""
        key = (segment.id, plan.plan_id)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = segment_views(plan, segment)
        pairs, device_items = [], []
        for i in items:
            src = tensors[i].detach()
            if src.device.type != "cpu":
                device_items.append(i)
            elif _raw_copyable(views[i], src):
                pairs.append((_bytes_of(views[i]), _bytes_of(src)))
            else:
                views[i].copy_(src)
        copy_parallel(pairs)
        if device_items:
            self._pin(segment)
            device = tensors[device_items[0]].device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            if after is not None:
                self._stream.wait_event(after)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for i in device_items:
                    views[i].copy_(tensors[i].detach(), non_blocking=segment.id in self._pinned)
            self._stream.synchronize()

    def forget(self, segment_id: int) -> None:
        """Drop the views of a segment its store took back (before it is unmapped)."""
        for key in [k for k in self._views if k[0] == segment_id]:
            del self._views[key]
        for key in [k for k in self._pairs if k[0] == segment_id]:
            del self._pairs[key]
        self._pinned.discard(segment_id)

    def _pin(self, segment: Segment) -> None:
        if segment.id in self._pinned or not segment.nbytes:
            return
        try:
            ptr = segment.array.ctypes.data
            err = torch.cuda.cudart().cudaHostRegister(ptr, segment.nbytes, 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")
            self._pinned.add(segment.id)
        except Exception as exc:  # noqa: BLE001 - unpinned memory still copies, synchronously
            log.warning(
                "could not pin a staging segment of %d bytes (%s); device copies are synchronous", segment.nbytes, exc
            )
            self._pinned.add(-segment.id)


def check_saveable(name: str, tensor: torch.Tensor) -> None:
    """Refuse what can be saved but never restored in place (checked when sources change)."""
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape)):
        raise ValueError(
            f"tensor {name!r} (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}) is an expand()ed view "
            f"whose elements share memory: it can be saved but never restored in place. Register it as a real "
            f"tensor (.clone() or .contiguous()), or as a non-persistent buffer "
            f"(register_buffer(..., persistent=False)) if it is derived"
        )


_copy_pool: Optional[ThreadPoolExecutor] = None
_copy_pool_lock = threading.Lock()


def copy_parallel(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each ``(dst, src)`` pair of byte arrays, split into 8 MiB chunks over this
    process's intra-op threads (``torch.get_num_threads()``; the caller's thread is one).

    Why not ``Tensor.copy_``: it is as fast on an idle machine (it parallelises too), but its
    OpenMP workers spin-wait, and when other processes hold the cores a copy of a few MB takes
    many times longer (docs/dataplane.md). These are plain memcpys in Python threads that sleep
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
    return (
        src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.numel() > 0
        and not src.is_conj()
        and not src.is_neg()
        and src.shape == dst.shape
    )


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()
