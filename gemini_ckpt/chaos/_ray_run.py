"""What the chaos runs on Ray Train share (the in-place and the elastic matrices): the demo job's
progress actor, Ray Train's health-check settings for a run, and ``fit()`` on a thread inside the
run's host stores, so that the main thread stays free to add and remove hosts."""

from __future__ import annotations

import contextlib
import os
import threading


def progress_actor(name: str):
    """The run's progress actor (the demo job's events), on the head node."""
    import ray

    from ..demo.job import RAY_NAMESPACE, Progress

    return (
        ray.remote(Progress)
        .options(
            name=f"{name}::progress", namespace=RAY_NAMESPACE, num_cpus=0, resources={"node:__internal_head__": 0.001}
        )
        .remote()
    )


@contextlib.contextmanager
def detection():
    """Ray Train's health-check settings for the runs (its controller reads them from this
    process's environment at ``fit()``), put back as they were afterwards."""
    from ..integrations.ray_train import detection_env

    settings = detection_env(poll_s=0.25, hang_s=5.0)
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fit_on_thread(trainer, ckpt_config, name: str) -> tuple[threading.Thread, dict]:
    """``trainer.fit()`` inside the run's host stores, on a started thread; the box gets its
    ``result`` or its ``error``."""
    from ..integrations.ray_train import host_stores

    box: dict = {}

    def fit() -> None:
        try:
            with host_stores(ckpt_config, run_name=name):
                box["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported as the scenario's outcome
            box["error"] = exc

    thread = threading.Thread(target=fit, name=f"chaos-{name}", daemon=True)
    thread.start()
    return thread, box
