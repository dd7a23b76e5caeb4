"""Interleaving (docs/interleave.md): the comm-state page a host's ranks mark their collectives
in, the piece size chosen from the link rate and the collectives' durations, and a sender that
moves no bytes while training communicates, completes once it is idle, and is never held by a
stale mark."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from gemini_ckpt.config import CheckpointConfig, Interleave, interleave_mode
from gemini_ckpt.errors import ConfigError
from gemini_ckpt.format.commstate import CommState
from gemini_ckpt.dataplane._interleave import unsent_bytes
from standalone_transport import NS, SECRET, load_standalone

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
    must not hold replication back forever (issue 40, finding 7)."""
    import struct

    state = CommState.create(slots=1)
    marker = state.marker(state.slot_for(rank=0))
    marker.enter()
    at = state._at(0)
    struct.pack_into("<d", state._mm, at + 8, time.monotonic() + 3600)  # what another writer can do
    assert state.busy_since(stale_s=30) is None and not state.busy(stale_s=30)
    struct.pack_into("<d", state._mm, at + 8, time.monotonic())
    assert state.busy(stale_s=30)
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


# --- configuration ---------------------------------------------------------------------------------
def test_interleave_is_on_by_default_and_validated():
    assert CheckpointConfig().interleave is True
    assert CheckpointConfig().interleave_mode == "gate"
    assert CheckpointConfig(interleave=False).interleave_mode == "off"
    assert CheckpointConfig(interleave="gate").interleave_mode == "gate"
    assert CheckpointConfig(interleave="network").interleave_mode == "network"
    assert CheckpointConfig(interleave="off").interleave_mode == "off"
    # what a store gets from a registry or client of another version: a bool, or a mode it knows
    assert [interleave_mode(v) for v in (True, False, "network", "off", "later")] == [
        "gate",
        "off",
        "network",
        "off",
        "gate",
    ]
    # one type wherever it is read: the enum, which compares and travels as its word
    assert all(type(interleave_mode(v)) is Interleave for v in (True, False, "network", "later"))
    assert type(CheckpointConfig().interleave_mode) is Interleave and json.dumps(interleave_mode("off")) == '"off"'
    with pytest.raises(ConfigError, match="interleave.*'network'"):
        CheckpointConfig(interleave="yes")


def test_a_marked_socket_carries_the_lower_effort_class_and_bulk_priority():
    from gemini_ckpt.dataplane._tcp import LOWER_EFFORT_DSCP, TcpConfig, tune

    with socket.socket() as marked, socket.socket() as plain, socket.socket() as receiving:
        tune(marked, TcpConfig(dscp=LOWER_EFFORT_DSCP))
        tune(plain, TcpConfig())
        tune(receiving, TcpConfig(dscp=LOWER_EFFORT_DSCP), sending=False)  # acknowledges in the normal class
        assert marked.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0x20  # DSCP CS1
        assert marked.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 2  # TC_PRIO_BULK
        for sock in (plain, receiving):
            assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 0
    with pytest.raises(ValueError, match="dscp"):
        TcpConfig(dscp=64)


# --- the hooks (one process, world size 1: DDP and FSDP2 still run their collectives) ------------
class MarkingTier:
    """The local tier with the comm state a host store would lend it (slot 0): what the hooks see
    of a Ray tier, without a Ray cluster (tests/integration/test_ray_store.py has the real one)."""

    @staticmethod
    def make(namespace: str):
        from gemini_ckpt.retention import KeepNewest
        from gemini_ckpt.stores.memory import LocalTier, local_store

        class Tier(LocalTier):
            comm = CommState.create(slots=1)

            def comm_marker(self):
                return self.comm.marker(0)

        base = local_store(namespace).attach(keep=KeepNewest(1))
        tier = Tier.__new__(Tier)
        tier.__dict__.update(base.__dict__)
        return tier


@pytest.fixture
def gloo():
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def _checkpointer(model, namespace):
    import torch

    from gemini_ckpt import Checkpointer, TrainState

    tier = MarkingTier.make(namespace)
    ckpt = Checkpointer(
        TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
        CheckpointConfig(store="local", namespace=namespace),
        store=tier,
    )
    return ckpt, tier.comm


def _watch_busy(comm, stop):
    import threading

    seen = []
    thread = threading.Thread(
        target=lambda: [
            seen.append(comm.busy(stale_s=30)) or time.sleep(0.0002) for _ in iter(lambda: stop.is_set(), True)
        ],
        daemon=True,
    )
    thread.start()
    return seen, thread


def test_the_ddp_hook_marks_each_allreduce_until_it_completes(gloo):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gemini_ckpt

    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)), bucket_cap_mb=0.001)
    ckpt, comm = _checkpointer(model, "interleave-ddp")
    assert gemini_ckpt.interleave(model, ckpt) is model
    model(torch.randn(8, 64)).sum().backward()
    assert comm.read(0)[2] == 0  # not started: nothing marked
    ckpt.start()
    for _ in range(3):
        model(torch.randn(8, 64)).sum().backward()
    depth, _entered, count, mean_s, busy_s, _ = comm.read(0)
    assert depth == 0 and count >= 3 and mean_s > 0 and busy_s > 0  # one per bucket and step, all done
    with ckpt.communicating():
        assert comm.busy(stale_s=30)
    assert not comm.busy(stale_s=30)
    with pytest.raises(ValueError, match="comm hook"):
        gemini_ckpt.interleave(model, ckpt)
    ckpt.close()
    assert ckpt.comm_marker() is None


FSDP2_WORKER = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path[:0] = [os.path.dirname(sys.argv[1]), os.path.dirname(os.path.dirname(sys.argv[1]))]
from test_interleave import _checkpointer
import gemini_ckpt

def main(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + sys.argv[2])
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ckpt, comm = _checkpointer(model, f"interleave-fsdp-{rank}")
    gemini_ckpt.interleave(model, ckpt)
    ckpt.start()
    model(torch.randn(4, 16)).sum().backward()
    # A mark ends when its work's completion is seen, which may run a moment after backward()
    # returns on a loaded machine: wait (bounded) for every mark to have ended.
    import time
    deadline = time.monotonic() + 30
    while True:
        depth, _entered, count, mean_s, _busy, _ = comm.read(0)
        if (depth == 0 and count >= 4) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    print(f"rank {rank}: depth {depth} count {count}", flush=True)
    assert depth == 0 and count >= 4 and mean_s > 0  # all-gathers and reduce-scatters, all completed
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, nprocs=2)
"""


def test_the_fsdp2_hooks_mark_all_gathers_and_reduce_scatters(tmp_path):
    script = tmp_path / "fsdp2_worker.py"
    script.write_text(FSDP2_WORKER)
    # a file rendezvous: a port picked here and bound later by the workers could be taken between
    done = subprocess.run(
        [sys.executable, str(script), __file__, str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    noise = ("rendezvous/registry.py", "lm_resiliency")  # an unrelated installed plugin's warnings
    errors = "\n".join(line for line in done.stderr.splitlines() if not any(n in line for n in noise))
    assert done.returncode == 0, done.stdout[-1500:] + errors[-3000:]
    assert done.stdout.count("depth 0") == 2


def test_interleave_refuses_a_model_it_cannot_hook():
    import torch

    import gemini_ckpt

    ckpt, _ = _checkpointer(torch.nn.Linear(2, 2), "interleave-plain")
    with pytest.raises(TypeError, match="communicating"):
        gemini_ckpt.interleave(torch.nn.Linear(2, 2), ckpt)


def test_recovery_channels_go_unmarked_where_replication_is_marked():
    """Under ``interleave="network"`` only replication yields: a channel opened with
    ``marked=False`` (restore pushes, re-replication) keeps the normal class."""
    from gemini_ckpt import dataplane as T
    from gemini_ckpt.dataplane._tcp import LOWER_EFFORT_DSCP

    class Sink(T.Sink):
        def buffer_for(self, header):
            return memoryview(bytearray(header.length))

        def received(self, header):
            pass

        def failed(self, header, error):
            pass

    secret = b"s" * 32
    receiver = T.TcpTransport(secret, "marks", host_name="receiver")
    sender = T.TcpTransport(secret, "marks", host_name="sender", config=T.TcpConfig(dscp=LOWER_EFFORT_DSCP))
    listener = receiver.listen("127.0.0.1", Sink())
    try:
        marked = sender.connect(listener.endpoint)
        plain = sender.connect(listener.endpoint, marked=False)
        tos = {
            name: {s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) for s in ch._socks}
            for name, ch in (("marked", marked), ("plain", plain))
        }
        assert tos == {"marked": {LOWER_EFFORT_DSCP << 2}, "plain": {0}}
    finally:
        sender.close()
        receiver.close()
