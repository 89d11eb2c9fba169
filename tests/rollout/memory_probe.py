"""Peak bytes of tensor storage allocated inside a block, counted storage by storage.

``StoragePeak`` is a ``TorchDispatchMode``: every ATen op run inside it (factories, copies,
``cat``, the collectives' output buffers, the byte tensors of pickled objects) reports its
output tensors; each new storage is counted until a weak reference says it was freed, and
the peak of the live sum is taken after every op. Storages that existed before the block
and are passed in ``exclude`` (the model's parameters: views of them allocate nothing) are
not counted. Not counted: memory outside tensors (Python objects, the transports' socket
buffers) and tensors allocated by C++ code that does not dispatch through ATen.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoragePeak(TorchDispatchMode):
    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, torch.Tensor)}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in self.excluded:
                    continue
                known = self.live.get(key)
                if known is None or known[0].expired():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        total = 0
        for key, (ref, num_bytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            else:
                total += num_bytes
        self.peak = max(self.peak, total)
        return out
