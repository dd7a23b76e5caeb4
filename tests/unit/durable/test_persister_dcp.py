"""DCP compatibility: our bytes are FileSystemWriter's bytes, stock readers load them, and
FSDP2 state saved at one world size loads at others through our reader."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import TinyLM, build_training, fully_shard_layers, lm_loss
from dir_tier import DirTier
from rendezvous import join_group, master_store


def _trained(seed=0):
    t = build_training(seed=seed, dataset_size=32)
    batch = next(t.batches())
    lm_loss(t.model, batch).backward()
    t.optimizer.step()
    t.scheduler.step()
    return t


def test_persisted_data_file_is_byte_identical_to_filesystemwriter(tmp_path):
    t = _trained()
    state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
    staged = {**state.tensor_state(), **state.opaque_state(0)}
    dcp.save(staged, storage_writer=FileSystemWriter(str(tmp_path / "stock"), sync_files=False), no_dist=True)
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=uuid.uuid4().hex, durable_uri=str(tmp_path / "ours"))
    )
    ckpt.save(1, persist=True).persisted.result(timeout=60)
    ckpt.close()
    theirs = (tmp_path / "stock" / "__0_0.distcp").read_bytes()
    ours = (tmp_path / "ours" / "step_000000001" / "__0_0.distcp").read_bytes()
    assert len(ours) == len(theirs) and ours == theirs


def test_persisted_version_loads_with_stock_dcp_and_filesystemreader(tmp_path):
    t = _trained(seed=1)
    ckpt = Checkpointer(
        TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
        CheckpointConfig(store="local", namespace=f"dump-{uuid.uuid4().hex}", durable_uri=str(tmp_path)),
    )
    ckpt.save(7, persist=True).persisted.result(timeout=60)
    ckpt.close()

    fresh = TinyLM()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(fresh, opt)
    target = {"model": msd, "optim": osd}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path / "step_000000007")), no_dist=True)
    set_state_dict(fresh, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    for (n, a), (_, b) in zip(t.model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n
    for k, v in t.optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], opt.state_dict()["state"][k]["exp_avg"])


# --- FSDP2 at world size 2 -> 1 and 3, through our reader ------------------------------------


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_worker(rank, world_size, port, root, phase):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    join_group(port, rank, world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0 if phase == "save" else 100 + world_size)
        model = fully_shard_layers(TinyLM(dim=32, layers=2, dropout=0.0), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model=model, optimizer=opt, extra={"rank": rank})
        ckpt = Checkpointer(
            state, CheckpointConfig(store="local"), store=DirTier(root, rank=rank, world_size=world_size)
        )
        if phase == "save":
            batch = torch.arange(4 * 17).reshape(4, 17) % 64
            for _ in range(2):
                lm_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
            ckpt.save(4)
            ckpt.close()
            full = {k: _full(v) for k, v in model.state_dict().items()}
            optim_full = {}
            for p, st in opt.state.items():
                name = next(n for n, q in model.named_parameters() if q is p)
                optim_full[name] = st["exp_avg"].full_tensor()
            if rank == 0:
                torch.save({"model": full, "exp_avg": optim_full}, os.path.join(root, "reference.pt"))
        else:
            result = ckpt.restore()
            ckpt.close()
            ref = torch.load(os.path.join(root, "reference.pt"))
            assert result.step == 4 and result.saved_world_size == 2 and result.world_size == world_size
            for k, v in model.state_dict().items():
                assert torch.equal(_full(v), ref["model"][k]), k
            for p, st in opt.state.items():
                name = next(n for n, q in model.named_parameters() if q is p)
                assert torch.equal(st["exp_avg"].full_tensor(), ref["exp_avg"][name]), name
            # Rank-local rule: rank r takes saved rank r mod 2.
            assert state.extra == {"rank": rank % 2}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_fsdp2_saved_at_world_size_2_loads_at_1_and_3(tmp_path):
    root = str(tmp_path)
    store = master_store(2)
    mp.spawn(_fsdp_worker, args=(2, store.port, root, "save"), nprocs=2, join=True)
    for world_size in (1, 3):
        store = master_store(world_size)
        mp.spawn(_fsdp_worker, args=(world_size, store.port, root, "load"), nprocs=world_size, join=True)
