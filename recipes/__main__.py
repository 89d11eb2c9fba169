"""``python -m recipes``: write a paper preset (``recipes.papers``) as YAML for ``winnow rl --config``.

    python -m recipes d3s_qwen25_math_7b runs/papers/d3s.yaml
    python -m recipes --list

The command line itself is ``pipeline.cli.presets`` (argparse lives in the CLI). It starts
here rather than in ``recipes/papers.py``, which the CLI imports: the presets never import
the CLI back.
"""

from __future__ import annotations

import sys

from pipeline.cli.presets import main

if __name__ == "__main__":
    sys.exit(main())
