"""Warm Train workers: the imports a worker needs, done as its process starts, in Ray Train's
workers only.

A replacement worker (and the warm spare that becomes one, :mod:`._spares`) spends most of its
start importing torch, Ray Train and the training function's modules. Ray can run a setup hook
in every new worker process of a runtime env before it is given work: the Train workers' runtime
env (``RunConfig(worker_runtime_env=...)``) names :func:`warm_up` as the hook and the modules in
``GEMINI_CKPT_WARM_MODULES``. No other Ray worker pays for them: host stores import no torch
(torch and Ray Train would take several times a store's own start, docs/recovery.md), and
neither do Ray's own actors
that a replacement node starts beside the new worker, so the new worker's imports get the cores.
Ray's cluster-wide ``RAY_preload_python_modules`` (:func:`~.ray_train.preload_env`) makes every
one of those processes import everything.

The hook is named through Ray's environment variable for it (a runtime env's
``worker_process_setup_hook`` is read only from the job's runtime env, not from an actor's),
internal to Ray 2.60 like the rest of the in-place path; ``test_inplace_adapter`` checks it.
An actor a Train worker creates inherits its runtime env, hook included; gemini_ckpt's own
actors clear it (:data:`gemini_ckpt.hoststore.names.ACTOR_ENV`).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Optional

from ..errors import ConfigError
from ..hoststore.names import SETUP_HOOK_VAR

log = logging.getLogger("gemini_ckpt")

MODULES_VAR = "GEMINI_CKPT_WARM_MODULES"
HOOK = "gemini_ckpt.integrations._warm.warm_up"


def warm_up() -> None:
    """Ray's setup hook in a Train worker's new process: import every module named in
    ``GEMINI_CKPT_WARM_MODULES``. One that fails to import is logged and skipped (the training
    function imports it again and raises there, as without the hook)."""
    for name in filter(None, os.environ.get(MODULES_VAR, "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - never end a worker over a warm-up
            log.warning(
                "gemini_ckpt: warming up this worker, importing %s failed: %s: %s", name, type(exc).__name__, exc
            )


def check_modules(what: str, modules) -> None:
    for name in modules:
        if not isinstance(name, str) or not name or not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"{what}({name!r}): a module name such as 'transformers'")


def runtime_env(modules: tuple[str, ...], base: Optional[dict]) -> dict:
    """``base`` (a runtime env dict, not changed) with the hook and ``modules`` added."""
    if base is not None and not isinstance(base, dict):
        raise ConfigError(
            f"warm_runtime_env(runtime_env={base!r}): a runtime env dict such as {{'env_vars': {{...}}}}, or None"
        )
    out = dict(base or {})
    env_vars = dict(out.get("env_vars") or {})
    if env_vars.get(SETUP_HOOK_VAR, HOOK) != HOOK:
        raise ConfigError(
            f"warm_runtime_env: runtime_env's env_vars already name a setup hook "
            f"({env_vars[SETUP_HOOK_VAR]!r}); call it from a hook of your own instead"
        )
    env_vars[SETUP_HOOK_VAR] = HOOK
    env_vars[MODULES_VAR] = ",".join(dict.fromkeys(modules))
    out["env_vars"] = env_vars
    return out
