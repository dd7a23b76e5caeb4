"""``python -m benchmarks [--quick]``: run every benchmark and write results/summary.md (see run_all.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_all import main  # noqa: E402

sys.exit(main())
