"""Kept mappings: a process that maps a store's segment again gets the mapping it let go of
(same memory, no new mmap), never another segment's, and lets go of it when it expires."""

from __future__ import annotations

import os
import time

import numpy as np

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
    assert len(kept) == 0 and first.fd is None
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
    assert len(kept) == 2 and mapped[0].fd is None  # the oldest went
    deadline = time.monotonic() + 10
    while len(kept) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kept) == 0 and all(m.fd is None for m in mapped)
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
