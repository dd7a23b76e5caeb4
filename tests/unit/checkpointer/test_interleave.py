"""Interleaving (docs/interleave.md): its configuration (on by default, the modes, the socket
marks of the lower-effort class), and the hooks that mark a model's collectives in the comm
state (DDP, FSDP2; a model they cannot hook is refused; recovery channels go unmarked).

The comm state and the piece size are in test_interleave_commstate.py, the gated sender in
test_interleave_sender.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import paths

from gemini_ckpt.config import CheckpointConfig, Interleave, interleave_mode
from gemini_ckpt.errors import ConfigError
from gemini_ckpt.format.commstate import CommState


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
    of a Ray tier, without a Ray cluster (tests/integration/hoststore/test_ray_store.py has the real one)."""

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


def marking_checkpointer(model, namespace):
    """A Checkpointer of ``model`` over a :class:`MarkingTier` in ``namespace``: (it, the tier's comm state)."""
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
    ckpt, comm = marking_checkpointer(model, "interleave-ddp")
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
sys.path[:0] = [os.path.dirname(sys.argv[1]), sys.argv[3]]  # this test file's folder, then tests/
from test_interleave import marking_checkpointer
import gemini_ckpt

def main(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + sys.argv[2])
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ckpt, comm = marking_checkpointer(model, f"interleave-fsdp-{rank}")
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
        [sys.executable, str(script), __file__, str(tmp_path / "rendezvous"), str(paths.TESTS)],
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

    ckpt, _ = marking_checkpointer(torch.nn.Linear(2, 2), "interleave-plain")
    with pytest.raises(TypeError, match="communicating"):
        gemini_ckpt.interleave(torch.nn.Linear(2, 2), ckpt)


def test_recovery_channels_go_unmarked_where_replication_is_marked():
    """Under ``interleave="network"`` only replication yields: a channel opened with
    ``marked=False`` (restore pushes, re-replication) keeps the normal class."""
    from gemini_ckpt import dataplane as T
    from gemini_ckpt.dataplane import LOWER_EFFORT_DSCP

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
        dscp = {name: set(ch.dscp()) for name, ch in (("marked", marked), ("plain", plain))}
        assert dscp == {"marked": {LOWER_EFFORT_DSCP}, "plain": {0}}
    finally:
        sender.close()
        receiver.close()
