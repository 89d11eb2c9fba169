"""Convert checkpoints between Hugging Face and winnow's megatron format (``winnow convert`` without the CLI).

    .venv/bin/python tools/convert_checkpoint.py hf-to-megatron --hf HF_DIR --out RUN_DIR [--tp N --pp M]
    .venv/bin/python tools/convert_checkpoint.py megatron-to-hf --ckpt RUN_DIR --out HF_DIR [--dtype bf16]

Both verify the output by comparing logits before it appears under ``--out``; see
docs/conversion.md. Exit status 0 on success, 2 on a user error (bad input, failed gate).
"""

import sys

from pipeline.cli.convert import main

# The guard matters: the layout check spawns processes that re-import this file.
if __name__ == "__main__":
    sys.exit(main())
