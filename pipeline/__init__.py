"""winnow: RL post-training for reasoning LLMs (see docs/index.md).

Importing the package defers the ``torch.compile`` that megatron-core's import would otherwise run
on its fused kernels to their first call (``pipeline/deferred_compile.py``: about 1.1 CPU-seconds per
process that imports megatron).
"""

from pipeline import deferred_compile

deferred_compile.install()
