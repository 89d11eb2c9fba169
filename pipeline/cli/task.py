"""What runs on a node for one campaign stage: ``python -m pipeline.cli.task ROLE --campaign-dir D --stage S``.

The roles are implemented in ``pipeline/launch/task.py``; this module parses the task
script's command line (``pipeline/launch/nemo.py`` writes it). A user error prints one
``error:`` line and exits 2, which the job script never requeues.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.cli.common import run_handler
from pipeline.launch.task import ROLES, run_role


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.cli.task",
                                     description="run this node's part of one campaign stage")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--campaign-dir", required=True, help="the campaign's output directory (campaign.json)")
    parser.add_argument("--stage", required=True, help="the stage's name in the plan")
    parser.epilog = "node role: `... -- COMMAND` runs COMMAND (torchrun) to start this node's ranks"
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    launcher = argv[split + 1 :]
    args.handler = lambda parsed: run_role(parsed.role, campaign_dir=parsed.campaign_dir, stage_name=parsed.stage,
                                           launcher=launcher)
    return run_handler(args)


if __name__ == "__main__":
    sys.exit(main())
