"""A durable backend registered only in the trainer's process (a scheme pyarrow does not know)
persists through the host stores: they write the data files in their own processes, with the
opener the trainer sends them."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState, register_durable_backend
from gemini_ckpt.durable.backends import unregister_durable_backend
from gemini_ckpt.durable.tier import DurableTier


def _vault(base: str, seen: str):
    """``vault://NAME`` -> ``base/NAME`` on the local disk; each process that opens one leaves
    its pid in ``seen``."""

    def opener(uri: str):
        import pyarrow.fs as pafs

        open(os.path.join(seen, str(os.getpid())), "w").close()
        return pafs.SubTreeFileSystem(base, pafs.LocalFileSystem()), uri.split("://", 1)[1]

    return opener


@pytest.mark.ray
def test_a_backend_registered_in_the_trainer_persists_through_the_host_stores(ray_cluster, tmp_path):
    import torch.distributed.checkpoint as dcp

    base, seen = tmp_path / "vault", tmp_path / "seen"
    base.mkdir()
    seen.mkdir()
    register_durable_backend("vault", _vault(str(base), str(seen)))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        config = CheckpointConfig(
            namespace=f"vault-{uuid.uuid4().hex[:8]}",
            replicas=1,
            persist_every=2,
            durable_uri="vault://run-1",
            persist_on_close=False,
            timeout_s=120,
            host_memory_budget_bytes=1 << 24,
        )
        ckpt = Checkpointer(TrainState(model=model), config)
        try:
            assert ckpt.store.capabilities.persists_itself  # the host stores write the data files
            for step in range(4):
                with torch.no_grad():
                    model.weight.add_(1.0)
                ckpt.save(step).committed.result(timeout=120)
            ckpt.wait_persisted()
        finally:
            ckpt.close()
        assert DurableTier("vault://run-1").complete_steps() == [1, 3]
        writers = {int(p.name) for p in seen.iterdir()}
        assert writers - {os.getpid()}, writers  # a host store's process opened it too
        loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        dcp.load(loaded, checkpoint_id=str(base / "run-1" / "step_000000003"))
        assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    finally:
        unregister_durable_backend("vault")
