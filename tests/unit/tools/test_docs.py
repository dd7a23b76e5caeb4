"""The documentation site builds with warnings as errors (links, anchors, every page in the nav, the
API reference from the docstrings), every public name has a reference entry, and the README stays
a page a newcomer reads to the end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gemini_ckpt
import paths

ROOT = str(paths.ROOT)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Load the newest healthy committed version" in api  # restore()'s docstring, rendered


def test_every_public_name_has_a_reference_entry():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        api = f.read()
    entries = {line.split()[1].rsplit(".", 1)[-1] for line in api.splitlines() if line.startswith("::: ")}
    missing = [n for n in gemini_ckpt.__all__ if n not in entries and n not in ("ray_train", "__version__")]
    assert not missing, f"no reference entry in docs/api.md for {missing}"
    assert "::: gemini_ckpt.integrations.ray_train" in api


def test_every_page_is_in_the_nav_and_the_readme_is_short():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read()
    pages = sorted(p for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    assert [p for p in pages if p not in nav] == []
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) < 200
    for page in pages:
        if page != "index.md":
            assert f"docs/{page}" in readme, f"the README does not link docs/{page}"
