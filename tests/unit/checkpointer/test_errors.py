"""gemini_ckpt.errors: one hierarchy, in one module, that survives a Ray actor boundary."""

from __future__ import annotations

import ast
import inspect
import pathlib
import pickle

import gemini_ckpt
from gemini_ckpt import errors
from gemini_ckpt.health import Health

PACKAGE = pathlib.Path(gemini_ckpt.__file__).parent

ERRORS = [
    obj
    for _, obj in inspect.getmembers(errors, inspect.isclass)
    if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
]

# Exception classes that may live elsewhere, and why.
ELSEWHERE = {
    "dataplane/": "the data plane is a self-contained package shipped to the stores by value",
    "chaos/": "the chaos harness's own failures (bad scenario, broken infrastructure), not the library's",
}


def test_every_error_is_a_checkpoint_error_and_pickles_with_its_message():
    assert len(ERRORS) >= 17
    for cls in ERRORS:
        assert issubclass(cls, errors.CheckpointError), cls
        error = pickle.loads(pickle.dumps(cls(f"{cls.__name__}: what went wrong and the fix")))
        assert type(error) is cls and str(error) == f"{cls.__name__}: what went wrong and the fix"
    health = Health("unhealthy", check="finite", item="model.weight", detail="1 NaN of 4 values", rank=0)
    error = pickle.loads(pickle.dumps(errors.UnhealthyVersionError("step 7 is unhealthy", step=7, health=health)))
    assert (error.step, error.health, str(error)) == (7, health, "step 7 is unhealthy")


def test_errors_users_can_meet_are_exported_from_the_package():
    for name in (
        "ConfigError",
        "ChecksumError",
        "DamagedFileError",
        "ReplicationError",
        "VersionNotFoundError",
        "UnhealthyVersionError",
        "FencedError",
        "BackgroundError",
        "CheckpointTimeoutError",
    ):
        assert getattr(gemini_ckpt, name) is getattr(errors, name) and name in gemini_ckpt.__all__


def test_no_exception_class_is_defined_outside_errors_py():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "errors.py" or any(rel.startswith(prefix) for prefix in ELSEWHERE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # a private class (``_Unreadable``) is one module's signal to itself and never leaves it
            if (
                isinstance(node, ast.ClassDef)
                and not node.name.startswith("_")
                and any(ast.unparse(base).endswith(("Error", "Exception")) for base in node.bases)
            ):
                found.append(f"{rel}: {node.name}")
    assert not found, f"exception classes outside gemini_ckpt/errors.py: {found}"
