"""Interleaving (docs/interleave.md): the comm-state page a host's ranks mark their collectives
in (seen across processes, stale and future marks ignored, overlapping collectives), and the
piece size chosen from the link rate and the collectives' durations, bounded for all of a
host's sockets together."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gemini_ckpt.format.commstate import HEADER_BYTES, SLOT, SLOT_BYTES, CommState
from gemini_ckpt.dataplane._interleave import unsent_bytes
from standalone_transport import load_standalone

T = load_standalone()


# --- the comm state ------------------------------------------------------------------------------
def test_a_mark_in_one_process_is_seen_in_another():
    state = CommState.create(slots=4)
    slot = state.slot_for(rank=7)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from gemini_ckpt.format.commstate import CommState
            marker = CommState.open({state.fd}, {state.nbytes}).marker({slot})
            marker.enter(); print("in", flush=True); sys.stdin.readline()
            time.sleep(0.05); marker.exit(); print("out", flush=True); sys.stdin.readline()
        """),
        ],
        pass_fds=[state.fd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert not state.active() and not state.busy(stale_s=30)
        assert child.stdout.readline().strip() == "in"
        assert state.busy(stale_s=30) and state.active()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "out"
        assert not state.busy(stale_s=30)
        assert state.collective_s() >= 0.05 and state.stats()["collectives"] == 1
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        state.close()


def test_a_stale_mark_is_ignored_and_a_detached_ranks_marks_are_cleared():
    state = CommState.create(slots=2)
    marker = state.marker(state.slot_for(rank=0))
    marker.enter()  # and never exits: the rank died mid-collective
    assert state.busy(stale_s=30)
    assert not state.busy(stale_s=30, now=time.monotonic() + 31)
    state.clear(0)
    assert not state.busy(stale_s=30)
    assert state.slot_for(rank=0) == 0 and state.slot_for(rank=5) == 1
    with pytest.raises(LookupError):
        state.slot_for(rank=6)
    state.clear(5)  # a detached rank's slot goes to the next one (a restart with other ranks here)
    assert state.slot_for(rank=6) == 1
    state.close()


def test_a_mark_timestamped_in_the_future_goes_stale_too():
    """A slot whose ``entered`` lies in the future (a bad clock, a hostile writer of the page)
    must not hold replication back forever."""
    import mmap

    state = CommState.create(slots=1)
    slot = state.slot_for(rank=0)
    marker = state.marker(slot)
    marker.enter()
    page = mmap.mmap(state.fd, state.nbytes)  # what another writer of the page can do: map it and write
    try:

        def write_entered(entered: float) -> None:
            depth, _, count, mean_s, busy_s, last = state.read(slot)
            SLOT.pack_into(page, HEADER_BYTES + SLOT_BYTES * slot, depth, entered, count, mean_s, busy_s, last)

        write_entered(time.monotonic() + 3600)
        assert state.busy_since(stale_s=30) is None and not state.busy(stale_s=30)
        write_entered(time.monotonic())
        assert state.busy(stale_s=30)
    finally:
        page.close()
        state.close()


def test_overlapping_collectives_keep_the_rank_busy_until_the_last_ends():
    state = CommState.create(slots=1)
    marker = state.marker(0)
    marker.enter()
    marker.enter()  # DDP's next bucket starts before the first's all-reduce completed
    marker.exit()
    assert state.busy(stale_s=30)
    marker.exit()
    assert not state.busy(stale_s=30)
    assert state.read(0)[2] == 2
    state.close()


# --- the piece size --------------------------------------------------------------------------------
def test_the_piece_delays_a_collective_by_at_most_five_percent_within_bounds():
    assert T.choose_chunk(125e6, 0.1) == 250_000  # 1 Gbit/s, 100 ms: 2 ms of link
    assert T.choose_chunk(125e6, 0.001) == 16 << 10  # clamped up
    assert T.choose_chunk(10e9, 1.0) == 4 << 20  # clamped down
    assert T.choose_chunk(None, 0.1) == 16 << 10  # rate not measured yet: the smallest
    assert T.choose_chunk(125e6, None) == 4 << 20  # no collective measured yet
    assert T.choose_chunk(1e9, 0.01, fraction=0.1) == 1_000_000


def test_two_pieces_queued_together_stay_within_two_percent_of_a_collective():
    state = CommState.create(slots=1)
    try:
        marker = state.marker(state.slot_for(rank=0))
        marker.enter()
        time.sleep(0.05)
        marker.exit()
        gate = T.IdleGate(state)
        gate.rate = 125e6
        one = T.choose_chunk(125e6, state.collective_s())  # one piece: 2% of the collective
        assert abs(gate.piece() - one / 2) <= 1 and one > 2 * gate.lo
    finally:
        state.close()


def _stuck_pair(rcvbuf: int = 4096):
    """A loopback TCP connection whose receiver reads nothing (a tiny receive buffer), so bytes
    written to the sending end stay queued in its kernel."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    return client, peer


def test_pieces_to_different_sockets_count_together_in_the_queue_bound():
    # a host's streams and peers share one bound: a piece for a second socket waits while the
    # first socket's piece is still queued (a collective would find both ahead of it), and a
    # socket nobody wrote to for a second no longer counts (a dead peer holds nobody back)
    state = CommState.create(slots=1)
    a, a_peer = _stuck_pair()
    b, b_peer = _stuck_pair(rcvbuf=1 << 20)
    try:
        gate = T.IdleGate(state)
        piece = memoryview(bytearray(256 << 10))
        gate.send(a, piece, a.send, lambda: None)
        assert unsent_bytes(a) > 64 << 10  # stuck in the kernel
        written_a = time.monotonic()
        done = threading.Event()
        small = piece[: 64 << 10]
        threading.Thread(target=lambda: (gate.send(b, small, b.send, lambda: None), done.set()), daemon=True).start()
        assert not done.wait(0.3)  # a's piece plus b's is more than b's piece
        assert done.wait(5)
        assert time.monotonic() - written_a >= 0.9  # released when a was forgotten, not before
    finally:
        for sock in (a, a_peer, b, b_peer):
            sock.close()
        state.close()
