"""What every command-line entry point shares: a user error is one ``error:`` line and exit 2."""

from __future__ import annotations

import argparse
import sys

from pipeline.errors import EXIT_USER_ERROR, UserError


def run_handler(args: argparse.Namespace) -> int:
    """Call the parsed command's ``handler``; a ``UserError`` or missing file prints ``error: ...`` and returns 2.

    Anything else is a bug and keeps its traceback.
    """
    try:
        return args.handler(args)
    except (UserError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
