"""``python -m pipeline.cli``: the ``winnow`` command (what torchrun and the SLURM task scripts run)."""

import sys

from pipeline.cli import main

sys.exit(main())
