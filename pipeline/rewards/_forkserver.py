"""The grading pool's forkserver preload: the forkserver dies with the process that started it.

Imported only by the forkserver (``GradingPool`` names this module in
``set_forkserver_preload``), never by the trainer: arming the death signal in an importer
that is not the forkserver would tie that process to its own parent.

Why the forkserver must die with the pool's owner: each forkserver child holds a copy of the
pipe whose end of file tells the forkserver its client is gone, so after a kill -9 of the
trainer the forkserver lives as long as any worker, and a worker's death signal, tied to the
forkserver (its parent), would never fire. Killed with its owner, it takes every worker with
it (``_worker.worker_main`` arms each child again: ``fork`` clears the setting).
"""

from __future__ import annotations

from pipeline.parallel.lifetime import exit_with_parent

# The forkserver's parent is the trainer; the trainer dying before this line leaves the
# forkserver with no client, and then it exits at its pipe's end of file by itself.
exit_with_parent(parent_pid=None)

from pipeline.rewards import _worker  # noqa: E402, F401 - the preload proper: math-verify, sympy, the parser, warm
