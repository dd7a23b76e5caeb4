"""Cut a failed round's gloo connections, so that no survivor stays blocked on another.

Gloo cannot be aborted: ``destroy_process_group`` and the backend's ``abort`` leave its TCP
connections open, so a survivor blocked in a collective on a peer that *did not* die (the peer
noticed the failure first and left the collective) waits until the group's timeout (30 min by
default). Closing the connections is what wakes it: its read ends with "connection closed by
peer", and it recovers like the others.

Every TCP connection of a gloo group was accepted by one of its two ends, on a listener that
end's group opened. Each rank publishes the listeners it opened since the training function
started (gloo's, one per group) in the round store; at the end of a round it shuts down the
connections it accepted on its own listeners and the ones it dialed to a peer's. A peer that
vanished without closing its sockets (a partitioned host) is cut by the survivors' side alone.
Connections to anything else (Ray, the round store) are left alone.

Linux only (``/proc/self/net/tcp*``); elsewhere this does nothing and a blocked survivor waits
for the group's timeout (``gray.torch_config(timeout_s=...)``).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Iterable

log = logging.getLogger("gemini_ckpt")

LISTEN, ESTABLISHED = "0A", "01"


def _socket_fds() -> dict[int, int]:
    """inode -> one fd of this process for every socket it holds."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.setdefault(int(target[8:-1]), int(name))
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address (little-endian 32-bit words in hex) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 address mapped into IPv6
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


Row = tuple  # (inode, local ip, local port, state, remote ip, remote port)


def _table_rows() -> Iterable[list[str]]:
    """The fields of every row of this network namespace's TCP tables (IPv4, then IPv6)."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) >= 10:
                        yield parts
        except OSError:
            continue


def _tcp_rows() -> Iterable[Row]:
    """Every TCP socket of this network namespace."""
    for parts in _table_rows():
        try:
            (lip, lport), (rip, rport) = parts[1].rsplit(":", 1), parts[2].rsplit(":", 1)
            yield (int(parts[9]), _address(lip), int(lport, 16), parts[3], _address(rip), int(rport, 16))
        except ValueError:
            continue


def listeners() -> set[int]:
    """Inodes of every TCP listener this process holds."""
    fds = _socket_fds()
    return {row[0] for row in _tcp_rows() if row[3] == LISTEN and row[0] in fds}


def opened_since(baseline: set[int]) -> list[tuple[str, int]]:
    """(ip, port) of the TCP listeners this process opened since ``baseline`` (listener inodes)."""
    fds = _socket_fds()
    return sorted(
        (row[1], row[2]) for row in _tcp_rows() if row[3] == LISTEN and row[0] in fds and row[0] not in baseline
    )


class NewListeners:
    """:func:`opened_since` for a watch that asks again and again (a rank, every second while it
    trains): the namespace's TCP tables (every socket of every process on the host: hundreds of
    rows, ~60 ms to parse on a busy 2-core host) are read only when this process holds a socket
    it did not hold at the last look, and only those sockets' rows are parsed. A listener is a
    socket of its own, so nothing is missed (a new socket not listening yet, made between two
    calls to ``socket`` and ``listen``, is looked at again for ``RECHECK`` more calls); the fd
    table alone costs ~1 ms."""

    RECHECK = 3

    def __init__(self, baseline: set[int]) -> None:
        self.baseline = set(baseline)
        self._seen: set[int] = set()  # socket inodes this process held at the last look
        self._pending: dict[int, int] = {}  # a new socket not listening yet -> looks left
        self._found: dict[int, tuple[str, int]] = {}  # inode -> (ip, port) of a listener opened since baseline

    def __call__(self) -> list[tuple[str, int]]:
        held = set(_socket_fds())
        new = (held - self._seen - self.baseline) | (self._pending.keys() & held)
        self._seen = held
        self._found = {inode: at for inode, at in self._found.items() if inode in held}  # closed: gone
        if new:
            for inode, ip, port in _listener_rows(new):
                self._found[inode] = (ip, port)
            left = {inode: self._pending.get(inode, self.RECHECK + 1) - 1 for inode in new - self._found.keys()}
            self._pending = {inode: n for inode, n in left.items() if n > 0}
        return sorted(self._found.values())


def _listener_rows(inodes: set[int]) -> Iterable[tuple[int, str, int]]:
    """(inode, ip, port) of the TCP listeners among ``inodes``; the other rows' addresses are
    never decoded."""
    for parts in _table_rows():
        try:
            if parts[3] != LISTEN or int(parts[9]) not in inodes:
                continue
            lip, lport = parts[1].rsplit(":", 1)
            yield int(parts[9]), _address(lip), int(lport, 16)
        except ValueError:
            continue


_ANY = {"0.0.0.0", "::"}


def sever(baseline: set[int], peers: Iterable[tuple[str, int]] = ()) -> int:
    """Shut down every established connection of this process that a process group holds: the
    ones it accepted on a listener it opened since ``baseline``, and the ones it dialed to a
    peer's listener in ``peers`` ((ip, port); what the peers published). Returns how many."""
    fds = _socket_fds()
    rows = list(_tcp_rows())
    own = {row[2] for row in rows if row[3] == LISTEN and row[0] in fds and row[0] not in baseline}
    theirs = set(peers)
    their_ports = {port for ip, port in theirs if ip in _ANY}
    cut = 0
    for inode, _lip, lport, state, rip, rport in rows:
        if state != ESTABLISHED or inode not in fds:
            continue
        if not (lport in own or (rip, rport) in theirs or rport in their_ports):
            continue
        try:
            dup = socket.socket(fileno=os.dup(fds[inode]))
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            dup.close()
    return cut
