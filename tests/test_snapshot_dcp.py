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
from gemini_ckpt._dcp_storage import StoreWriter, save_version
from gemini_ckpt._fs_store import FsStore
from gemini_ckpt._store import METADATA_FILE, MemoryStore
from gemini_ckpt._toy import TinyLM, build_training, lm_loss
from rendezvous import join_group, master_store


def _trained(seed=0):
    t = build_training(seed=seed, dataset_size=32)
    batch = next(t.batches())
    lm_loss(t.model, batch).backward()
    t.optimizer.step()
    t.scheduler.step()
    return t


def test_data_file_is_byte_identical_to_filesystemwriter(tmp_path):
    t = _trained()
    state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
    staged = {**state.tensor_state(), **state.opaque_state(0)}
    dcp.save(staged, storage_writer=FileSystemWriter(str(tmp_path), sync_files=False), no_dist=True)
    store = MemoryStore()
    save_version(staged, StoreWriter(store, 1, world_size=1), planner=None, group=None, no_dist=True)
    theirs = (tmp_path / "__0_0.distcp").read_bytes()
    manifest = store.manifest(1)
    ours = bytes(store.read_range(1, "__0_0.distcp", 0, manifest.file_sizes["__0_0.distcp"]))
    assert len(ours) == len(theirs) and ours == theirs


def test_version_dumped_as_files_loads_with_stock_dcp_and_filesystemreader(tmp_path):
    t = _trained(seed=1)
    ns = f"dump-{uuid.uuid4().hex}"
    ckpt = Checkpointer(TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler),
                        CheckpointConfig(store="local", namespace=ns))
    ckpt.save(7)
    ckpt.wait()
    store, manifest = ckpt.store, ckpt.store.manifest(7)
    for name, size in manifest.file_sizes.items():
        (tmp_path / name).write_bytes(bytes(store.read_range(7, name, 0, size)))
    (tmp_path / METADATA_FILE).write_bytes(manifest.metadata)
    ckpt.close()

    fresh = TinyLM()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(fresh, opt)
    target = {"model": msd, "optim": osd}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    set_state_dict(fresh, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    for (n, a), (_, b) in zip(t.model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n
    for k, v in t.optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], opt.state_dict()["state"][k]["exp_avg"])


def test_fs_store_version_is_a_stock_dcp_directory(tmp_path):
    t = _trained(seed=2)
    store = FsStore(str(tmp_path))
    ckpt = Checkpointer(TrainState(model=t.model), CheckpointConfig(store="local"), store=store)
    ckpt.save(3)
    ckpt.close()
    target = {"model": TinyLM().state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "step_000000003"), no_dist=True)
    for k, v in t.model.state_dict().items():
        assert torch.equal(target["model"][k], v), k


# --- FSDP2 at world size 2 -> 1 and 3, through our reader ------------------------------------

def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_worker(rank, world_size, port, root, phase):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    join_group(port, rank, world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0 if phase == "save" else 100 + world_size)
        model = TinyLM(dim=32, layers=2, dropout=0.0)
        for layer in model.blocks.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model=model, optimizer=opt, extra={"rank": rank})
        ckpt = Checkpointer(state, CheckpointConfig(store="local"), store=FsStore(root))
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
