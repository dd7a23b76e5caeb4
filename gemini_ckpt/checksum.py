"""Checksums of byte ranges (CRC32C, hardware accelerated where the CPU has it)."""

from __future__ import annotations

import crc32c as _crc32c


def checksum(data, value: int = 0) -> int:
    """CRC32C of a bytes-like object (bytes, memoryview, contiguous numpy uint8 array);
    ``value``: the CRC32C of the bytes before it (a running checksum, a block at a time).
    Releases the GIL while it runs."""
    return _crc32c.crc32c(data, value)
