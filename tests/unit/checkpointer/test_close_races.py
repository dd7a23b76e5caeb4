"""close() and abort() against a save() on another thread, and an interrupt inside save():
saves after close() are refused, every handle a save() returned resolves,
and an interrupted save() gives its in-flight slot back."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from torch import nn

from gemini_ckpt import CheckpointConfig, CheckpointError, Checkpointer, TrainState
from gemini_ckpt import faults

DEADLINE_S = 60


def _checkpointer(**kw) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    kw.setdefault("timeout_s", 30)
    return Checkpointer(TrainState(model=model), CheckpointConfig(store="local", namespace=uuid.uuid4().hex, **kw))


def _saver(ckpt: Checkpointer, handles: list, refused: list, errors: list, stop: threading.Event) -> None:
    step = 1  # step 0 is saved before the race
    while not stop.is_set():
        try:
            handles.append(ckpt.save(step))
        except CheckpointError as exc:
            refused.append((step, exc))
            if ckpt.closed:
                return
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)
            return
        step += 1


@pytest.mark.parametrize("how", ["close", "abort"])
def test_close_from_another_thread_refuses_later_saves_and_every_handle_resolves(how):
    for trial in range(10):  # the race lands at a different point of save() each time
        ckpt = _checkpointer(keep_in_memory=2)
        ckpt.save(0).committed.result(timeout=DEADLINE_S)
        handles: list = []
        refused: list = []
        errors: list = []
        stop = threading.Event()
        thread = threading.Thread(target=_saver, args=(ckpt, handles, refused, errors, stop), daemon=True)
        thread.start()
        while len(handles) < 2 + trial:
            assert thread.is_alive(), errors
            time.sleep(0.001)
        getattr(ckpt, how)()
        closed_with = len(handles)
        stop.set()
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive(), "save() hung after close()"
        assert not errors, errors
        # at most the save() that was past the closing check when close() ran is accepted after it
        assert len(handles) <= closed_with + 1, f"trial {trial}: saves accepted after {how}() returned"
        for h in handles:
            for fut in (h.committed, h.health, h.persisted):
                try:
                    fut.result(timeout=DEADLINE_S)
                except CheckpointError:
                    assert how == "abort"  # close() waits for them; abort() may fail the ones in flight
        with pytest.raises(CheckpointError, match="closed"):
            ckpt.save(10_000)


def test_an_interrupt_right_after_the_slot_is_taken_gives_it_back():
    ckpt = _checkpointer(keep_in_memory=2, max_inflight=1)
    ckpt.save(0).committed.result(timeout=DEADLINE_S)

    def interrupt(phase, **ctx):
        if phase == "admitted" and ctx["step"] == 1:  # right after the slot is taken
            raise KeyboardInterrupt

    faults.set_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(1)
    finally:
        faults.set_hook(None)
    assert ckpt.inflight == 0
    ckpt.save(2).committed.result(timeout=DEADLINE_S)  # would wait timeout_s for the leaked slot, then fail
    ckpt.close()
    assert ckpt.store.committed_steps()[-1] == 2


def test_wait_persisted_right_after_save_waits_for_that_version(tmp_path):
    ckpt = _checkpointer(keep_in_memory=2, durable_uri=str(tmp_path), persist_every=1)
    handle = ckpt.save(0)
    ckpt.wait_persisted()
    assert handle.persisted.done(), "wait_persisted() returned before the save() before it was persisted"
    assert 0 in ckpt.durable.complete_steps()
    ckpt.close()


def test_abort_while_a_save_is_handing_off_refuses_that_save_with_a_checkpoint_error():
    """The race the loop above hits now and then, pinned: abort() closes the store while another
    thread's save() is between staging and the hand-off. That save() gets a CheckpointError
    naming the abort, not the store's own "cannot schedule new futures after shutdown"."""

    ckpt = _checkpointer(keep_in_memory=2)
    ckpt.save(0).committed.result(timeout=DEADLINE_S)
    at_handoff, aborted = threading.Event(), threading.Event()

    def hook(phase, **ctx):
        if phase == "replicate" and ctx["step"] == 1:
            at_handoff.set()
            assert aborted.wait(DEADLINE_S)

    outcome: list = []

    def save_one():
        try:
            outcome.append(ckpt.save(1))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            outcome.append(exc)

    faults.set_hook(hook)
    try:
        thread = threading.Thread(target=save_one, daemon=True)
        thread.start()
        assert at_handoff.wait(DEADLINE_S)
        ckpt.abort()
        aborted.set()
        thread.join(timeout=DEADLINE_S)
    finally:
        faults.set_hook(None)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointError), outcome
    assert "aborted" in str(outcome[0])
    assert ckpt.inflight == 0


def test_a_closed_checkpointer_and_its_state_go_when_dropped_without_a_garbage_collection():
    # A cycle through the TrainState would keep the user's model, optimizer and loader (and a
    # loader's worker processes) alive until a full collection, which then shuts the workers down
    # from whichever thread runs it: 5 s per worker here. (torch's own cycles, such as a
    # scheduler and its optimizer, are not ours to break.)
    import gc
    import weakref

    from gemini_ckpt.toy import build_training, lm_loss

    gc.collect()
    gc.disable()
    try:
        t = build_training(seed=0, dataset_size=64)
        state = TrainState(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=t.loader)
        ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=uuid.uuid4().hex, timeout_s=30))
        for step, batch in zip(range(3), t.loader):  # the later saves take the fast path and its getters
            lm_loss(t.model, batch).backward()
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=True)
            ckpt.save(step)
        ckpt.wait()
        ckpt.close()
        assert ckpt.stats.saves == 3
        alive = {"checkpointer": weakref.ref(ckpt), "state": weakref.ref(state)}
        del ckpt, state
        assert [name for name, ref in alive.items() if ref() is not None] == []
    finally:
        gc.enable()
