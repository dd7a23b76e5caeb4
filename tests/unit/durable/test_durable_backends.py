"""Durable backends by URI scheme (gemini_ckpt.durable.backends): a scheme registered in this
process, one an installed package declares as an entry point, pyarrow's own, and the errors of
a scheme nobody opens and of a backend that returns something else."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pyarrow.fs as pafs
import pytest
import torch

from gemini_ckpt import CheckpointConfig, Checkpointer, ConfigError, TrainState, register_durable_backend
from gemini_ckpt.durable.backends import open_uri, unregister_durable_backend
from gemini_ckpt.durable.tier import DurableTier

OPENED: list[str] = []


def _under(base: str):
    """An opener of ``vault://NAME`` URIs: a local directory under ``base``, through pyarrow's
    PyFileSystem (a filesystem pyarrow has no scheme for)."""

    def opener(uri: str):
        OPENED.append(uri)
        return pafs.PyFileSystem(pafs.FSSpecHandler(_fsspec_local())), os.path.join(base, uri.split("://", 1)[1])

    return opener


def _fsspec_local():
    import fsspec

    return fsspec.filesystem("file")


@pytest.fixture
def vault(tmp_path):
    register_durable_backend("vault", _under(str(tmp_path / "vault")))
    OPENED.clear()
    yield tmp_path / "vault"
    unregister_durable_backend("vault")


def test_a_registered_scheme_persists_stock_dcp_versions_through_its_backend(vault):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    config = CheckpointConfig(
        store="local", namespace=uuid.uuid4().hex, persist_every=2, durable_uri="vault://run-1", persist_on_close=False
    )
    ckpt = Checkpointer(TrainState(model=model), config)
    for step in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step).committed.result(timeout=60)
    ckpt.wait_persisted()
    ckpt.close()
    assert OPENED and all(u == "vault://run-1" for u in OPENED)
    assert DurableTier("vault://run-1").complete_steps() == [1, 3]
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(loaded, checkpoint_id=str(vault / "run-1" / "step_000000003"))  # a stock DCP checkpoint on disk
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_a_scheme_nobody_opens_is_a_config_error_that_says_how_to_add_one():
    config = CheckpointConfig(store="local", namespace=uuid.uuid4().hex, persist_every=2, durable_uri="nowhere://x/y")
    ckpt = Checkpointer(TrainState(model=torch.nn.Linear(2, 2)), config)
    with pytest.raises(ConfigError, match=r"no backend for scheme 'nowhere'.*register_durable_backend\('nowhere'"):
        ckpt.restore()  # the Checkpointer starts at its first restore or save
    ckpt.close()


def test_a_backend_must_return_a_filesystem_and_a_root():
    register_durable_backend("broken", lambda uri: "/tmp")
    try:
        with pytest.raises(ConfigError, match="returned str, not"):
            open_uri("broken://x")
    finally:
        unregister_durable_backend("broken")
    with pytest.raises(ConfigError, match="a URI scheme"):
        register_durable_backend("s3://", lambda uri: None)


def test_pyarrows_own_schemes_and_local_paths_need_no_backend(tmp_path):
    fs, root = open_uri(f"file://{tmp_path}")
    assert isinstance(fs, pafs.LocalFileSystem) and root == str(tmp_path)
    fs, root = open_uri("relative/dir")
    assert isinstance(fs, pafs.LocalFileSystem) and root == os.path.abspath("relative/dir")


def test_an_installed_package_declares_a_backend_by_entry_point(tmp_path):
    """Every process finds it, the host stores included: a package on the path with an entry
    point in ``gemini_ckpt.durable_backends`` (here a module and its dist-info in a directory)."""
    (tmp_path / "acme_backend.py").write_text(
        "import pyarrow.fs as pafs\n"
        "def open_acme(uri):\n"
        "    return pafs.LocalFileSystem(), '/srv/acme/' + uri.split('://', 1)[1]\n"
    )
    info = tmp_path / "acme_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[gemini_ckpt.durable_backends]\nacme = acme_backend:open_acme\nbad = acme_backend:missing\n"
    )
    code = (
        "from gemini_ckpt.durable.backends import open_uri\n"
        "from gemini_ckpt import ConfigError\n"
        "fs, root = open_uri('acme://bucket/run')\n"
        "print(type(fs).__name__, root)\n"
        "try:\n    open_uri('bad://x')\nexcept ConfigError as e:\n    print('refused:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "LocalFileSystem /srv/acme/bucket/run"
    assert lines[1].startswith("refused:") and "acme_backend:missing" in lines[1] and "cannot be loaded" in lines[1]
