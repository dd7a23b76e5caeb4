"""Shared by the ``test_trust_*`` files: verify before interpret, and any damaged version falls
back.

The jobs that save and restore (:data:`JOBS`) and their namespace, the pickle that runs code
when loaded with arbitrary globals (:class:`Evil`), and the fixture ``versions`` (a test file
takes it with ``from trust_support import versions as versions``).
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from toy_jobs import ToyJobs

JOBS = ToyJobs("trust-", dataloader=True)  # this module's jobs: the data loader is part of their state
NAMESPACE = JOBS.namespace

MARKER, METADATA, EXTRA_KEY = ".gemini_complete", ".metadata", "rank_local.0.extra"
NEWEST, OLDER = "step_000000001", "step_000000000"


class Evil:
    """A pickle that, when loaded with arbitrary globals, creates ``path``."""

    def __init__(self, path, how="system"):
        self.path, self.how = str(path), how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.path}",))
        return (eval, (f"open({self.path!r}, 'w').close()",))


def evil_pickle(path, how="system") -> bytes:
    """The bytes of an :class:`Evil` pickle."""
    return pickle.dumps(Evil(path, how))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A durable directory with two good versions (steps 0 and 1) and the model at each."""
    return JOBS.make_versions(tmp_path_factory.mktemp("versions") / "d")


# --- forging: what a writer of the storage directory can do without the key -------------------
def torch_saved(obj) -> bytes:
    """``obj`` as ``torch.save`` writes it."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
