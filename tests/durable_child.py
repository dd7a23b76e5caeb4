"""Child process for the kill-mid-persist test: trains and persists every 3rd step to a
filesystem whose write of step 5's DCP metadata hangs, so the parent can SIGKILL it there."""

import sys
import warnings

import torch

from gemini_ckpt.chaos import faulty_filesystem
from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.toy import build_training, lm_loss

root, refs = sys.argv[1], sys.argv[2]
warnings.simplefilter("ignore")
fs, _ = faulty_filesystem(stall_on="step_000000005/.metadata")
t = build_training(seed=0, dataset_size=32)
state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
ckpt = Checkpointer(
    state,
    CheckpointConfig(store="local", persist_every=3, keep_durable=5),
    durable=DurableTier(filesystem=fs, root=root, keep=5),
)
batches = t.batches()
for step in range(10):
    lm_loss(t.model, next(batches)).backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    handle = ckpt.save(step)
    if step == 2:
        handle.persisted.result(timeout=60)
        torch.save(t.model.state_dict(), f"{refs}/step2.pt")
        print("persisted 2", flush=True)
print("training done", flush=True)
ckpt.close()  # hangs: step 5's persist never finishes
