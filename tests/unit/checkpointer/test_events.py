"""Checkpoint events (:class:`gemini_ckpt.CheckpointListener`), and what integrations need from the
core: ``peek()`` before the state exists, ``restore(rng=False)`` with the RNG applied later, and a
``TrainState`` whose optimizer is attached after the Checkpointer was built."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from torch import nn

from gemini_ckpt import CheckpointConfig, CheckpointError, CheckpointListener, Checkpointer, HealthCheck, TrainState


class Recorder(CheckpointListener):
    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.threads: set[str] = set()

    def _note(self, *item) -> None:
        self.seen.append(item)
        self.threads.add(threading.current_thread().name)

    def on_start(self, ckpt):
        self.seen.append(("start", ckpt.rank))

    def on_committed(self, event):
        self._note("committed", event.step, dict(event.metrics), event.health.status)

    def on_unhealthy(self, event):
        self._note("unhealthy", event.step)

    def on_persisted(self, event):
        self._note("persisted", event.step, event.location is not None)

    def on_failed(self, event):
        self._note("failed", event.step, event.stage)

    def on_restored(self, event):
        self._note("restored", event.step, event.result.source)

    def on_close(self, ckpt, *, aborted):
        self.seen.append(("close", aborted))


def _state(seed: int = 0, *, optimizer: bool = True):
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if optimizer else None
    return model, opt, TrainState(model=model, optimizer=opt, extra={"tokens": 0})


def _step(model, opt) -> None:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _config(tmp_path, namespace, **kw):
    return CheckpointConfig(
        store="local", namespace=namespace, durable_uri=str(tmp_path / "durable"), persist_every=2, **kw
    )


def test_listeners_hear_every_version_in_order_off_the_training_thread(tmp_path):
    namespace = f"ev-{uuid.uuid4().hex}"
    model, opt, state = _state()
    rec = Recorder()
    ckpt = Checkpointer(
        state, _config(tmp_path, namespace, health_check=HealthCheck(on_unhealthy="warn")), listeners=[rec]
    )
    for step in range(4):
        _step(model, opt)
        ckpt.save(step, metrics={"loss": float(step)})
    ckpt.close()
    assert rec.seen[0] == ("start", 0) and rec.seen[-1] == ("close", False)
    assert [e for e in rec.seen if e[0] == "committed"] == [
        ("committed", s, {"loss": float(s)}, "healthy") for s in range(4)
    ]
    persisted = [e[1] for e in rec.seen if e[0] == "persisted"]
    assert persisted == [s for s in range(4) if ckpt.persist_policy.should_persist(s)] and persisted
    for step in persisted:  # a version's durable copy is told after its commit
        assert rec.seen.index(("committed", step, {"loss": float(step)}, "healthy")) < rec.seen.index(
            ("persisted", step, True)
        )
    assert rec.threads == {"gemini-ckpt-events"}

    rec2 = Recorder()
    _, _, fresh = _state(seed=1)
    again = Checkpointer(fresh, _config(tmp_path, namespace), listeners=[rec2])
    again.restore()
    again.close()
    assert rec2.seen == [("start", 0), ("restored", 3, "memory"), ("close", False)]


def test_an_unhealthy_version_is_told_before_its_commit_and_never_persisted(tmp_path):
    model, opt, state = _state()
    rec = Recorder()
    ckpt = Checkpointer(
        state,
        _config(tmp_path, f"ev-{uuid.uuid4().hex}", health_check=HealthCheck(on_unhealthy="warn")),
        listeners=[rec],
    )
    _step(model, opt)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    ckpt.save(1)
    ckpt.close()
    events = [e[:2] for e in rec.seen if e[0] not in ("start", "close")]
    assert events == [("unhealthy", 1), ("committed", 1)]


def test_what_a_listener_raises_surfaces_on_the_training_thread(tmp_path):
    class Broken(CheckpointListener):
        def on_committed(self, event):
            raise ValueError("the metrics service is down")

    model, opt, state = _state()
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=f"ev-{uuid.uuid4().hex}"), listeners=[Broken()]
    )
    _step(model, opt)
    ckpt.save(0)
    with pytest.raises(CheckpointError, match="Broken failed on committed step 0.*metrics service is down"):
        ckpt.close()


def test_a_blocking_listener_does_not_stall_save(tmp_path):
    release = threading.Event()

    class Slow(CheckpointListener):
        def on_committed(self, event):
            release.wait(30)

    model, opt, state = _state()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=f"ev-{uuid.uuid4().hex}"), listeners=[Slow()])
    t0 = time.monotonic()
    for step in range(3):
        _step(model, opt)
        ckpt.save(step)
        ckpt.wait()  # committed, though the listener holds the first event
    assert time.monotonic() - t0 < 20
    release.set()
    ckpt.close()


def test_a_listener_added_after_start_is_refused():
    model, opt, state = _state()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=f"ev-{uuid.uuid4().hex}"))
    _step(model, opt)
    ckpt.save(0)
    with pytest.raises(CheckpointError, match="listeners="):
        ckpt.add_listener(Recorder())
    with pytest.raises(TypeError, match="CheckpointListener"):
        Checkpointer(state, CheckpointConfig(store="local"), listeners=[object()])
    ckpt.close()


def test_peek_then_attach_then_restore_with_the_rng_applied_later():
    namespace = f"ev-{uuid.uuid4().hex}"
    model, opt, state = _state()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", namespace=namespace))
    for step in range(3):
        _step(model, opt)
        state.extra["tokens"] = 100 * step
        ckpt.save(step)
    expected_draws = torch.rand(3)  # what the saved RNG draws next: state at save(2), as nothing drew since
    ckpt.close()

    fresh_model, _, fresh = _state(seed=9, optimizer=False)
    again = Checkpointer(fresh, CheckpointConfig(store="local", namespace=namespace))
    peeked = again.peek()
    assert (peeked.step, peeked.source, peeked.extra) == (2, "memory", {"tokens": 200})
    assert fresh.extra == {"tokens": 0}  # nothing loaded yet
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    fresh.attach(optimizer=fresh_opt)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    result = again.restore(step=peeked.step, rng=False)
    assert torch.equal(torch.get_rng_state(), before), "rng=False leaves the process RNG alone"
    assert torch.equal(fresh_model.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert fresh.extra == {"tokens": 200}
    result.apply_rng()
    assert torch.equal(torch.rand(3), expected_draws)
    again.close()


def test_peek_finds_nothing_on_a_fresh_start_and_skips_an_unhealthy_version():
    namespace = f"ev-{uuid.uuid4().hex}"
    model, opt, state = _state()
    ckpt = Checkpointer(
        state, CheckpointConfig(store="local", namespace=namespace, health_check=HealthCheck(on_unhealthy="warn"))
    )
    assert ckpt.peek() is None
    _step(model, opt)
    ckpt.save(0)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    ckpt.save(1)
    ckpt.close()
    _, _, fresh = _state(optimizer=False)
    again = Checkpointer(fresh, CheckpointConfig(store="local", namespace=namespace))
    assert again.peek().step == 0
    again.close()
