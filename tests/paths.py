"""Where things are, for a test at any depth under ``tests/``: the repository's root and the
``tests`` folder (the support modules)."""

from __future__ import annotations

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
