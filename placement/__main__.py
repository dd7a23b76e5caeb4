"""``python -m placement``: see ``placement._cli``."""

import sys

from ._cli import main

sys.exit(main())
