"""The checksum every record and check uses is CRC32C, whichever implementation computes it."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from gemini_ckpt import checksum as checksum_module
from gemini_ckpt.checksum import checksum


def test_the_fast_implementation_is_used_where_it_is_installed():
    pytest.importorskip("fastcrc")
    assert checksum_module.IMPLEMENTATION == "fastcrc"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 64, 4095, 1 << 20, (3 << 20) + 5])
def test_checksum_is_crc32c_of_any_buffer_whole_and_block_by_block(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    expected = crc32c.crc32c(data)
    assert checksum(data) == expected
    assert checksum(memoryview(data)) == expected
    assert checksum(data.tobytes()) == expected
    running = 0
    for at in range(0, nbytes, 65_537):
        running = checksum(data[at : at + 65_537], running)
    assert running == expected


def test_a_damaged_byte_changes_the_checksum():
    data = np.zeros(1 << 16, np.uint8)
    before = checksum(data)
    data[12_345] ^= 0x10
    assert checksum(data) != before
