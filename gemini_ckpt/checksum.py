"""Checksums of byte ranges: CRC32C (the Castagnoli polynomial, iSCSI's CRC).

Two implementations compute the same function. ``fastcrc`` folds the data with the CPU's
carry-less multiply: on bytes already in the CPU's cache it is several times faster than
``crc32c``'s CRC32 instruction, so checking what was just copied costs little beside the copy
(from memory both go at the memory bus's speed; docs/recovery.md has the numbers). ``fastcrc``
is used when it imports and agrees with ``crc32c`` on a test vector, else ``crc32c``;
:data:`IMPLEMENTATION` says which. Both release the GIL.
"""

from __future__ import annotations

import crc32c as _crc32c


def _crc32c_value(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def _pick():
    try:
        from fastcrc import crc32 as _fast
    except ImportError:
        return _crc32c_value, "crc32c"
    probe = bytes(range(256)) * 33 + b"gemini"
    split = 1000
    try:
        agrees = (
            _fast.iscsi(probe) == _crc32c.crc32c(probe)
            and _fast.iscsi(probe[split:], _fast.iscsi(probe[:split])) == _crc32c.crc32c(probe)
            and _fast.iscsi(b"", 7) == 7
        )
    except (TypeError, ValueError):
        agrees = False
    if not agrees:
        return _crc32c_value, "crc32c"
    return _fast.iscsi, "fastcrc"


_checksum, IMPLEMENTATION = _pick()


def checksum(data, value: int = 0) -> int:
    """CRC32C of a bytes-like object (bytes, memoryview, C-contiguous numpy uint8 array);
    ``value``: the CRC32C of the bytes before it (a running checksum, a block at a time).
    Releases the GIL while it runs."""
    return _checksum(data, value)
