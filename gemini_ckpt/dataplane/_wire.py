"""The TCP wire format: the handshake and the frames. Small on purpose; all big-endian.

Handshake (every stream, before any frame)::

    server -> client  HELLO_S  magic "GMTP" | version u8 | server nonce (32)
    client -> server  HELLO_C  magic | version | client nonce (32) | session id (16) | stream u16
                               | namespace (u16 len + utf-8) | client name (u16 len + utf-8)
                               | proof_c = HMAC-SHA256(secret, "client" | fields | both nonces)
    server -> client  VERDICT  status u8 (0 = accepted) | server name (u16 len + utf-8)
                               | proof_s = HMAC-SHA256(secret, "server" | fields | both nonces)

The server checks ``proof_c`` (constant-time) before it reads a single frame; the client checks
``proof_s`` before it writes one. Fresh nonces from both sides make every proof single-use, and
the role label keeps a proof from being reflected back. A refused client gets status 1 and no
proof. There is no encryption and no per-frame MAC: the secret keeps strangers (another job, a
port scanner, a zombie of another namespace) from writing into or reading from a host store;
it does not defend against an attacker who can rewrite packets on the wire.

Frames (after the handshake), a 16-byte prefix then a header then a payload::

    prefix   type u8 | 3 pad | header length u32 | payload length u64
    CHUNK    c->s  transfer id u64 | chunk offset u64 | chunk size u64 | Header; payload = bytes
    PROGRESS s->c  payload bytes received on this stream so far u64    (every ~50 ms of data)
    DONE     s->c  transfer id u64 | status u8 | message utf-8         (once per transfer)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Optional

from ._base import Header


class Fmt:
    """A ``struct`` format. Not a ``struct.Struct``: this package is pickled by value, and a
    module-level ``Struct`` cannot be (the ``struct`` module caches compiled formats anyway)."""

    __slots__ = ("fmt", "size")

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.size = struct.calcsize(fmt)

    def pack(self, *values) -> bytes:
        return struct.pack(self.fmt, *values)

    def unpack(self, buffer) -> tuple:
        return struct.unpack(self.fmt, buffer)

    def unpack_from(self, buffer, offset: int = 0) -> tuple:
        return struct.unpack_from(self.fmt, buffer, offset)


MAGIC = b"GMTP"
VERSION = 1
NONCE_BYTES = 32
SESSION_BYTES = 16
PROOF_BYTES = 32

HELLO_S = Fmt("!4sB32s")
HELLO_C_FIXED = Fmt("!4sB32s16sH")
VERDICT_STATUS = Fmt("!B")
ACCEPTED, REFUSED = 0, 1

PREFIX = Fmt("!B3xIQ")
CHUNK, PROGRESS, DONE = 1, 2, 3
MAX_FRAME_HEADER = 64 << 10

CHUNK_HEAD = Fmt("!QQQ")
PROGRESS_HEAD = Fmt("!Q")
DONE_HEAD = Fmt("!QB")
DONE_OK, DONE_REJECTED, DONE_CHECKSUM, DONE_PROTOCOL = 0, 1, 2, 3

_HEADER_FIXED = Fmt("!qQQqQB")  # step, offset, length, total (-1: none), checksum, has checksum
U16 = Fmt("!H")


def pack_str(value: str) -> bytes:
    data = value.encode()
    return U16.pack(len(data)) + data


def unpack_str(buf: bytes, pos: int) -> tuple[str, int]:
    (n,) = U16.unpack_from(buf, pos)
    pos += U16.size
    if pos + n > len(buf):
        raise ValueError("truncated string")
    return bytes(buf[pos : pos + n]).decode(), pos + n


def encode_header(h: Header) -> bytes:
    fixed = _HEADER_FIXED.pack(
        h.step, h.offset, h.length, -1 if h.total is None else h.total, h.checksum or 0, h.checksum is not None
    )
    return b"".join(
        [
            fixed,
            pack_str(h.namespace),
            pack_str(h.name),
            pack_str(h.put_id),
            pack_str(h.checksum_algo),
            U16.pack(len(h.meta)),
            h.meta,
        ]
    )


def decode_header(buf: bytes, pos: int = 0) -> Header:
    """Parse (and validate, through ``Header.__post_init__``) an encoded header; raises
    ``ValueError`` on anything malformed."""
    try:
        step, offset, length, total, checksum, has_checksum = _HEADER_FIXED.unpack_from(buf, pos)
        pos += _HEADER_FIXED.size
        namespace, pos = unpack_str(buf, pos)
        name, pos = unpack_str(buf, pos)
        put_id, pos = unpack_str(buf, pos)
        algo, pos = unpack_str(buf, pos)
        (n,) = U16.unpack_from(buf, pos)
        pos += U16.size
        meta = bytes(buf[pos : pos + n])
        if len(meta) != n or pos + n != len(buf):
            raise ValueError("header length does not match its fields")
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed header: {exc}") from None
    return Header(
        namespace,
        step,
        name,
        offset,
        length,
        None if total < 0 else total,
        checksum if has_checksum else None,
        algo,
        put_id,
        meta,
    )


def frame(kind: int, head: bytes, payload_len: int = 0) -> bytes:
    return PREFIX.pack(kind, len(head), payload_len) + head


def _mac(
    secret: bytes,
    role: bytes,
    namespace: str,
    session: bytes,
    stream: int,
    client_name: str,
    server_name: Optional[str],
    nonce_s: bytes,
    nonce_c: bytes,
) -> bytes:
    parts = [
        b"gemini-ckpt/transport/v1/",
        role,
        pack_str(namespace),
        session,
        U16.pack(stream),
        pack_str(client_name),
        pack_str(server_name or ""),
        nonce_s,
        nonce_c,
    ]
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def client_proof(
    secret: bytes, namespace: str, session: bytes, stream: int, client_name: str, nonce_s: bytes, nonce_c: bytes
) -> bytes:
    return _mac(secret, b"client", namespace, session, stream, client_name, None, nonce_s, nonce_c)


def server_proof(
    secret: bytes,
    namespace: str,
    session: bytes,
    stream: int,
    client_name: str,
    server_name: str,
    nonce_s: bytes,
    nonce_c: bytes,
) -> bytes:
    return _mac(secret, b"server", namespace, session, stream, client_name, server_name, nonce_s, nonce_c)


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
