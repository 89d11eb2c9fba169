"""What every command-line entry point shares: inputs checked first; a user error is ``error:`` lines and exit 2."""

from __future__ import annotations

import argparse
import sys

from pipeline.errors import EXIT_USER_ERROR, CheckpointWriteError, UserError


def run_handler(args: argparse.Namespace) -> int:
    """Check the command's inputs (``args.inputs``, see ``pipeline.stages.preflight``), then call its ``handler``.

    A ``UserError`` or a missing file prints ``error: ...`` (one line per input at fault)
    and returns 2, before anything was trained or generated when the preflight caught
    it. A failed checkpoint write prints its one line too but returns 1: the environment
    failed, so a SLURM job is requeued and resumes. Anything else is a bug and keeps its
    traceback.
    """
    try:
        inputs = getattr(args, "inputs", None)
        if inputs is not None:
            from pipeline.stages.preflight import preflight

            for note in preflight(inputs(args)):
                print(note, flush=True)
        return args.handler(args)
    except (UserError, FileNotFoundError) as error:
        for line in getattr(error, "problems", None) or [str(error)]:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except CheckpointWriteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
