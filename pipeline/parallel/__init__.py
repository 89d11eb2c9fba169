"""The only package (with the trainer) that touches ``torch.distributed`` and megatron's ``parallel_state``.

* ``context``: ``ParallelContext`` (initialization, ranks, groups, reducers).
* ``reducers``: ``GroupReducer``, the distributed ``Reducer`` for pure loss code.
* ``cpu_compat``: megatron-core on CPU + gloo (a no-op with CUDA).

Submodules are imported explicitly (``context`` imports megatron-core).
"""
