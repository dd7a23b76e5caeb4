"""Save -> rebuild everything from scratch -> restore -> continue is bit-identical."""

from __future__ import annotations

import uuid

import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, TrainState
from gemini_ckpt.toy import build_training, lm_loss


def _config(ns: str) -> CheckpointConfig:
    return CheckpointConfig(store="local", namespace=ns, keep_in_memory=2)


def _state(t, *, grads=False, extra=None) -> TrainState:
    return TrainState(
        model=t.model,
        optimizer=t.optimizer,
        scheduler=t.scheduler,
        dataloader=t.loader,
        extra=extra if extra is not None else {"tokens_seen": 0},
        grads=grads,
    )


def _train(t, state, batches, steps, *, accumulate=1, ckpt=None, save_at=None, save_mid_accum=None):
    """Run ``steps`` optimizer steps; return the per-micro-batch losses."""
    losses = []
    for step in steps:
        for micro in range(accumulate):
            batch = next(batches)
            loss = lm_loss(t.model, batch) / accumulate
            loss.backward()
            losses.append(loss.item())
            state.extra["tokens_seen"] += batch.numel()
            if ckpt is not None and save_mid_accum == (step, micro):
                ckpt.save(step * 100 + micro)
                return losses
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        if ckpt is not None and step == save_at:
            ckpt.save(step)
    return losses


def _assert_same_training_state(a, b):
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb), na
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name]), (k, name)
    assert a.scheduler.state_dict()["last_epoch"] == b.scheduler.state_dict()["last_epoch"]


@pytest.mark.parametrize("workers", [0, 2])
def test_restore_into_rebuilt_objects_continues_bit_identically(workers):
    ns = f"resume-{uuid.uuid4().hex}"
    ref = build_training(seed=0, num_workers=workers, dataset_size=64)
    ref_state = _state(ref)
    ckpt = Checkpointer(ref_state, _config(ns))
    batches = ref.batches()
    torch.manual_seed(7)  # dropout draws from here: part of the saved RNG state
    _train(ref, ref_state, batches, range(0, 6), ckpt=ckpt, save_at=5)
    ckpt.wait()
    # The reference keeps going; 6..13 crosses an epoch boundary (64 samples / 8 per batch).
    expected = _train(ref, ref_state, batches, range(6, 14))
    ckpt.close()

    # Everything rebuilt from scratch, with different seeds, and the global RNGs disturbed.
    new = build_training(seed=99, num_workers=workers, dataset_size=64)
    new_state = _state(new, extra={"tokens_seen": -1, "junk": 1})
    torch.manual_seed(12345)
    ckpt2 = Checkpointer(new_state, _config(ns))
    result = ckpt2.restore()
    assert result is not None and result.step == 5 and result.source == "memory"
    assert new_state.extra == {"tokens_seen": 6 * 8 * 17}  # 6 batches of 8 sequences of 17 tokens
    got = _train(new, new_state, new.batches(), range(6, 14))
    assert got == expected
    _assert_same_training_state(ref, new)
    ckpt2.close()


def test_save_mid_accumulation_with_grads_resumes_exactly():
    ns = f"accum-{uuid.uuid4().hex}"
    ref = build_training(seed=1, dataset_size=64)
    ref_state = _state(ref, grads=True)
    ckpt = Checkpointer(ref_state, _config(ns))
    batches = ref.batches()
    _train(ref, ref_state, batches, range(0, 3), accumulate=4)
    # Save after micro-batch 1 of step 3: two micro-batches' gradients are accumulated.
    _train(ref, ref_state, batches, [3], accumulate=4, ckpt=ckpt, save_mid_accum=(3, 1))
    ckpt.wait()
    grads_at_save = {n: p.grad.clone() for n, p in ref.model.named_parameters() if p.grad is not None}
    assert grads_at_save
    # Finish step 3 (micro-batches 2, 3) and two more steps.
    expected = _finish_accumulation(ref, ref_state, batches, micro_left=2, accumulate=4, more_steps=2)
    ckpt.close()

    new = build_training(seed=2, dataset_size=64)
    new_state = _state(new, grads=True, extra={})
    ckpt2 = Checkpointer(new_state, _config(ns))
    result = ckpt2.restore()
    assert result.step == 301
    for n, p in new.model.named_parameters():
        assert torch.equal(p.grad, grads_at_save[n]), n
    got = _finish_accumulation(new, new_state, new.batches(), micro_left=2, accumulate=4, more_steps=2)
    assert got == expected
    _assert_same_training_state(ref, new)
    ckpt2.close()


def _finish_accumulation(t, state, batches, *, micro_left, accumulate, more_steps):
    losses = []
    for _ in range(micro_left):
        loss = lm_loss(t.model, next(batches)) / accumulate
        loss.backward()
        losses.append(loss.item())
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    losses += _train(t, state, batches, range(more_steps), accumulate=accumulate)
    return losses


def test_mutating_live_state_after_save_does_not_change_the_snapshot():
    ns = f"alias-{uuid.uuid4().hex}"
    t = build_training(seed=3, dataset_size=32)
    state = _state(t)
    ckpt = Checkpointer(state, _config(ns))
    batches = t.batches()
    _train(t, state, batches, range(2))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    exp_avg_before = {k: v["exp_avg"].clone() for k, v in t.optimizer.state.items()}
    handle = ckpt.save(1)
    # Mutate in place before the background work can have finished serializing.
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1000.0)
        for v in t.optimizer.state.values():
            v["exp_avg"].mul_(-3.0)
    state.extra["tokens_seen"] = -5
    handle.committed.result(timeout=60)
    ckpt.restore()
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]), n
    for k, v in t.optimizer.state.items():
        assert torch.equal(v["exp_avg"], exp_avg_before[k])
    assert state.extra["tokens_seen"] != -5
    ckpt.close()


def test_staging_segments_are_reused_across_saves():
    # A version lives in the segment it was staged into: keep_in_memory versions plus the one
    # being saved need that many segments, and from then on every save reuses a released one.
    ns = f"reuse-{uuid.uuid4().hex}"
    t = build_training(seed=4, dataset_size=32)
    state = _state(t)
    config = _config(ns)
    ckpt = Checkpointer(state, config)
    batches = t.batches()
    seen = []
    for step in range(8):
        _train(t, state, batches, [step])
        ckpt.save(step).committed.result()
        seen.append((ckpt.stats.staging_allocations, ckpt.stats.staging_bytes))
    ckpt.close()
    model_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())
    assert seen[0][1] >= 3 * model_bytes  # params + exp_avg + exp_avg_sq
    segments = config.keep_in_memory + config.max_inflight
    assert [a for a, _ in seen] == [min(i + 1, segments) for i in range(8)], seen
    assert len({b for _, b in seen}) == 1 and ckpt.stats.plans == 1


def test_keep_in_memory_retains_only_the_newest_versions():
    ns = f"keep-{uuid.uuid4().hex}"
    t = build_training(seed=5, dataset_size=32)
    state = _state(t)
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=ns, keep_in_memory=3))
    batches = t.batches()
    for step in range(7):
        _train(t, state, batches, [step])
        ckpt.save(step)
    ckpt.wait()
    assert ckpt.store.committed_steps() == [4, 5, 6]
    ckpt.close()


def test_restore_on_an_empty_namespace_returns_none():
    t = build_training(seed=6, dataset_size=32)
    ckpt = Checkpointer(_state(t), _config(f"empty-{uuid.uuid4().hex}"))
    assert ckpt.restore() is None
    ckpt.close()


def test_new_checkpointer_in_same_process_shares_versions_by_namespace():
    ns = f"share-{uuid.uuid4().hex}"
    t = build_training(seed=7, dataset_size=32)
    a = Checkpointer(_state(t), _config(ns))
    a.save(0)
    a.close()
    b = Checkpointer(_state(build_training(seed=8, dataset_size=32)), _config(ns))
    other = Checkpointer(_state(build_training(seed=8, dataset_size=32)), _config(ns + "-other"))
    assert b.restore().step == 0
    assert other.restore() is None
    for c in (b, other):
        c.close()


def test_the_plan_is_built_once_and_again_only_when_the_structure_changes():
    t = build_training(seed=0, num_workers=0, dataset_size=64)
    state = _state(t)
    batches = iter(t.loader)
    with Checkpointer(state, _config(f"plan-{uuid.uuid4().hex}")) as ckpt:
        for step in range(4):
            _train(t, state, batches, [step], ckpt=ckpt, save_at=step)
            ckpt.wait()
        assert ckpt.stats.state_dicts == 1  # planned at the first version, cached since

        t.model.register_buffer("ema", torch.arange(3, dtype=torch.float32))  # a new tensor item
        extra = t.model.ema
        _train(t, state, batches, [4], ckpt=ckpt, save_at=4)
        ckpt.wait()
        replanned = ckpt.stats.state_dicts
        assert replanned > 1  # a new tensor: the cached plan no longer fits, planned again
        _train(t, state, batches, [5], ckpt=ckpt, save_at=5)
        ckpt.wait()
        assert ckpt.stats.state_dicts == replanned  # and cached again

        extra.zero_()
        assert ckpt.restore().step == 5
        assert torch.equal(extra, torch.arange(3, dtype=torch.float32))  # the re-planned item came back
