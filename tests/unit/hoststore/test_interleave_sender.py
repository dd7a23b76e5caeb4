"""Interleaving (docs/interleave.md): a sender gated on the comm state moves no bytes while
training communicates, completes once it is idle, does not take waiting for a stall, is never
held by a stale mark or by back-to-back collectives, and is not in the way without marks."""

from __future__ import annotations

import time

import numpy as np

from gemini_ckpt.format.commstate import CommState
from standalone_transport import NS, SECRET, load_standalone

T = load_standalone()


# --- the sender ------------------------------------------------------------------------------------
class Sink:
    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, np.uint8)
        self.done: list = []

    def buffer_for(self, header):
        return memoryview(self.buffer)[header.offset : header.offset + header.length]

    def received(self, header) -> None:
        self.done.append(time.monotonic())

    def failed(self, header, error) -> None:
        self.done.append(error)


def _send(gate, nbytes: int, *, progress_timeout_s: float = 5.0):
    sink = Sink(nbytes)
    data = np.random.default_rng(0).integers(1, 256, nbytes, dtype=np.uint8)
    receiver = T.TcpTransport(SECRET, NS, config=T.TcpConfig(progress_timeout_s=progress_timeout_s))
    sender = T.TcpTransport(SECRET, NS, config=T.TcpConfig(progress_timeout_s=progress_timeout_s), gate=gate)
    listener = receiver.listen("127.0.0.1", sink)
    channel = sender.connect(listener.endpoint)
    fut = channel.send_async(T.Header(NS, 1, "f", 0, nbytes, total=nbytes), data)
    return sink, data, fut, (channel, listener)


def test_the_sender_moves_no_bytes_while_training_communicates_and_completes_once_idle():
    state = CommState.create(slots=2)
    marker = state.marker(state.slot_for(rank=0))
    gate = T.IdleGate(state, patience_s=30.0)  # capped at a third of the progress timeout: 1.67 s
    marker.enter()
    sink, data, fut, opened = _send(gate, 8 << 20)
    try:
        time.sleep(1.0)
        assert not fut.done() and not sink.buffer.any()
        start = time.monotonic()
        marker.exit()
        fut.result(timeout=10)
        assert time.monotonic() - start < 10
        assert np.array_equal(sink.buffer, data)
        stats = gate.stats()
        assert stats["engaged"] and stats["waited_s"] >= 0.9 and stats["pieces"] >= 2 and stats["forced"] == 0
        assert stats["rate"] > 0
    finally:
        for thing in opened:
            thing.close()
        state.close()


def test_waiting_for_idle_is_not_a_stall():
    state = CommState.create(slots=1)
    marker = state.marker(state.slot_for(rank=0))
    marker.enter()
    time.sleep(0.01)
    marker.exit()  # a 10 ms collective measured: small pieces
    gate = T.IdleGate(state, patience_s=30.0)
    marker.enter()
    sink, data, fut, opened = _send(gate, 8 << 20, progress_timeout_s=0.3)
    try:
        time.sleep(1.5)  # five progress timeouts of waiting: the transfer trickles, nobody gives up
        assert not fut.done()
        marker.exit()
        fut.result(timeout=10)
        assert np.array_equal(sink.buffer, data) and gate.stats()["forced"] >= 3
    finally:
        for thing in opened:
            thing.close()
        state.close()


def test_a_mark_left_by_a_dead_rank_does_not_hold_replication_forever():
    state = CommState.create(slots=1)
    state.marker(state.slot_for(rank=0)).enter()  # never exits
    gate = T.IdleGate(state, stale_s=0.3, patience_s=30.0)
    sink, data, fut, opened = _send(gate, 1 << 20)
    try:
        fut.result(timeout=10)
        assert np.array_equal(sink.buffer, data)
    finally:
        for thing in opened:
            thing.close()
        state.close()


def test_back_to_back_collectives_still_let_a_piece_through_after_patience():
    state = CommState.create(slots=1)
    state.marker(state.slot_for(rank=0)).enter()  # fresh: busy throughout
    gate = T.IdleGate(state, patience_s=0.1, hi=64 << 10)
    sink, data, fut, opened = _send(gate, 128 << 10)
    try:
        fut.result(timeout=10)
        assert np.array_equal(sink.buffer, data) and gate.stats()["forced"] >= 2
    finally:
        for thing in opened:
            thing.close()
        state.close()


def test_without_marks_the_gate_is_not_in_the_way():
    state = CommState.create(slots=1)
    gate = T.IdleGate(state)
    sink, data, fut, opened = _send(gate, 8 << 20)
    try:
        fut.result(timeout=10)
        assert np.array_equal(sink.buffer, data)
        assert gate.stats()["pieces"] == 0 and not gate.engaged()
    finally:
        for thing in opened:
            thing.close()
        state.close()
