"""Kept mappings: a process that maps a store's segment again gets the mapping it let go of
(same memory, no new mmap), never another segment's, and lets go of it when it expires."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch

from gemini_ckpt.format.kept import KeptMappings
from gemini_ckpt.format.segments import Segment


def _store_segment(nbytes: int = 1 << 20, fill: int = 7) -> Segment:
    seg = Segment(nbytes, shared=True)
    seg.array[:] = fill
    return seg


def test_the_same_memory_mapped_again_is_the_kept_mapping_and_shows_what_the_store_writes():
    kept = KeptMappings()
    store = _store_segment()
    first = kept.map(os.dup(store.fd), store.nbytes, store.id, writable=False, populate=True)
    assert (first.array == 7).all()
    kept.keep(first)
    assert len(kept) == 1
    store.array[:4] = [1, 2, 3, 4]  # the store reuses the segment for another version
    again = kept.map(os.dup(store.fd), store.nbytes, 99, writable=False)
    assert again is first and kept.reused == 1 and len(kept) == 0
    assert again.id == 99  # the store's name for it now
    assert again.array[:4].tolist() == [1, 2, 3, 4]
    kept.keep(again)
    kept.clear()
    assert len(kept) == 0 and first.closed
    store.close()


def test_another_segment_or_a_writable_request_gets_a_mapping_of_its_own():
    kept = KeptMappings()
    a, b = _store_segment(fill=1), _store_segment(fill=2)
    read_a = kept.map(os.dup(a.fd), a.nbytes, a.id, writable=False)
    kept.keep(read_a)
    other = kept.map(os.dup(b.fd), b.nbytes, b.id)
    assert other is not read_a and (other.array == 2).all()
    staging = kept.map(os.dup(a.fd), a.nbytes, a.id, writable=True)  # a read-only mapping cannot stage
    assert staging is not read_a and kept.reused == 0
    staging.array[0] = 42
    assert read_a.array[0] == 42  # the same memory, through both
    for seg in (other, staging):
        seg.close()
    kept.clear()
    a.close()
    b.close()


def test_kept_mappings_expire_and_the_oldest_go_beyond_the_cap():
    kept = KeptMappings(keep_s=0.2, max_kept=2)
    segs = [_store_segment(1 << 16, fill=i) for i in range(3)]
    mapped = [kept.map(os.dup(s.fd), s.nbytes, s.id) for s in segs]
    for m in mapped:
        kept.keep(m)
    assert len(kept) == 2 and mapped[0].closed  # the oldest went
    deadline = time.monotonic() + 10
    while len(kept) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kept) == 0 and all(m.closed for m in mapped)
    for s in segs:
        s.close()


def test_a_dropped_mapping_is_not_handed_out_again():
    kept = KeptMappings()
    store = _store_segment()
    m = kept.map(os.dup(store.fd), store.nbytes, store.id)
    kept.keep(m)
    kept.drop(m)  # the store freed the segment
    again = kept.map(os.dup(store.fd), store.nbytes, store.id)
    assert again is not m and kept.reused == 0
    assert np.array_equal(again.array[:8], np.full(8, 7, np.uint8))
    again.close()
    store.close()


class _WhatAWorkerHolds(torch.utils.data.Dataset):
    """A forked DataLoader worker's view of the store memory it inherited: the mappings and
    open fds of memfds named like a store's segments."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict:
        with open("/proc/self/maps") as f:
            maps = [line for line in f if "gemini-ckpt-" in line]
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "gemini-ckpt-" in os.readlink(f"/proc/self/fd/{fd}"):
                    fds.append(fd)
            except OSError:
                pass  # the listing's own fd
        return {"maps": len(maps), "fds": len(fds)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK and /proc are Linux's")
def test_a_forked_dataloader_worker_holds_none_of_the_store_memory_a_trainer_maps():
    # A trainer maps store memory to stage and restore; its DataLoader workers (forked, living
    # for the whole epoch) must not keep that memory after the trainer and store let go of it.
    store = _store_segment()
    kept = KeptMappings()
    staging = kept.map(os.dup(store.fd), store.nbytes, store.id)
    reading = kept.map(os.dup(store.fd), store.nbytes, store.id, writable=False)
    kept.keep(reading)
    assert (staging.array == 7).all() and len(kept) == 1
    loader = torch.utils.data.DataLoader(
        _WhatAWorkerHolds(), num_workers=1, multiprocessing_context="fork", collate_fn=lambda b: b[0]
    )
    (held,) = list(loader)
    assert held == {"maps": 0, "fds": 0}
    # Here (the store's process too, in this test) the memory is still mapped: the store's
    # mapping and the trainer's two.
    with open("/proc/self/maps") as f:
        assert sum(f"gemini-ckpt-{store.id} " in line for line in f) == 3
    staging.close()
    kept.clear()
    store.close()
