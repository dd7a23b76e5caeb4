"""Cutting a failed round's gloo connections (:mod:`gemini_ckpt.integrations._sever`): real
sockets of this process, read back from the kernel's tables."""

import os

import pytest

from gemini_ckpt.integrations import _sever

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="Linux only (/proc/self/net/tcp)")


def test_sever_cuts_what_this_process_accepted_and_what_it_dialed_to_a_published_listener():
    import socket

    baseline = _sever.listeners()
    mine = socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen()
    theirs = socket.socket()  # stands for a peer's listener (another process in real life)
    theirs.bind(("127.0.0.1", 0))
    theirs.listen()
    inbound = socket.create_connection(mine.getsockname())
    accepted, _ = mine.accept()
    dialed = socket.create_connection(theirs.getsockname())
    peer_end, _ = theirs.accept()
    other = socket.socket()  # a listener of before: untouched
    unrelated = socket.create_connection(("127.0.0.1", _free_listener(other)))
    assert ("127.0.0.1", mine.getsockname()[1]) in _sever.opened_since(baseline)
    # the peer's listener was opened after the baseline too; name only our own as ours
    cut = _sever.sever(baseline | _sever.listeners() - _inodes_of(mine), [theirs.getsockname()])
    assert cut >= 2
    assert inbound.recv(1) == b""  # our accepted end was shut: the dialer sees the close
    assert peer_end.recv(1) == b""  # our dialed end was shut: the peer sees the close
    unrelated.sendall(b"x")  # still open
    for s in (mine, theirs, inbound, accepted, dialed, peer_end, other, unrelated):
        s.close()


def test_the_watch_of_new_listeners_finds_each_one_it_would_have_found_by_reading_every_row():
    import socket

    baseline = _sever.listeners()
    watch = _sever.NewListeners(baseline)
    assert watch() == []
    first = socket.socket()
    port = _free_listener(first)
    assert watch() == [("127.0.0.1", port)] == _sever.opened_since(baseline)
    late = socket.socket()  # made between two looks, listening only after one
    late.bind(("127.0.0.1", 0))
    assert watch() == [("127.0.0.1", port)]
    late.listen()
    assert watch() == sorted([("127.0.0.1", port), late.getsockname()]) == _sever.opened_since(baseline)
    dialed = socket.create_connection(late.getsockname())  # a connection is no listener
    accepted, _ = late.accept()
    assert watch() == _sever.opened_since(baseline)
    first.close()
    assert watch() == [late.getsockname()] == _sever.opened_since(baseline)
    for s in (late, dialed, accepted):
        s.close()
    assert watch() == []


def _free_listener(sock) -> int:
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock.getsockname()[1]


def _inodes_of(sock) -> set[int]:
    return {int(os.readlink(f"/proc/self/fd/{sock.fileno()}")[8:-1])}


def test_the_round_store_listens_on_the_address_it_is_given_only():
    """A TCPStore that binds itself listens on every interface (issue 61, 3): the round store is
    given a socket bound to the controller's address, and its clients reach it there."""
    from gemini_ckpt.integrations import _rounds

    baseline = _sever.listeners()
    store = _rounds.server("127.0.0.1", timeout_s=10)
    opened = [(ip, port) for ip, port in _sever.opened_since(baseline) if port == store.port]
    assert opened == [("127.0.0.1", store.port)], opened
    _rounds.client("127.0.0.1", store.port, timeout_s=10, secret=store.secret).put("k", "v")
    assert store.read("k") == "v"
