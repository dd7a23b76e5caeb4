"""``python -m gemini_ckpt <command>``: the command-line tools.

Each command lives next to the code it drives and registers itself with one function
``add_<name>_command(subcommands)`` that adds its sub-parser and sets ``func`` (which returns
the exit status). To add a command, append its registration function to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Optional

from .chaos._cli import add_chaos_command
from .cli.durable import add_ls_command, add_verify_command
from .cli.status import add_status_command
from .demo.cli import add_demo_command

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_status_command,
    add_ls_command,
    add_verify_command,
    add_demo_command,
    add_chaos_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gemini_ckpt", description="In-memory, peer-replicated checkpointing: tools."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subcommands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
