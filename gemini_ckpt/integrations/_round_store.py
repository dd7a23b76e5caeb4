"""The round store of an in-place job: a ``torch.distributed`` ``TCPStore`` served from Ray Train's
controller, and every value in it that decides anything sealed with the run's secret.

A ``TCPStore`` has no authentication: whoever reaches its port can read, write, add to and list
every key. So each value the rounds decide by (the round asked for, a round's members and verdict,
an arrival, a revocation, the progress and the reasons to give up) is written with a tag, an HMAC
of the key and the value under a secret the controller draws for the run and gives its workers in
their environment (``GEMINI_ROUNDS_SECRET``; never sent to the store). A value whose tag does not
check is read as absent, with one warning per key: a stranger's write starts no recovery, joins no
round, revokes no worker and ends no run. A stranger can still delete or spoil values (a denial of
service: a recovery then waits out its timeouts) and read them, so no value holds a secret, and an
error's text (which may carry data) is encrypted (:meth:`RoundStore.put_private`). Counters are
raised with ``compare_set`` on sealed values, never with ``add``, which a stranger could move back. The process groups' own rendezvous (torch's keys under ``r{n}/pg/``)
stays unsealed; a round formed with a stranger's keys fails its check and moves to the next round.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from datetime import timedelta
from typing import Optional

log = logging.getLogger("gemini_ckpt")

TAG_CHARS = 32  # 128 bits of HMAC-SHA256, hex
NONCE_BYTES = 8


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def new_secret() -> str:
    return secrets.token_hex(16)


class RoundStore:
    """A client (or the server) of the round store that seals what it writes and checks what it
    reads. ``raw`` is the ``TCPStore`` itself (for torch's process-group rendezvous)."""

    def __init__(self, raw, secret: str) -> None:
        if not secret:
            raise ValueError("the round store needs the run's secret (GEMINI_ROUNDS_SECRET)")
        self.raw = raw
        self.secret = secret
        self._key = secret.encode()
        self._high: dict[str, int] = {}  # the highest value this client wrote or read per counter
        self._warned: set[str] = set()

    @property
    def port(self) -> int:
        return self.raw.port

    def _tag(self, key: str, value: bytes, nonce: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + value + b"\0" + nonce, hashlib.sha256)
        return mac.hexdigest()[:TAG_CHARS].encode()

    def seal(self, key: str, value: str) -> bytes:
        """``value`` with a nonce (two writes of one value differ, so a compare-and-set tells
        whose write it sees) and the tag."""
        data, nonce = value.encode(), secrets.token_hex(NONCE_BYTES).encode()
        return data + b"\n" + nonce + self._tag(key, data, nonce)

    def unseal(self, key: str, raw: bytes) -> Optional[str]:
        """``raw``'s value if its tag checks for ``key``, else None (warned once per key)."""
        data, sep, trailer = raw.rpartition(b"\n")
        nonce, tag = trailer[: 2 * NONCE_BYTES], trailer[2 * NONCE_BYTES :]
        if sep and hmac.compare_digest(tag, self._tag(key, data, nonce)):
            try:
                return data.decode()
            except UnicodeDecodeError:
                pass
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "the round store's %r holds a value this run did not write (%d bytes; a stranger on the "
                "controller's network?): read as absent",
                key,
                len(raw),
            )
        return None

    # --- values -----------------------------------------------------------------------------------
    def put(self, key: str, value: str) -> None:
        self.raw.set(key, self.seal(key, value))

    def has(self, key: str) -> bool:
        """Whether ``key`` holds a value (sealed or not: :meth:`read` says which)."""
        return self.raw.check([key])

    def _get(self, key: str) -> bytes:
        return self.raw.get(key) if self.raw.check([key]) else b""

    def read(self, key: str) -> Optional[str]:
        """``key``'s value, None when absent or not sealed by this run."""
        raw = self._get(key)
        return self.unseal(key, raw) if raw else None

    def read_int(self, key: str, default: int) -> int:
        text = self.read(key)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:  # sealed, so ours: never happens unless the secret leaked
            return default

    def put_private(self, key: str, text: str) -> None:
        """Write ``text`` encrypted (HMAC-SHA256 in counter mode as the key stream, a nonce per
        write) and sealed: for what may carry data (an error's text)."""
        nonce = secrets.token_hex(NONCE_BYTES)
        data = text.encode()
        self.put(key, nonce + _xor(data, self._stream(key, nonce, len(data))).hex())

    def read_private(self, key: str) -> Optional[str]:
        value = self.read(key)
        if value is None:
            return None
        nonce, body = value[: 2 * NONCE_BYTES], value[2 * NONCE_BYTES :]
        try:
            data = bytes.fromhex(body)
        except ValueError:
            return None
        return _xor(data, self._stream(key, nonce, len(data))).decode(errors="replace")

    def _stream(self, key: str, nonce: str, length: int) -> bytes:
        blocks, i = [], 0
        prefix = b"stream\0" + key.encode() + b"\0" + nonce.encode() + b"\0"
        while 32 * len(blocks) < length:
            blocks.append(hmac.new(self._key, prefix + i.to_bytes(4, "big"), hashlib.sha256).digest())
            i += 1
        return b"".join(blocks)[:length]

    def all_present(self, keys: list[str]) -> bool:
        """Whether every key holds a value sealed by this run (one request while some are missing)."""
        if not self.raw.check(keys):
            return False
        return all(self.read(k) is not None for k in keys)

    def decide(self, key: str, value: str) -> Optional[str]:
        """Set ``key`` to ``value`` unless it holds one already; returns what it holds then (this
        value or an earlier one), None when that is not sealed by this run."""
        got = self.raw.compare_set(key, "", self.seal(key, value))
        return self.unseal(key, got)

    # --- counters ---------------------------------------------------------------------------------
    def raise_to(self, key: str, at_least: int) -> int:
        """Make the counter ``key`` at least ``at_least`` (race-free); returns its value then."""
        while True:
            raw = self._get(key)
            now = self._counter(key, raw)
            if now >= at_least:
                return now
            sealed = self.seal(key, str(at_least))
            if self.raw.compare_set(key, raw, sealed) == sealed:
                self._high[key] = at_least
                return at_least

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the counter ``key`` (absent: 0); returns the new value."""
        while True:
            raw = self._get(key)
            new = max(self._counter(key, raw), 0) + delta
            sealed = self.seal(key, str(new))
            if self.raw.compare_set(key, raw, sealed) == sealed:
                self._high[key] = new
                return new

    def counter(self, key: str, default: int = 0) -> int:
        return self._counter(key, self._get(key), default)

    def _counter(self, key: str, raw: bytes, default: int = 0) -> int:
        value = self.unseal(key, raw) if raw else None
        now = default
        if value is not None:
            try:
                now = int(value)
            except ValueError:  # sealed, so ours: never happens unless the secret leaked
                pass
        # Counters only grow: an older sealed value written again (a stranger's replay) or a
        # spoiled one reads as the highest this client saw.
        now = max(now, self._high.get(key, now))
        self._high[key] = now
        return now


def client(host: str, port: int, *, timeout_s: float, secret: str) -> RoundStore:
    """A client of the job's round store."""
    import torch.distributed as dist

    raw = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
    return RoundStore(raw, secret)


def server(host: str, *, timeout_s: float, secret: Optional[str] = None) -> RoundStore:
    """The job's round store (on Ray Train's controller, which outlives every worker), listening
    on ``host`` only (a TCPStore binds every interface when it binds itself), with a new secret
    unless given one."""
    import socket

    import torch.distributed as dist

    sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=1024)
    port, fd = sock.getsockname()[1], sock.detach()  # the store owns the socket from here
    try:
        raw = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            use_libuv=True,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    return RoundStore(raw, secret or new_secret())
