"""Checksums of byte ranges (CRC32C, hardware accelerated where the CPU has it)."""

from __future__ import annotations

import crc32c as _crc32c


def checksum(data) -> int:
    """CRC32C of a bytes-like object (bytes, memoryview, contiguous numpy uint8 array)."""
    return _crc32c.crc32c(data)
