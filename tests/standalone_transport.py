"""The data-plane transport loaded on its own, as a package outside gemini_ckpt (it imports
nothing of the library; test_transport_interface.py checks that): shared by the transport tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TRANSPORT_DIR = Path(__file__).resolve().parents[1] / "gemini_ckpt" / "dataplane"
SECRET = b"test-namespace-secret-0123456789"
NS = "ns-transport"
NAME = "_standalone_gemini_transport"


def load_standalone():
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            NAME, TRANSPORT_DIR / "__init__.py", submodule_search_locations=[str(TRANSPORT_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]
